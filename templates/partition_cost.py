"""The cost of a cut of the layers into pipeline stages: its iteration time and its peak
memory, as the partitioner (`templates/partition.py`) and the reports evaluate it.

A pipeline of `S` stages with `v` virtual stages has `S·v` model stages, contiguous
layer ranges in model order; model stage `j` is local chunk `j // S` of stage `j % S`
(the looped placement of `templates/plan.py`). A cut is the list of the `S·v + 1`
model-stage bounds.

Iteration time (`pipeline_iteration_time`). With `T_s` the forward plus backward time
of all of stage `s`'s chunks for one microbatch, `T = max T_s`, `Σ = Σ T_s` and
`σ` the sum of the send costs at the cuts, every schedule is modelled as

    m·T + c·(Σ − T) + σ

* gpipe, 1f1b: `c = 1`, i.e. `Σ + (m−1)·T`: one microbatch through every stage, then
  the other `m−1` at the bottleneck's pace. Bubble `(S−1)/m` for uniform stages.
* zb1f1b: `c = 2/3`: the bubble is two thirds of 1F1B's. Exact when a backward takes
  twice a forward (F = I = W, as in the paper and `simulate`'s default); in general the
  simulated bubble is `(S−1)·(F + B/2)` per stage, which this formula does not see
  because it is given `F + B` only.
* interleaved: `c = (1 + max(0, S−m)·(v−1)/(S−1)) / v`: Megatron's bubble
  `(S−1)·t/v`; with fewer microbatches than stages (one short round) a microbatch
  waits at each chunk-to-chunk wrap-around for `S−m` more stage slots.

Stage time also counts what the runtime does per microbatch besides compute: at every
boundary a stage touches (each model-stage boundary joins two ranks when `S > 1`), one
message out and one in per microbatch, `CostModel.boundary_overhead()`. A stage has
`2v` boundary sides less the pipeline's two ends, so this depends on the stage's place,
never on where the cuts are. And the runtime's own work per action on each of its `v`
chunks (`CostModel.chunk_overhead`: forward and backward, three actions for zb1f1b),
the same for every chunk. The partitioner optimises these per-microbatch terms.

Per-iteration terms come on top (`StagePartition.iteration_time`): the slowest stage's
parameter update, `max_s Σ optimizer_s` over its layers (every stage updates at the same
time, after the commit), and the commit all-reduce (`CostModel.commit_time()`). The
exact `v = 1` search (`templates/partition_dp.py`) does not see the update term (it
would need a second bottleneck); the interleaved searches do, through `objective`.

For uniform stages and no sends these equal `templates.schedule_simulator.simulate`'s
makespan exactly, for every shape the builders accept (zb1f1b: with backward =
2·forward); the tests check it. For non-uniform stages they are the usual flow-shop approximation:
the bottleneck sets the steady-state pace and the fill/drain costs the other stages'
share once (for gpipe forward-only it is the exact flow-shop makespan). Every send on
the first microbatch's path (one per boundary between model stages, forward plus
backward, `CostModel.send_time`) is added once.

Memory (`peak_memory_bytes`). Stage `s` pins the state (parameters, gradients,
optimizer state) of all its layers, plus the activations of the microbatches it holds
in flight at its peak (`in_flight_microbatches`): gpipe `m`; 1f1b and zb1f1b
`min(S−s, m)` (zb1f1b keeps a microbatch until its W); interleaved, counted in
chunk-microbatches, Megatron's warm-up + 1, capped at `m·v`. For the interleaved
schedule the chunks of a stage hold different activation sizes, so the peak is taken
exactly over the schedule's own action list: the largest `Σ_c n_c(t)·act_c` over the
rank's steps, with `n_c(t)` the microbatches of chunk `c` in flight after step `t`.

This module owns the `StagePartition` record, `pipeline_iteration_time`,
`in_flight_microbatches`, `evaluate_partition` (the cost of a given cut) and
`PartitionProblem`, the prefix sums with which every search evaluates its cuts.

No torch import: templates are planned anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from planaria.templates.costs import CostModel
from planaria.templates.schedules import (
    BACKWARD,
    BACKWARD_WEIGHT,
    FORWARD,
    SCHEDULES,
    _interleaved_rounds,
    build_schedule,
    check_schedule_shape,
)

_GIB = 1 << 30


class InfeasiblePartition(ValueError):
    """No partition into the requested stages fits in device memory.

    `shortfall_bytes`: how far the smallest reachable peak memory of a stage exceeds
    the device memory (for `v = 1`, and for `v > 1` on small instances, exact).
    """

    def __init__(self, message: str, shortfall_bytes: int):
        super().__init__(message)
        self.shortfall_bytes = int(shortfall_bytes)


# ---------------------------------------------------------------------------
# Schedule facts: activations in flight, iteration time
# ---------------------------------------------------------------------------


def in_flight_microbatches(schedule: str, stage: int, num_stages: int, num_microbatches: int,
                           virtual_stages: int = 1) -> int:
    """Microbatches whose activations stage `stage` holds at its peak.

    gpipe: m; 1f1b and zb1f1b: min(S − stage, m); interleaved: in chunk-microbatches
    (a microbatch counts once per chunk it is in flight on), Megatron's warm-up + 1,
    capped at m·v.
    """
    check_schedule_shape(schedule, num_stages, virtual_stages, num_microbatches)
    if not (isinstance(stage, int) and 0 <= stage < num_stages):
        raise ValueError(f"stage {stage!r} does not exist in a pipeline of {num_stages} stages")
    s, m, v = num_stages, num_microbatches, virtual_stages
    if schedule == "gpipe":
        return m
    if schedule in ("1f1b", "zb1f1b"):
        return min(s - stage, m)
    _, per_round = _interleaved_rounds(s, m)
    warmup = (v - 1) * per_round + 2 * (s - 1 - stage)
    return min(warmup + 1, m * v)


def _bubble_coefficient(schedule: str, num_stages: int, num_microbatches: int,
                        virtual_stages: int) -> float:
    """c in m·T + c·(Σ − T) + sends."""
    if schedule in ("gpipe", "1f1b"):
        return 1.0
    if schedule == "zb1f1b":
        return 2.0 / 3.0
    s, m, v = num_stages, num_microbatches, virtual_stages
    short = max(0, s - m) * (v - 1) / (s - 1) if s > 1 else 0.0
    return (1.0 + short) / v


def _check_counts(schedule: str, num_stages: int, virtual_stages: int,
                  num_microbatches: int) -> None:
    """Everything check_schedule_shape checks but the interleaved round divisibility."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid schedules are: "
                         f"{', '.join(SCHEDULES)}")
    for label, value in (("num_stages", num_stages), ("virtual_stages", virtual_stages),
                         ("num_microbatches", num_microbatches)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if schedule != "interleaved" and virtual_stages != 1:
        raise ValueError(
            f"schedule {schedule!r} runs one stage per rank, but virtual_stages={virtual_stages}; "
            "use schedule 'interleaved' for virtual_stages > 1, or set virtual_stages=1")


def pipeline_iteration_time(stage_times: Sequence[float], send_times: Sequence[float],
                            num_microbatches: int, schedule: str, virtual_stages: int = 1) -> float:
    """Iteration time of one pipeline: `m·T + c·(Σ − T) + Σ sends` (module docstring).

    stage_times[s]: forward plus backward of all of stage s's chunks, one microbatch.
    send_times: the S·v − 1 boundary costs between consecutive model stages.
    Defined for every m ≥ 1 (whether the interleaved schedule accepts this m is
    `check_schedule_shape`'s business) and increasing in m.
    """
    num_stages = len(stage_times)
    _check_counts(schedule, num_stages, virtual_stages, num_microbatches)
    if len(send_times) != num_stages * virtual_stages - 1:
        raise ValueError(
            f"{num_stages} stages of {virtual_stages} chunks have "
            f"{num_stages * virtual_stages - 1} boundaries, got {len(send_times)} send times")
    slowest = max(stage_times)
    c = _bubble_coefficient(schedule, num_stages, num_microbatches, virtual_stages)
    return num_microbatches * slowest + c * (sum(stage_times) - slowest) + sum(send_times)


@lru_cache(maxsize=512)
def _activation_profiles(schedule: str, num_stages: int, num_microbatches: int,
                         virtual_stages: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per stage, the Pareto-maximal vectors (n_0 .. n_{v-1}) of chunk-microbatches in flight.

    The stage's activation peak is the largest Σ_c n_c·act_c over these vectors.
    """
    s, m, v = num_stages, num_microbatches, virtual_stages
    if schedule != "interleaved":
        return tuple(((in_flight_microbatches(schedule, r, s, m, 1),),) for r in range(s))
    profiles = []
    for rank, actions in sorted(build_schedule(schedule, s, v, m).items()):
        counts = [0] * v
        seen: dict[tuple[int, ...], None] = {}  # in order of first appearance
        for action in actions:
            chunk = action.stage // s
            if action.kind == FORWARD:
                counts[chunk] += 1
                seen.setdefault(tuple(counts))
            elif action.kind in (BACKWARD, BACKWARD_WEIGHT):
                counts[chunk] -= 1
        points = _drop_midpoints(list(seen))
        maximal = [a for a in points
                   if not any(b != a and all(x >= y for x, y in zip(b, a)) for b in points)]
        profiles.append(tuple(_drop_midpoints(maximal)))
    return tuple(profiles)


def _drop_midpoints(points: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Drop each point that lies on the segment between its neighbours in the list: a
    linear function (Σ n_c·act_c) never peaks only there, so the maximum is unchanged."""
    kept: list[tuple[int, ...]] = []
    for point in points:
        while len(kept) >= 2:
            d1 = [x - y for x, y in zip(kept[-1], kept[-2])]
            d2 = [x - y for x, y in zip(point, kept[-1])]
            parallel = all(d1[i] * d2[j] == d1[j] * d2[i]
                           for i in range(len(d1)) for j in range(i + 1, len(d1)))
            if not (parallel and sum(x * y for x, y in zip(d1, d2)) > 0):
                break
            kept.pop()
        kept.append(point)
    return kept


# ---------------------------------------------------------------------------
# The result
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StagePartition:
    """A cut of the layers into `num_stages · virtual_stages` model stages."""

    model_stages: tuple[tuple[int, int], ...]
    """S·v half-open layer ranges in model order; model stage j is chunk j // S of stage j % S."""
    num_stages: int
    virtual_stages: int
    stage_times: tuple[float, ...]
    """Per stage: forward plus backward of all its chunks for one microbatch."""
    send_times: tuple[float, ...]
    """Per boundary between consecutive model stages (S·v − 1 of them)."""
    peak_memory_bytes: tuple[int, ...]
    """Per stage: state of its layers plus the activations it holds in flight at its peak
    (for the microbatch count the partition was made for)."""
    schedule: str
    update_times: tuple[float, ...] = ()
    """Per stage, once per iteration: the parameter update of all its layers
    (Σ `LayerCost.optimizer_s`). Empty: none counted."""
    fixed_time_s: float = 0.0
    """Once per iteration, whatever the stages: the commit all-reduce."""

    def iteration_time(self, num_microbatches: int) -> float:
        """The schedule's time for `num_microbatches` (`pipeline_iteration_time`), plus
        the slowest stage's parameter update and the commit, paid once per iteration."""
        pipeline = pipeline_iteration_time(self.stage_times, self.send_times, num_microbatches,
                                           self.schedule, self.virtual_stages)
        return pipeline + max(self.update_times, default=0.0) + self.fixed_time_s

    def stage_chunks(self, stage: int) -> tuple[tuple[int, int], ...]:
        """The v layer ranges of stage `stage`, in local chunk order."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} does not exist in a pipeline of "
                             f"{self.num_stages} stages")
        return tuple(self.model_stages[c * self.num_stages + stage]
                     for c in range(self.virtual_stages))


# ---------------------------------------------------------------------------
# The evaluation of a cut
# ---------------------------------------------------------------------------


class PartitionProblem:
    """Prefix sums and schedule facts of one partition_layers (or evaluate_partition) call."""

    def __init__(self, costs: CostModel, num_stages: int, num_microbatches: int,
                 schedule: str, virtual_stages: int, memory: int, also_fits: Sequence[int] = ()):
        self.costs = costs
        self.L = costs.num_layers
        self.S, self.v, self.m = num_stages, virtual_stages, num_microbatches
        self.P = num_stages * virtual_stages
        self.schedule = schedule
        self.memory = memory
        # C[b] - C[a] is bit-for-bit CostModel.compute_time(a, b).
        self.C = [costs.compute_time(0, b) for b in range(self.L + 1)]
        state, act = [0], [0]
        for layer in costs.layers:
            state.append(state[-1] + int(layer.state_bytes))
            act.append(act[-1] + int(layer.activation_bytes))
        self.state, self.act = state, act
        # cut[a]: cost of a boundary between layer a-1 and layer a.
        self.cut = [0.0] + [costs.send_time(a - 1) for a in range(1, self.L)] + [0.0]
        self.U = [costs.update_time(0, b) for b in range(self.L + 1)]
        # Per-microbatch message work: per boundary side, constant per position (module
        # docstring). A one-stage pipeline sends nothing (its chunks hand over locally).
        side = costs.boundary_overhead() if num_stages > 1 else 0.0
        # The runtime's own work per action, for every chunk however it is cut.
        action = costs.chunk_overhead(schedule)
        S, P = num_stages, self.P
        self.overhead = [side * (2 * virtual_stages - (s == 0) - (s == S - 1))
                         + action * virtual_stages for s in range(S)]
        """Per stage."""
        self.chunk_overhead = [side * ((j > 0) + (j < P - 1)) + action for j in range(P)]
        """Per model stage."""
        self.fixed = costs.commit_time()
        # Memory is checked against every count in `also_fits` too: the stage's peak is the
        # largest over all their in-flight vectors.
        per_count = [_activation_profiles(schedule, num_stages, m, virtual_stages)
                     for m in (num_microbatches, *also_fits)]
        self.profiles = tuple(tuple(v for profiles in per_count for v in profiles[s]) for s in range(num_stages))
        self.c = _bubble_coefficient(schedule, num_stages, num_microbatches, virtual_stages)
        self._mem_prefix: dict[int, list[int]] = {}

    def mem_prefix(self, weight: int) -> list[int]:
        """state + weight·act, as prefix sums."""
        if weight not in self._mem_prefix:
            self._mem_prefix[weight] = [s + weight * a for s, a in zip(self.state, self.act)]
        return self._mem_prefix[weight]

    # -- evaluation of a full cut --------------------------------------------
    def stage(self, bounds: Sequence[int], s: int) -> tuple[float, int]:
        """(compute time, peak memory) of stage s under the cut `bounds`."""
        S, C, state, act = self.S, self.C, self.state, self.act
        chunks = [(bounds[c * S + s], bounds[c * S + s + 1]) for c in range(self.v)]
        acts = [act[b] - act[a] for a, b in chunks]
        held = max(sum(n * x for n, x in zip(vec, acts)) for vec in self.profiles[s])
        return (sum(C[b] - C[a] for a, b in chunks) + self.overhead[s],
                sum(state[b] - state[a] for a, b in chunks) + held)

    def update(self, bounds: Sequence[int], s: int) -> float:
        """Once-per-iteration parameter update of stage s's layers."""
        S, U = self.S, self.U
        return sum(U[bounds[c * S + s + 1]] - U[bounds[c * S + s]] for c in range(self.v))

    def evaluate(self, bounds: Sequence[int]):
        """(stage_times, send_times, peaks) of model stages [bounds[j], bounds[j+1])."""
        stages = [self.stage(bounds, s) for s in range(self.S)]
        sends = [self.cut[b] for b in bounds[1:-1]]
        return [t for t, _ in stages], sends, [p for _, p in stages]

    def pipeline_time(self, bounds: Sequence[int]) -> float:
        """The per-microbatch terms only: `pipeline_iteration_time` of the cut."""
        times, sends, _ = self.evaluate(bounds)
        return pipeline_iteration_time(times, sends, self.m, self.schedule, self.v)

    def objective(self, bounds: Sequence[int]) -> tuple[float, int, list[float]]:
        """(iteration time, largest peak, stage times); the time is the result's
        `iteration_time(m)`, per-iteration terms included."""
        times, sends, peaks = self.evaluate(bounds)
        per_iteration = max(self.update(bounds, s) for s in range(self.S)) + self.fixed
        return (pipeline_iteration_time(times, sends, self.m, self.schedule, self.v)
                + per_iteration, max(peaks), times)

    def result(self, bounds: Sequence[int]) -> StagePartition:
        times, sends, peaks = self.evaluate(bounds)
        return StagePartition(
            model_stages=tuple((bounds[j], bounds[j + 1]) for j in range(self.P)),
            num_stages=self.S, virtual_stages=self.v, stage_times=tuple(times),
            send_times=tuple(sends), peak_memory_bytes=tuple(int(p) for p in peaks),
            schedule=self.schedule,
            update_times=tuple(self.update(bounds, s) for s in range(self.S)),
            fixed_time_s=self.fixed)

    def infeasible(self, min_peak: int, exact: bool) -> InfeasiblePartition:
        short = int(min_peak - self.memory)
        where = f"{self.S} stages" + (f" of {self.v} virtual stages" if self.v > 1 else "")
        how = "the smallest peak memory any partition reaches" if exact else \
            "the smallest peak memory the search found"
        return InfeasiblePartition(
            f"{self.L} layers do not fit on {where} (schedule {self.schedule!r}, "
            f"{self.m} microbatches, tp={self.costs.tp}, micro_batch={self.costs.micro_batch}): "
            f"{how} is {min_peak} bytes ({min_peak / _GIB:.2f} GiB) on a stage, but a device has "
            f"{self.memory} bytes ({self.memory / _GIB:.2f} GiB); {short} bytes "
            f"({short / _GIB:.2f} GiB) short. Use more stages, more tensor parallelism, "
            f"activation recomputation, or a smaller micro batch",
            short)


def evaluate_partition(costs: CostModel, model_stages: Sequence[tuple[int, int]], num_stages: int,
                       *, num_microbatches: int, schedule: str = "1f1b",
                       virtual_stages: int = 1) -> StagePartition:
    """The `StagePartition` of a given cut, evaluated as `partition_layers` evaluates its
    own: for a plan's layer ranges (`model_stages`: S·v contiguous half-open ranges in model
    order, covering every layer), its stage times, sends, per-iteration terms and peaks
    for `num_microbatches` (peaks are reported, not checked against any memory)."""
    check_schedule_shape(schedule, num_stages, virtual_stages, num_microbatches)
    parts = num_stages * virtual_stages
    ranges = [tuple(r) for r in model_stages]
    if len(ranges) != parts:
        raise ValueError(f"{num_stages} stages of {virtual_stages} chunks have {parts} model "
                         f"stages, got {len(ranges)} ranges")
    bounds = [0] + [stop for _, stop in ranges]
    if any(start != bounds[j] or stop <= start for j, (start, stop) in enumerate(ranges)) \
            or bounds[-1] != costs.num_layers:
        raise ValueError(f"model stages {ranges} are not contiguous non-empty ranges covering "
                         f"layers 0..{costs.num_layers - 1} in order")
    prob = PartitionProblem(costs, num_stages, num_microbatches, schedule, virtual_stages,
                    costs.hardware.device_memory_bytes)
    return prob.result(bounds)
