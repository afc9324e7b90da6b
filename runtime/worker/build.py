"""From a job's config to what a computing process runs: the engine, the plan of a
torchrun world, and the job's start-up line.

The one engine factory: the trainer of a torchrun job, the elastic worker and the
benchmarks build their `Engine` with `build_engine`, so that the two kinds of job never
differ in dtypes, clipping, gradient sums or timeouts. This module imports torch; the
config and the analytic planning (`planaria.runtime.config`, `planaria.runtime.planning.job_plans`),
which a node's agent imports, hold none of it (tests/test_import_graph.py).
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from planaria.kernels import describe as describe_kernels
from planaria.runtime.config.sections import Config, ConfigError, parameter_count
from planaria.runtime.models.llama import LayerModel, torch_dtypes
from planaria.runtime.parallel.engine import Engine, EngineSettings
from planaria.runtime.parallel.optim import optimizer_settings
from planaria.runtime.planning.job_plans import plan_job, profile_cache_dir
from planaria.runtime.planning.measured_costs import profiled_cost_model
from planaria.templates.plan import Plan


def engine_settings(cfg: Config, device: torch.device,
                    connect_timeout_s: float | None = None) -> EngineSettings:
    """How `cfg`'s engines compute on `device`. `connect_timeout_s`: how long an epoch's
    process groups may take to connect (an elastic worker's, so that a peer that died
    after the rendezvous fails the epoch in seconds); the collectives' own timeout is
    `comm.timeout_s`."""
    param_dtype, autocast_dtype = torch_dtypes(cfg.train.dtype)
    compute_dtype = None
    if cfg.train.mixed_precision == "bf16-params":  # (only with dtype bfloat16: `check_config`)
        autocast_dtype, compute_dtype = None, autocast_dtype
    return EngineSettings(
        device=device, param_dtype=param_dtype, autocast_dtype=autocast_dtype, compute_dtype=compute_dtype,
        grad_clip=cfg.train.grad_clip,
        grad_accum_dtype=torch.float64 if cfg.train.exact_reduction else None,
        collective_timeout=timedelta(seconds=cfg.comm.timeout_s),
        connect_timeout=None if connect_timeout_s is None else timedelta(seconds=connect_timeout_s))


def build_engine(cfg: Config, device: torch.device, *, phase: Callable[[str, int], None] | None = None,
                 connect_timeout_s: float | None = None, layer_phases: bool | None = None) -> Engine:
    """A new Engine of `cfg` on `device`, holding nothing yet: its first `enter_epoch`
    gives it a plan and its layers. `phase`: the engine's phase hook (fault injection,
    progress); `layer_phases`: with each layer's forward and backward (`Engine`)."""
    model = LayerModel(cfg.model, seed=cfg.train.seed, recompute=cfg.train.recompute,
                       compile=cfg.train.compile)
    return Engine(model, optimizer_settings(cfg.train), engine_settings(cfg, device, connect_timeout_s),
                  phase=phase, layer_phases=layer_phases)


def start_engine(cfg: Config, plan: Plan, rank: int, device: torch.device) -> Engine:
    """A new Engine of `cfg` in the first epoch of a new job's `plan` (layers from their
    seeds): what benchmarks and tests of a single plan want."""
    engine = build_engine(cfg, device)
    engine.enter_epoch(plan, rank)
    return engine


def describe(cfg: Config, plan: Plan) -> str:
    """The job's start-up line (it asks the kernels' dispatcher what runs here)."""
    m = cfg.model
    kv = f" ({m.kv_heads} key/value)" if m.kv_heads != m.n_heads else ""
    return (f"model: {m.n_layers} blocks, d_model {m.d_model}, {m.n_heads} heads{kv}, vocab {m.vocab_size}, "
            f"{parameter_count(m) / 1e6:.2f}M parameters | "
            f"plan: {len(plan.pipelines)} pipeline(s), stages {[len(pl.stages) for pl in plan.pipelines]}, "
            f"microbatches {[pl.num_microbatches for pl in plan.pipelines]}, tp {plan.tp}, "
            f"schedule {plan.schedule} (v={plan.virtual_stages}) | kernels: {describe_kernels(m.kernels)}"
            + (", fused head and loss" if m.fused_head_loss else ""))


def detect_hardware_name(device: torch.device) -> str:
    """The preset closest to this device, for the links and memory the profiler does not measure."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return next((preset for preset in ("h200", "h100", "a100") if preset in name), "h100")


def plan_for_world(cfg: Config, world_size: int, rank: int, device: torch.device,
                   group: dist.ProcessGroup | None = None) -> tuple[Plan, str]:
    """The planner's plan for `world_size` processes: made on rank 0, broadcast to all.

    Only rank 0 profiles and plans: measured times differ a little between processes,
    and every rank must run the very same plan. Returns the plan and a summary line.
    """
    payload: list = [None]
    if rank == 0:
        try:
            costs = profiled_cost_model(cfg, hardware_name=detect_hardware_name(device),
                                        gpus_per_node=cfg.parallel.tp, cache_dir=profile_cache_dir(cfg),
                                        device=device,
                                        concurrent_workers=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
            report = plan_job(cfg, costs, nodes=world_size // cfg.parallel.tp,
                              fault_tolerance=cfg.fault_tolerance.f)
            if report.choice.idle_nodes:  # a torchrun world has no way to keep ranks waiting
                raise ValueError(f"no plan uses all {world_size // cfg.parallel.tp} nodes of this world "
                                 f"({report.choice.idle_reason}); launch "
                                 f"{len(report.choice.plan.nodes())} nodes, or run under planaria-run, "
                                 "whose idle nodes wait")
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


