"""`planaria plan`: ask the planner how a configured job would run on N nodes.

Turns a job config and a cost model (analytic here, from a hardware preset; profiled
by `planaria.runtime.planning.measured_costs.profiled_cost_model`) into the templates and the plan for N
nodes, and reports it as a table a person can read or as JSON for tools.

A node's agent plans with the analytic model and never computes: this module imports no
torch, not even inside a function (tests/test_import_graph.py), so the agent starts
without it. Profiling and the plan of a torchrun world are `planaria.runtime.worker.build`'s.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from planaria.runtime.config.sections import Config, model_shape
from planaria.templates.analytic import analytic_cost_model, gradient_element_bytes, hardware, sums_wide
from planaria.templates.costs import CostModel, ModelShape
from planaria.templates.job_templates import PlannerSettings
from planaria.templates.partition_cost import pipeline_iteration_time
from planaria.templates.planner import Planner, PlanChoice
from planaria.templates.snapshots import snapshot_host_bytes


@dataclass(frozen=True)
class PlanReport:
    planner: Planner
    choice: PlanChoice
    planning_time_s: float
    tokens_per_s: float
    mfu: float
    peak_memory_bytes: int
    snapshot_host_bytes: int = 0
    """The most host memory a node's workers keep for peer snapshots (`checkpoint.memory_*`);
    0 when they are off."""
    sync_bytes: float = 0.0
    """What a worker of the largest stage sends per step to sum gradients across the
    pipelines, in `sync_dtype`; 0 with one pipeline."""
    sync_dtype: str = "float32"
    """float64 with `train.exact_reduction` (or float64 training)."""
    wide_sum_bytes: float = 0.0
    """Of the peak memory, the float64 sums `train.exact_reduction` keeps of a float32 or
    bf16 job's gradients (the largest stage's, per device); 0 without them."""

    def check_host_memory(self) -> None:
        """ValueError, with the figures, when peer snapshots need more host memory on a
        node than the hardware has (unknown hardware: not checked)."""
        hw = self.planner.costs.hardware
        if hw.host_memory_bytes and self.snapshot_host_bytes > hw.host_memory_bytes:
            raise ValueError(
                f"peer snapshots need {self.snapshot_host_bytes / 2**30:.1f} GiB of host memory on a node, "
                f"a {hw.name} node has {hw.host_memory_bytes / 2**30:.1f} GiB: lower checkpoint.memory_copies, "
                "or set checkpoint.memory_every=0 (the disk checkpoint is then the only source beyond "
                "the replicas)")


def cost_model(cfg: Config, *, hardware_name: str, gpus_per_node: int) -> CostModel:
    """The job's analytic cost model, from the hardware preset (what an agent plans with;
    a computing process may profile instead: `planaria.runtime.planning.measured_costs.profiled_cost_model`)."""
    hw = hardware(hardware_name, gpus_per_node=gpus_per_node)
    return analytic_cost_model(model_shape(cfg.model), hw, tp=gpus_per_node, micro_batch=cfg.train.micro_batch,
                               dtype=cfg.train.dtype, recompute=cfg.train.recompute,
                               wide_gradients=wide_gradients(cfg))


def plan_job(cfg: Config, costs: CostModel, *, nodes: int, fault_tolerance: int) -> PlanReport:
    """The planner's choice for `nodes` nodes of `costs.hardware`, with its estimates."""
    gpus_per_node = costs.hardware.gpus_per_node
    started = time.perf_counter()
    planner = build_planner(cfg, costs, fault_tolerance=fault_tolerance)
    choice = planner.instantiate(nodes)
    planning_time = time.perf_counter() - started
    tokens = cfg.train.global_batch * cfg.model.seq_len
    devices = nodes * gpus_per_node
    flops = model_flops_per_token(model_shape(cfg.model)) * tokens
    mfu = flops / (choice.iteration_time_s * devices * costs.hardware.peak_flops)
    peak = max(max(planner.template(len(p.stages)).partition.peak_memory_bytes)
               for p in choice.plan.pipelines)
    snapshots = 0
    if cfg.checkpoint.memory_every:
        snapshots = max(snapshot_host_bytes(choice.plan, cfg.checkpoint.memory_copies,
                                            lambda layer: costs.layers[layer].held_bytes).values())
    sizes = [len(p.stages) for p in choice.plan.pipelines]
    wide = wide_gradients(cfg)
    synced = gradient_element_bytes(cfg.train.dtype, wide)
    # With wide sums, the float64 gradients kept in memory are the very ones synced.
    return PlanReport(planner, choice, planning_time, tokens / choice.iteration_time_s, mfu, peak, snapshots,
                      sync_bytes=planner.sync_bytes(sizes), sync_dtype="float64" if synced == 8 else "float32",
                      wide_sum_bytes=planner.stage_gradient_bytes(sizes) if wide else 0.0)


def wide_gradients(cfg: Config) -> bool:
    """Whether the job sums a float32 or bf16 job's gradients in float64 (`train.exact_reduction`)."""
    return sums_wide(cfg.train.dtype, cfg.train.exact_reduction)


def build_planner(cfg: Config, costs: CostModel, *, fault_tolerance: int | None = None) -> Planner:
    """The planner of a job: its config's batch, schedule and stage settings over `costs`."""
    p = cfg.parallel
    settings = PlannerSettings(
        fault_tolerance=cfg.fault_tolerance.f if fault_tolerance is None else fault_tolerance,
        global_batch=cfg.train.global_batch, micro_batch=cfg.train.micro_batch,
        schedule=p.schedule, virtual_stages=p.virtual_stages, min_stages=p.min_stages)
    return Planner(costs, settings)


def model_flops_per_token(shape: ModelShape) -> float:
    """Training FLOPs per token: 6 per parameter (forward 2, backward 4) plus attention."""
    attention = 12 * shape.n_layers * shape.d_model * shape.seq_len // 2  # causal: half of 12·L·d·T
    return 6 * shape.parameters + attention


def profile_cache_dir(cfg: Config) -> Path:
    """`parallel.profile_cache`, or the job's own `output.dir`/profile-cache."""
    return Path(cfg.parallel.profile_cache or Path(cfg.output.dir) / "profile-cache").expanduser()


def report_json(report: PlanReport) -> str:
    planner, choice = report.planner, report.choice
    templates = [
        {"nodes": size,
         "stages": [[start, stop - 1] for start, stop in t.partition.model_stages],
         "iteration_time_s": t.iteration_time(max(1, planner.settings.total_microbatches // max(
             1, planner.settings.fault_tolerance + 1)))}
        for size, t in sorted(planner.templates.items())
    ]
    return json.dumps({
        "n0": planner.n0,
        "planning_time_s": report.planning_time_s,
        "templates": templates,
        "plan": choice.plan.to_dict(),
        "estimate": {"iteration_time_s": choice.iteration_time_s, "tokens_per_s": report.tokens_per_s,
                     "mfu": report.mfu, "peak_memory_bytes": report.peak_memory_bytes,
                     "snapshot_host_bytes": report.snapshot_host_bytes,
                     "gradient_sync_bytes": report.sync_bytes, "gradient_sync_dtype": report.sync_dtype,
                     "float64_gradient_sum_bytes": report.wide_sum_bytes,
                     "replicas": choice.replicas, "degraded": choice.degraded},
        "idle_nodes": list(choice.idle_nodes),
        "idle_reason": choice.idle_reason,
    }, indent=1)


def print_report(report: PlanReport, console: Console) -> None:
    planner, choice, plan = report.planner, report.choice, report.choice.plan
    hw = planner.costs.hardware
    console.print(f"[bold]{len(choice.plan.pipelines)} pipelines[/] on {plan.world_size // plan.tp} "
                  f"{hw.name} nodes x {plan.tp} workers | n0 = {planner.n0} | "
                  f"f = {planner.settings.fault_tolerance} | schedule {plan.schedule}"
                  f" (v={plan.virtual_stages}) | cost model: {planner.costs.source}")
    if choice.idle_nodes:
        console.print(f"[yellow]warning:[/] {len(choice.idle_nodes)} of the "
                      f"{plan.world_size // plan.tp + len(choice.idle_nodes)} nodes are idle, no plan "
                      f"uses them all: {', '.join(choice.idle_nodes)}. Why: {choice.idle_reason}. "
                      "A running job keeps them waiting and plans them in at the next failure; "
                      "MFU below counts them.")
    if choice.degraded:
        console.print(f"[yellow]warning:[/] {plan.world_size // plan.tp} nodes are fewer than "
                      f"(f+1)·n0 = {(planner.settings.fault_tolerance + 1) * planner.n0}: only "
                      f"{choice.replicas} replica(s) of each layer; a failure may need the checkpoint")
    table = Table(title="plan")
    for column in ("pipeline", "template", "stages: layers", "microbatches", "est. time (s)", "bubble"):
        table.add_column(column)
    for i, (pipeline, t) in enumerate(zip(plan.pipelines, choice.pipeline_times_s)):
        stages = " | ".join(",".join(f"{a}-{b - 1}" for a, b in s.chunks) for s in pipeline.stages)
        partition = planner.template(len(pipeline.stages)).partition
        # The schedule's idle share: its own time, without the once-per-step update and commit.
        scheduled = pipeline_iteration_time(partition.stage_times, partition.send_times,
                                            pipeline.num_microbatches, plan.schedule, plan.virtual_stages)
        ideal = max(partition.stage_times) * pipeline.num_microbatches
        bubble = max(0.0, 1 - ideal / scheduled) if scheduled else 0.0
        table.add_row(str(i), pipeline.template_id, stages, str(pipeline.num_microbatches),
                      f"{t:.4g}", f"{bubble:.1%}")
    console.print(table)
    console.print(f"iteration {choice.iteration_time_s:.4g} s | {report.tokens_per_s:,.0f} tokens/s | "
                  f"MFU {report.mfu:.1%} | peak memory per device {report.peak_memory_bytes / 2**30:.2f} GiB "
                  f"of {hw.device_memory_bytes / 2**30:.1f} | planned in {report.planning_time_s:.3f} s")
    if report.sync_bytes:
        console.print(f"gradient sync across pipelines: {report.sync_bytes / 2**30:.2f} GiB sent per worker "
                      f"per step in {report.sync_dtype}")
    if report.wide_sum_bytes:
        console.print(f"train.exact_reduction: the float64 gradient sums take {report.wide_sum_bytes / 2**30:.2f} "
                      "GiB of the peak memory per device, and the sync twice float32's bytes (both counted "
                      "above: docs/planner.md, \"The gradient sync\")")
    if report.snapshot_host_bytes:
        room = f" of {hw.host_memory_bytes / 2**30:.1f}" if hw.host_memory_bytes else ""
        console.print(f"peer snapshots: {report.snapshot_host_bytes / 2**30:.2f} GiB of host memory per node "
                      f"at most{room} (two rounds of its own layers and the copies it keeps for others)")
