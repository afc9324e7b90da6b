"""`planaria plan`: ask the planner how a configured job would run on N nodes.

Turns a job config into a cost model (analytic with a hardware preset, or profiled on
this machine), builds the templates, instantiates the plan for N nodes, and reports
it as a table a person can read or as JSON for tools.

A node's agent plans with the analytic model and never computes: torch is imported only
where a profile is measured or a plan is broadcast, so the agent starts without it.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from planaria.runtime.config import Config, ConfigError, model_shape
from planaria.templates.analytic import analytic_cost_model, hardware
from planaria.templates.costs import CostModel, ModelShape
from planaria.templates.partition import pipeline_iteration_time
from planaria.templates.plan import Plan
from planaria.templates.planner import Planner, PlanChoice, PlannerSettings

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


@dataclass(frozen=True)
class PlanReport:
    planner: Planner
    choice: PlanChoice
    planning_time_s: float
    tokens_per_s: float
    mfu: float
    peak_memory_bytes: int


def cost_model(cfg: Config, *, hardware_name: str, gpus_per_node: int, profile: bool = False,
               cache_dir: Path | None = None, device: torch.device | None = None,
               concurrent_workers: int | None = None) -> CostModel:
    """The job's cost model: profiled on `device`, or analytic from the hardware preset.
    `concurrent_workers` (profiling on CPU): how many workers compute at once on this
    machine, default a node's `gpus_per_node`; counted at most one per core."""
    if profile:
        import torch

        from planaria.runtime.profile import profile_model

        if gpus_per_node != cfg.parallel.tp:
            cfg = replace(cfg, parallel=replace(cfg.parallel, tp=gpus_per_node))
        # CPU workers run one thread each under torchrun; profile the way they run.
        on_cpu = (device or torch.device("cuda" if torch.cuda.is_available() else "cpu")).type == "cpu"
        # CPU workers of one machine share its cores: profile beside as many busy ones.
        busy = min(concurrent_workers or gpus_per_node, os.cpu_count() or 1) if on_cpu else 1
        return profile_model(cfg, hardware_name=hardware_name, cache_dir=cache_dir, device=device,
                             num_threads=1 if on_cpu else None, concurrent_workers=busy)
    hw = hardware(hardware_name, gpus_per_node=gpus_per_node)
    return analytic_cost_model(model_shape(cfg.model), hw, tp=gpus_per_node, micro_batch=cfg.train.micro_batch,
                               dtype=cfg.train.dtype, recompute=cfg.train.recompute)


def plan_job(cfg: Config, *, nodes: int, gpus_per_node: int, fault_tolerance: int,
             hardware_name: str, profile: bool = False, cache_dir: Path | None = None,
             device: torch.device | None = None, concurrent_workers: int | None = None) -> PlanReport:
    costs = cost_model(cfg, hardware_name=hardware_name, gpus_per_node=gpus_per_node, profile=profile,
                       cache_dir=cache_dir, device=device, concurrent_workers=concurrent_workers)
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
    return PlanReport(planner, choice, planning_time, tokens / choice.iteration_time_s, mfu, peak)


def build_planner(cfg: Config, costs: CostModel, *, fault_tolerance: int | None = None) -> Planner:
    """The planner of a job: its config's batch, schedule and stage settings over `costs`."""
    p = cfg.parallel
    settings = PlannerSettings(
        fault_tolerance=p.fault_tolerance if fault_tolerance is None else fault_tolerance,
        global_batch=cfg.train.global_batch, micro_batch=cfg.train.micro_batch,
        schedule=p.schedule, virtual_stages=p.virtual_stages, min_stages=p.min_stages)
    return Planner(costs, settings)


def model_flops_per_token(shape: ModelShape) -> float:
    """Training FLOPs per token: 6 per parameter (forward 2, backward 4) plus attention."""
    attention = 12 * shape.n_layers * shape.d_model * shape.seq_len // 2  # causal: half of 12·L·d·T
    return 6 * shape.parameters + attention


def detect_hardware_name(device: torch.device) -> str:
    """The preset closest to this device, for the links and memory the profiler does not measure."""
    if device.type != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(device).lower()
    return next((preset for preset in ("h200", "h100", "a100") if preset in name), "h100")


def profile_cache_dir(cfg: Config) -> Path:
    """`parallel.profile_cache`, or the job's own `output.dir`/profile-cache."""
    return Path(cfg.parallel.profile_cache or Path(cfg.output.dir) / "profile-cache").expanduser()


def plan_for_world(cfg: Config, world_size: int, rank: int, device: torch.device,
                   group: dist.ProcessGroup | None = None) -> tuple[Plan, str]:
    """The planner's plan for `world_size` processes: made on rank 0, broadcast to all.

    Only rank 0 profiles and plans: measured times differ a little between processes,
    and every rank must run the very same plan. Returns the plan and a summary line.
    """
    import torch.distributed as dist

    payload: list = [None]
    if rank == 0:
        try:
            report = plan_job(cfg, nodes=world_size // cfg.parallel.tp, gpus_per_node=cfg.parallel.tp,
                              fault_tolerance=cfg.parallel.fault_tolerance,
                              hardware_name=detect_hardware_name(device), profile=True,
                              cache_dir=profile_cache_dir(cfg), device=device,
                              concurrent_workers=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
            summary = (f"planner: n0={report.planner.n0}, {report.choice.replicas} replica(s), "
                       f"estimated {report.choice.iteration_time_s * 1000:.1f} ms per step "
                       f"(planned in {report.planning_time_s:.2f} s)")
            payload = [(report.choice.plan.to_json(), summary, None)]
        except ValueError as err:  # broadcast the reason, so no rank waits forever
            payload = [(None, None, str(err))]
    dist.broadcast_object_list(payload, src=0, group=group)
    plan_json, summary, error = payload[0]
    if error is not None:
        raise ConfigError(f"the planner found no plan: {error}")
    return Plan.from_json(plan_json), summary


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
                     "replicas": choice.replicas, "degraded": choice.degraded},
    }, indent=1)


def print_report(report: PlanReport, console: Console) -> None:
    planner, choice, plan = report.planner, report.choice, report.choice.plan
    hw = planner.costs.hardware
    console.print(f"[bold]{len(choice.plan.pipelines)} pipelines[/] on {plan.world_size // plan.tp} "
                  f"{hw.name} nodes x {plan.tp} workers | n0 = {planner.n0} | "
                  f"f = {planner.settings.fault_tolerance} | schedule {plan.schedule}"
                  f" (v={plan.virtual_stages}) | cost model: {planner.costs.source}")
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
