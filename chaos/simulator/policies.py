"""Recovery policies, each modelled from its mechanism (docs/simulator.md lists every assumption).

- `PlanariaPolicy`: the planner's plan for the live nodes at every change (f+1 replicas
  when N allows); a lost node costs detection, the control plane (by the live nodes),
  the real planner's time, new process groups (by the new plan's GPUs) and the copies of
  the layers that changed stage, plus the iteration in flight. A join drains its
  iteration and costs the same minus detection. When every replica of some layer is
  gone, the job loads its last checkpoint (the workers stay up: no process restart).
  Below n0 nodes it stalls.
- `CheckpointPolicy`: restart-the-world, as torchrun users do: any change of the nodes
  stops every worker, starts new ones on the live nodes and reloads the last checkpoint;
  the work since that checkpoint is lost. The plan is the fastest for the live nodes
  (no replicas), the interval Young/Daly's for the trace's mean time between changes.
- `RedundancyPolicy`: Bamboo's redundant computation. Every node also holds its
  predecessor-in-ring's copy of the next stage (twice the state) and runs that stage's
  forward for every microbatch, in its pipeline bubble where it fits. A lost node's
  stage is taken over by the node holding its copy, which then runs both stages; a
  second loss next to the first (the copy's holder) loses the stage: restart from the
  checkpoint. Joins are absorbed by a reconfiguration that restarts the workers but
  keeps the state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planaria.chaos.simulator.calibration import Calibration
from planaria.chaos.simulator.simulation import Outcome, Running
from planaria.elastic.leave_planning import leave_window_s
from planaria.templates.costs import CostModel
from planaria.templates.placement import layers_held
from planaria.templates.plan import Plan
from planaria.templates.planner import PlanChoice, Planner


@dataclass(frozen=True)
class Job:
    """What every policy needs: the planners' inputs and the costs of this job."""

    tokens_per_step: int
    calibration: Calibration
    fixed_iteration_s: float | None = None
    """Every plan's iteration time, when measured rather than planned (a local chaos run,
    whose nodes share one machine's cores)."""
    lose_partial_iteration: bool = True
    """False when the recovery's cost already includes re-running the iteration in flight."""
    notice_s: float = 0.0
    """Every removal is announced this long ahead (a preemption notice: EC2 gives 120 s,
    GCP and Azure 30 s); Planaria then leaves at a step boundary (`PlanariaPolicy`). The
    other policies react to the removal itself, as they do without notice."""


def _running(planner: Planner, choice: PlanChoice, job: Job, iteration_s: float | None = None,
             lost_nodes: int = 0) -> Running:
    iteration = choice.iteration_time_s if iteration_s is None else iteration_s
    if job.fixed_iteration_s is not None:
        iteration = job.fixed_iteration_s
    nodes = sum(len(p.stages) for p in choice.plan.pipelines) - lost_nodes
    return Running(nodes=nodes, tokens_per_s=job.tokens_per_step / iteration, iteration_s=iteration,
                   checkpoint_s=checkpoint_seconds(planner.costs, choice.plan, job.calibration))


def node_state_bytes(costs: CostModel, plan: Plan, pipelines=None) -> dict[str, int]:
    """Bytes of layer state each node of `plan` (or of some of its `pipelines`) holds,
    all its tp workers together."""
    out: dict[str, int] = {}
    for pipeline in plan.pipelines if pipelines is None else pipelines:
        for stage in pipeline.stages:
            out[stage.node] = sum(costs.layers[i].held_bytes for i in stage.layers()) * plan.tp
    return out


def checkpoint_seconds(costs: CostModel, plan: Plan, calibration: Calibration) -> float:
    """Writing a sharded checkpoint: one replica of each layer is saved, by the pipeline
    with the most stages (the smallest shards), all its nodes at once; the node with the
    largest shard sets the time."""
    sizes = node_state_bytes(costs, plan, plan.pipelines[:1])
    return max(sizes.values(), default=0) / calibration.storage_bandwidth


def load_seconds(costs: CostModel, plan: Plan, calibration: Calibration) -> float:
    """Loading a checkpoint into `plan`: every node reads its own stage's shards at once."""
    return max(node_state_bytes(costs, plan).values(), default=0) / calibration.storage_bandwidth


def transfer_seconds(costs: CostModel, old: Plan, new: Plan, calibration: Calibration) -> float:
    """Copying the layers each node lacks from replicas: each worker receives its own shard
    over its own link, all at once; the slowest receiver sets the time."""
    held = layers_held(old, [s.node for p in new.pipelines for s in p.stages])
    worst = 0
    for pipeline in new.pipelines:
        for stage in pipeline.stages:
            missing = set(stage.layers()) - held[stage.node]
            worst = max(worst, sum(costs.layers[i].held_bytes for i in missing))
    bandwidth = costs.hardware.inter_node_bandwidth * calibration.transfer_efficiency
    return worst / bandwidth


def lost_layers(plan: Plan, live: set[str]) -> set[int]:
    """Layers no live node of `plan` holds."""
    kept = {i for p in plan.pipelines for s in p.stages if s.node in live for i in s.layers()}
    return set(range(plan.num_layers)) - kept


class PlanariaPolicy:
    name = "planaria"

    def __init__(self, planner: Planner, job: Job, checkpoint_every_s: float = math.inf):
        self.planner, self.job, self.cal = planner, job, job.calibration
        self.checkpoint_every_s = checkpoint_every_s
        self.plan: Plan | None = None
        self.state_lost = False  # since the last plan: resume from the checkpoint
        self.planning_s: list[float] = []

    def start(self, live: list[str]) -> Outcome:
        if len(live) < self.planner.n0:
            return Outcome(None, note=f"{len(live)} nodes < n0={self.planner.n0}: stalled")
        choice = self._instantiate(live, None)
        return Outcome(_running(self.planner, choice, self.job))

    def _instantiate(self, live: list[str], current: Plan | None) -> PlanChoice:
        choice = self.planner.instantiate(len(live), list(live), current=current)
        self.planning_s.append(choice.planning_time_s)
        self.plan = choice.plan
        return choice

    def change(self, at: float, change, live: list[str], current: Running | None) -> Outcome:
        alive = set(live)
        in_plan = {s.node for p in self.plan.pipelines for s in p.stages} if self.plan else set()
        failed = in_plan & set(change.removed)
        if failed and current is not None and len(live) >= self.planner.n0 and self._can_leave(current, live):
            return self._planned_leave(live, current)
        newly_lost = bool(self.plan) and bool(failed) and bool(lost_layers(self.plan, alive))
        in_flight = "iteration" if failed and self.job.lose_partial_iteration else "none"
        lost = "checkpoint" if newly_lost and not self.state_lost else in_flight
        self.state_lost = self.state_lost or newly_lost
        if len(live) < self.planner.n0:
            return Outcome(None, lost=lost, note=f"{len(live)} nodes < n0={self.planner.n0}: stalled")
        if current is not None and not failed and not change.added:
            return Outcome(current, downtime_s=change.downtime_s or 0.0, note="no node of the plan left")
        cal = self.cal
        old = self.plan
        choice = self._instantiate(live, None if self.state_lost or old is None else old)
        downtime = cal.control_s(len(live)) + choice.planning_time_s + cal.regroup_s(choice.plan.world_size)
        if failed:
            downtime += cal.detection_s
        if change.downtime_s is not None:
            downtime = change.downtime_s  # measured: detection, recovery and the re-run together
        if self.state_lost:
            downtime += load_seconds(self.planner.costs, choice.plan, cal)
            note = "replicas exhausted: back to the checkpoint"
        else:
            downtime += transfer_seconds(self.planner.costs, old, choice.plan, cal) if old else 0.0
            note = "in place"
        self.state_lost = False
        return Outcome(_running(self.planner, choice, self.job), downtime_s=downtime, lost=lost,
                       drain=not failed, note=note)


    def _can_leave(self, current: Running, live: list[str]) -> bool:
        """The notice covers a planned leave: two iterations (the one under way, then the
        one the stop comes after) and the control plane's share; the copies come after,
        from the leaving nodes, within what is left (the runtime's own estimate,
        `PlannedLeaves.needs_s`, takes the same two steps and a margin). The new plan is
        not made yet: its groups are costed at every live node's GPUs, the most it can use."""
        need = (2 * current.iteration_s + self.cal.control_s(len(live))
                + self.cal.regroup_s(len(live) * self.plan.tp))
        return self.job.notice_s > 0 and self.job.notice_s >= need

    def _planned_leave(self, live: list[str], current: Running) -> Outcome:
        """Nodes leave with notice: nothing is detected, no iteration is interrupted, and no
        layer is lost (the leaving nodes hand theirs over). The switch costs the control
        plane, planning, new groups and the copies; the leaving nodes go some time before
        their deadline (the controller's `leave_window_s`), and for that long the job
        already runs on the new plan (charged as the throughput it gives up meanwhile)."""
        old = self.plan
        choice = self._instantiate(live, None if self.state_lost else old)
        running = _running(self.planner, choice, self.job)
        control = self.cal.control_s(len(live))
        ahead = min(self.job.notice_s, leave_window_s(2 * current.iteration_s + control))
        # The switch came at the boundary before the deadline: the iteration in flight
        # then was committed (`commit_partial`), nothing drains after it.
        early = ahead * max(0.0, 1 - running.tokens_per_s / current.tokens_per_s)
        downtime = (control + choice.planning_time_s + self.cal.regroup_s(choice.plan.world_size) + early
                    + transfer_seconds(self.planner.costs, old, choice.plan, self.cal))
        return Outcome(running, downtime_s=downtime, lost="none", commit_partial=True, note="left with notice")


class CheckpointPolicy:
    name = "checkpoint"

    def __init__(self, planner: Planner, job: Job, checkpoint_every_s: float):
        self.planner, self.job, self.cal = planner, job, job.calibration
        self.checkpoint_every_s = checkpoint_every_s
        self.used: set[str] = set()

    def start(self, live: list[str]) -> Outcome:
        return self._plan(live, downtime=0.0, lost="none")

    def _plan(self, live: list[str], downtime: float, lost: str) -> Outcome:
        if len(live) < self.planner.n0:
            self.used = set()
            return Outcome(None, lost=lost, note=f"{len(live)} nodes < n0={self.planner.n0}: stalled")
        choice = self.planner.instantiate(len(live), list(live))
        self.used = {s.node for p in choice.plan.pipelines for s in p.stages}
        load = load_seconds(self.planner.costs, choice.plan, self.cal)
        return Outcome(_running(self.planner, choice, self.job), downtime_s=downtime + load if downtime else 0.0,
                       lost=lost, note="restart from the checkpoint" if downtime else "")

    def change(self, at: float, change, live: list[str], current: Running | None) -> Outcome:
        failed = bool(self.used & set(change.removed))
        if current is not None and not failed and not change.added:
            return Outcome(current, note="a node outside the plan left")
        # Every worker is stopped: what was not checkpointed is gone, joins included.
        downtime = self.cal.restart_s + (self.cal.detection_s if failed else 0.0)
        return self._plan(live, downtime=downtime, lost="checkpoint" if current is not None else "none")


class RedundancyPolicy:
    name = "redundancy"

    def __init__(self, planner: Planner, job: Job, checkpoint_every_s: float):
        self.planner, self.job, self.cal = planner, job, job.calibration
        self.checkpoint_every_s = checkpoint_every_s
        self.choice: PlanChoice | None = None
        self.failed: set[str] = set()  # plan nodes gone, their stage run by their copy's holder
        self.state_lost = False

    def start(self, live: list[str]) -> Outcome:
        return self._reconfigure(live, downtime=0.0, lost="none")

    def _reconfigure(self, live: list[str], downtime: float, lost: str, note: str = "") -> Outcome:
        self.failed = set()
        if len(live) < self.planner.n0:
            self.choice = None
            return Outcome(None, lost=lost, note=f"{len(live)} nodes < n0={self.planner.n0}: stalled")
        self.choice = self.planner.instantiate(len(live), list(live))
        if self.state_lost:
            downtime += load_seconds(self.planner.costs, self.choice.plan, self.cal)
            self.state_lost = False
        return Outcome(self._running(), downtime_s=downtime, lost=lost, note=note)

    def _running(self) -> Running:
        return _running(self.planner, self.choice, self.job, iteration_s=self._iteration_s(),
                        lost_nodes=len(self.failed))

    def change(self, at: float, change, live: list[str], current: Running | None) -> Outcome:
        cal = self.cal
        removed = set(change.removed)
        plan_nodes = ({s.node for p in self.choice.plan.pipelines for s in p.stages}
                      if self.choice else set())
        hit = plan_nodes & removed
        if self.choice is None or change.added or self.state_lost:
            # Joins (or a return from a stall): re-form the pipelines over every live node.
            if hit and self._copy_lost(hit):
                self.state_lost = True
            lost = "checkpoint" if self.state_lost and hit else ("iteration" if hit else "none")
            downtime = cal.restart_s + (cal.detection_s if hit else 0.0)
            out = self._reconfigure(live, downtime, lost, "reconfigure (workers restarted)")
            return replace(out, drain=not hit)
        if not hit:
            return Outcome(current, note="a node outside the plan left")
        if self._copy_lost(hit):
            self.state_lost = True
            return self._reconfigure(live, cal.detection_s + cal.restart_s, "checkpoint",
                                     "neighbours lost together: restart from the checkpoint")
        self.failed |= hit
        return Outcome(self._running(), downtime_s=cal.detection_s + cal.bamboo_failover_s,
                       lost="iteration", note="failover to the redundant copy")

    def _copy_lost(self, hit: set[str]) -> bool:
        """Is a lost stage's copy gone too? Stage s's copy lives on stage s−1's node (in a
        ring: stage 0's on the last stage's node)."""
        down = self.failed | hit
        for pipeline in self.choice.plan.pipelines:
            nodes = [s.node for s in pipeline.stages]
            for i, node in enumerate(nodes):
                if node in hit and (len(nodes) == 1 or nodes[i - 1] in down):
                    return True
        return False

    def _iteration_s(self) -> float:
        """The slowest pipeline with the redundant forwards (and any stage doubled up after a
        failover), plus the gradient sync the planner charges."""
        planner, choice = self.planner, self.choice
        costs = planner.costs
        sync = choice.iteration_time_s - max(choice.pipeline_times_s)
        worst = 0.0
        for pipeline, base in zip(choice.plan.pipelines, choice.pipeline_times_s):
            m = pipeline.num_microbatches
            partition = planner.template(len(pipeline.stages)).partition
            stages = [list(s.layers()) for s in pipeline.stages]
            forward = [sum(costs.layers[i].forward_s for i in layers) for layers in stages]
            extra = 0.0
            for s, stage_time in enumerate(partition.stage_times):
                successor = forward[(s + 1) % len(stages)] if len(stages) > 1 else 0.0
                idle = base - m * stage_time
                extra = max(extra, m * successor - idle)
            for s, stage in enumerate(pipeline.stages):
                if stage.node in self.failed:  # its copy's holder runs this stage too
                    extra = max(extra, m * partition.stage_times[s])
            worst = max(worst, base + max(0.0, extra))
        return worst + sync


def redundancy_costs(costs: CostModel) -> CostModel:
    """The cost model of a Bamboo node: every layer's state counted twice (its own copy
    and the copy it keeps for its neighbour), so the planner cuts deeper pipelines; its
    gradients too (both copies' are synced)."""
    layers = tuple(replace(layer, state_bytes=2 * layer.state_bytes, gradient_bytes=2 * layer.gradient_bytes,
                           wide_sum_bytes=2 * layer.wide_sum_bytes) for layer in costs.layers)
    return replace(costs, layers=layers)
