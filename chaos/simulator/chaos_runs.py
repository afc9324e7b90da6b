"""Predict a local chaos run's ETTR with the simulator, to check the simulator against
measurement (docs/simulator.md, "Checked against the chaos runs").

A chaos report (`planaria chaos ... --out DIR`, DIR/report.json) records which faults
hit which nodes when, every step's commit time, and each recovery's phases. From one
report this module measures what each kind of fault costs on this machine
(`fault_costs`: median per kind of the recoveries' durations, and how long a new node
takes to boot before it asks to join); it turns another report's faults into an
`Availability` whose changes carry those costs (`chaos_availability`), runs the Planaria
policy over it with the job's own planner (which decides when a layer loses every
replica and the job goes back to a checkpoint), and returns the ETTR the simulator
predicts (`predict_ettr`), to set beside the one the run measured (`measured_ettr`).

Both need the job's fault-free step time, and both take the run's own (`quiet_step_s`:
its steps away from any fault) rather than its cached reference's: on a machine that
other work shares, a run's speed drifts from one run to the next (by up to 25% between
the runs in docs/simulator.md), and that drift is not what a fault costs. The report's
own ETTR, against the reference, carries it; `measured_ettr` does not. The step time is
the same for every plan: on a machine whose two cores all local nodes share, it nearly is.

What a fault costs here is mostly not what it costs on a GPU cluster: a new node's
processes start on the same two cores as the training, and an etcd member's restart
takes CPU from it too. That is why the costs are measured per kind on this machine
rather than taken from the GPU calibration.
"""
from __future__ import annotations

import bisect
import json
import statistics
from pathlib import Path

from planaria.chaos.faults import parse_fault
from planaria.chaos.report import QUIET_S, ettr_against, own_step_s
from planaria.chaos.simulator.availability import Availability, Change, with_boot_delay
from planaria.chaos.simulator.calibration import Calibration
from planaria.chaos.simulator.policies import Job, PlanariaPolicy
from planaria.chaos.simulator.simulation import simulate
from planaria.chaos.sources import NODE_LOSSES


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def reference_step_s(report: dict) -> float:
    """The fault-free step time: recorded by newer reports, else solved from their ETTR
    (ETTR = steps · s / (last commit time + s))."""
    if report.get("reference_step_s"):
        return float(report["reference_step_s"])
    steps, ettr = report["steps_committed"], report["ettr"]
    last = report["series"]["commit_times"][-1][0]
    return ettr * last / (steps - ettr)


def quiet_step_s(report: dict, quiet_s: float = QUIET_S) -> float:
    """The run's own fault-free step time (`planaria.chaos.report.own_step_s`); the
    reference's when no step is `quiet_s` from every fault."""
    times = [t for t, _ in report["series"]["commit_times"]]
    own = own_step_s(times, [at for _, at, _ in _faults(report)], quiet_s)
    return reference_step_s(report) if own is None else own


def measured_ettr(report: dict, step_s: float | None = None) -> float:
    """The run's ETTR against `step_s` (default: its own `quiet_step_s`)."""
    step_s = quiet_step_s(report) if step_s is None else step_s
    return ettr_against(report["steps_committed"], report["series"]["commit_times"][-1][0], step_s)


def _faults(report: dict):
    """(kind, seconds after the first commit, node index or None) of each injected fault."""
    series = report["series"]
    for fault in series["faults"]:
        spec = parse_fault(fault["fault"])
        yield spec.kind, max(0.0, fault["time"] - series["first_commit_time"]), spec.node


def _window_loss(report: dict, kind: str, window_s: float) -> float | None:
    """Median training time lost in the `window_s` after each fault of `kind`: the window
    minus the steps committed in it times the fault-free step time."""
    times = [t for t, _ in report["series"]["commit_times"]]
    step_s = quiet_step_s(report)
    lost = [max(0.0, window_s - (bisect.bisect(times, at + window_s) - bisect.bisect(times, at)) * step_s)
            for k, at, _ in _faults(report) if k == kind]
    return statistics.median(lost) if lost else None


def fault_costs(report: dict) -> dict[str, float]:
    """What each kind of fault cost the run of `report`, median over its faults, from the
    report's recoveries: a node lost, from the fault to the first step after it (detection,
    re-plan, copies, the re-run); a node added, from the join's detection to the first step
    with it (the drain, re-plan, the joiner's connect, copies), its boot apart
    (`"boot"`: from the node's start to the join's detection). A kind with no recovery (an
    etcd member killed: no node changes) costs what the 10 s after it lost."""
    by_kind: dict[str, list[float]] = {}
    boots: list[float] = []
    for recovery in report["recoveries"]:
        kind = recovery["fault"].split("@")[0]
        if recovery["total_s"] is None:
            continue
        if kind == "add-node":
            boots.append(recovery["detect_s"] or 0.0)
            by_kind.setdefault(kind, []).append(recovery["total_s"] - (recovery["detect_s"] or 0.0))
        else:
            by_kind.setdefault(kind, []).append(recovery["total_s"])
    costs = {kind: statistics.median(values) for kind, values in by_kind.items()}
    if boots:
        costs["boot"] = statistics.median(boots)
    for kind in {k for k, _, _ in _faults(report)} - set(costs):
        costs[kind] = _window_loss(report, kind, 10.0)
    return costs


def chaos_availability(report: dict, *, nodes: int, costs: dict[str, float],
                       step_s: float | None = None) -> Availability:
    """The faults of a chaos report as changes of named nodes (`node<i>`) from its first
    committed step to the end of its last (`step_s` long; default `quiet_step_s`), each
    carrying the cost of its kind."""
    missing = {kind for kind, _, _ in _faults(report)} - {k for k, v in costs.items() if v is not None}
    if missing:
        raise ValueError(f"no measured cost for fault kind(s) {sorted(missing)}: calibrate on a "
                         "report that has them")
    step_s = quiet_step_s(report) if step_s is None else step_s
    duration = report["series"]["commit_times"][-1][0] + step_s
    live = {f"node{i}" for i in range(nodes)}
    changes = []
    for kind, at, target in _faults(report):
        node = f"node{target}" if target is not None else None
        if kind == "add-node":
            live.add(node)
            changes.append(Change(at, added=(node,), downtime_s=costs[kind]))
        elif kind in NODE_LOSSES and node in live:
            live.discard(node)
            changes.append(Change(at, removed=(node,), downtime_s=costs[kind]))
        else:  # an etcd member: no node changes, the job still pays for it
            changes.append(Change(at, downtime_s=costs[kind]))
    return Availability("chaos report", tuple(f"node{i}" for i in range(nodes)), tuple(changes), duration)


def predict_ettr(report: dict, costs: dict[str, float], config: Path, overrides: list[str], *,
                 nodes: int, step_s: float | None = None) -> float:
    """The ETTR the simulator predicts for the chaos run of `report` (run with `config`,
    `overrides`, on `nodes` nodes), with `costs` per fault kind and every step `step_s`
    long (default: the run's `quiet_step_s`); compare with `measured_ettr(report, step_s)`."""
    from planaria.runtime.config.loading import load_config
    from planaria.runtime.planning.job_plans import build_planner, cost_model

    step_s = quiet_step_s(report) if step_s is None else step_s
    cfg = load_config(config, overrides)
    planner = build_planner(cfg, cost_model(cfg, hardware_name="cpu", gpus_per_node=cfg.parallel.tp))
    job = Job(tokens_per_step=cfg.train.global_batch * cfg.model.seq_len,
              calibration=Calibration(), fixed_iteration_s=step_s,
              lose_partial_iteration=False)  # the measured cost includes the re-run
    availability = with_boot_delay(chaos_availability(report, nodes=nodes, costs=costs, step_s=step_s),
                                   costs.get("boot", 0.0))
    every = cfg.checkpoint.every * job.fixed_iteration_s if cfg.checkpoint.every else float("inf")
    return simulate(PlanariaPolicy(planner, job, checkpoint_every_s=every), availability).ettr
