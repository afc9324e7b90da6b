"""One simulation: build the planners for a job, run the chosen policies over a trace,
and gather what `planaria simulate` reports.

The planners are Planaria's own (`planaria.templates.planner`) over the analytic cost
model of the hardware preset: Planaria's with f, the checkpoint policy's with f = 0
(the fastest plan, no replicas), Bamboo's over a cost model with twice the state per
layer. Checkpoint intervals are Young/Daly's: for the checkpoint policy with the mean
time between the trace's changes (each one restarts it); for Planaria and Bamboo with
the mean time between the events that do force them back to a checkpoint, counted by
a first pass without checkpoints (the interval a user would pick knowing the market).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from planaria.chaos.simulator.availability import Availability, with_boot_delay
from planaria.chaos.simulator.calibration import Calibration, young_daly_interval
from planaria.chaos.simulator.models import SimJob
from planaria.chaos.simulator.policies import (CheckpointPolicy, Job, PlanariaPolicy, RedundancyPolicy,
                                               checkpoint_seconds, redundancy_costs)
from planaria.chaos.simulator.simulation import SimResult, simulate
from planaria.templates.analytic import analytic_cost_model, hardware, sums_wide
from planaria.templates.job_templates import PlannerSettings
from planaria.templates.partition_cost import InfeasiblePartition
from planaria.templates.planner import Planner

POLICIES = ("planaria", "checkpoint", "redundancy")


@dataclass(frozen=True)
class Prices:
    """Dollars per GPU-hour. Defaults: an 8-GPU A100 instance's on-demand list price of
    $32.77 an hour ($4.10 a GPU) on the largest public cloud, and spot at 40% of it,
    a typical discount for such instances; both are parameters."""

    spot: float = 1.64
    on_demand: float = 4.10


@dataclass
class Simulation:
    job: SimJob
    availability: Availability
    hardware: str
    gpus_per_node: int
    """As resolved: the option, or the preset's default."""
    fault_tolerance: int
    calibration: Calibration
    prices: Prices
    results: dict[str, SimResult] = field(default_factory=dict)
    unfit: dict[str, str] = field(default_factory=dict)
    """Policies whose model does not fit on the trace's nodes at all, and why."""
    n0: dict[str, int] = field(default_factory=dict)
    fault_free_tokens_per_s: float = 0.0
    """Planaria's plan on the trace's peak node count: the on-demand baseline's rate."""


def _planner(job: SimJob, hw_name: str, gpus_per_node: int | None, f: int, *,
             redundant: bool = False) -> Planner:
    hw = hardware(hw_name, gpus_per_node=gpus_per_node)
    costs = analytic_cost_model(job.shape, hw, tp=hw.gpus_per_node, micro_batch=job.micro_batch,
                                dtype=job.dtype, recompute=job.recompute,
                                wide_gradients=sums_wide(job.dtype, job.exact_reduction))
    if redundant:
        costs = redundancy_costs(costs)
    settings = PlannerSettings(fault_tolerance=f, global_batch=job.global_batch, micro_batch=job.micro_batch,
                               schedule=job.schedule, virtual_stages=job.virtual_stages,
                               # Bamboo's redundancy lives between pipeline stages: two at least.
                               min_stages=max(job.min_stages, 2 if redundant else 1))
    return Planner(costs, settings)


def run_simulation(job: SimJob, availability: Availability, *, hardware_name: str = "a100",
                   gpus_per_node: int | None = None, fault_tolerance: int = 1, policies=POLICIES,
                   calibration: Calibration | None = None, prices: Prices | None = None,
                   notice_s: float = 0.0) -> Simulation:
    """`notice_s`: every removal announced that long ahead (`Job.notice_s`)."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; valid: {', '.join(POLICIES)} or all")
    cal = calibration or Calibration()
    gpus_per_node = hardware(hardware_name, gpus_per_node=gpus_per_node).gpus_per_node
    sim = Simulation(job, availability, hardware_name, gpus_per_node, fault_tolerance, cal, prices or Prices())
    common = Job(tokens_per_step=job.tokens_per_step, calibration=cal, notice_s=notice_s)
    usable = with_boot_delay(availability, cal.boot_s)
    booting = availability.node_seconds() - usable.node_seconds()
    for name in policies:
        try:
            planner = _planner(job, hardware_name, gpus_per_node, fault_tolerance if name == "planaria" else 0,
                               redundant=name == "redundancy")
        except InfeasiblePartition as err:
            sim.unfit[name] = str(err)
            continue
        sim.n0[name] = planner.n0
        if planner.n0 > usable.peak:
            sim.unfit[name] = (f"the smallest pipeline needs n0={planner.n0} nodes; the trace never "
                               f"has more than {usable.peak} ready at once")
            continue
        result = _run_policy(name, planner, common, usable)
        result.accounts["booting"] = booting  # live but not yet able to join: the same for all
        sim.results[name] = result
        if name == "planaria":
            peak = planner.instantiate(availability.peak)
            sim.fault_free_tokens_per_s = job.tokens_per_step / peak.iteration_time_s
    return sim


def _run_policy(name: str, planner: Planner, job: Job, availability: Availability) -> SimResult:
    cal = job.calibration
    if name == "checkpoint":
        changes = len(availability.changes)
        mtbf = availability.duration_s / changes if changes else math.inf
        choice = planner.instantiate(min(availability.peak, max(planner.n0, len(availability.initial))))
        every = young_daly_interval(checkpoint_seconds(planner.costs, choice.plan, cal), mtbf)
        return simulate(CheckpointPolicy(planner, job, every), availability)
    make = (lambda every: PlanariaPolicy(planner, job, every)) if name == "planaria" else \
        (lambda every: RedundancyPolicy(planner, job, every))
    first = simulate(make(math.inf), availability)
    if not first.checkpoint_loads:
        return first
    choice = planner.instantiate(min(availability.peak, max(planner.n0, len(availability.initial))))
    mtbf = availability.duration_s / first.checkpoint_loads
    every = young_daly_interval(checkpoint_seconds(planner.costs, choice.plan, cal), mtbf)
    return simulate(make(every), availability)
