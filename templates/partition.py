"""Stage partitioning: the cut of the layers into pipeline stages that minimises the
iteration time of the chosen schedule within each device's memory.

A pipeline of `S` stages with `v` virtual stages has `S·v` model stages, contiguous
layer ranges in model order; model stage `j` is local chunk `j // S` of stage `j % S`
(the looped placement of `templates/plan.py`). The partitioner picks the `S·v - 1` cut
positions.

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
exact `v = 1` search below does not see the update term (it would need a second
bottleneck); the interleaved searches do, through `objective`.

For uniform stages and no sends these equal `templates.schedule_simulator.simulate`'s makespan
exactly, for every shape the builders accept (zb1f1b: with backward = 2·forward);
the tests check it. For non-uniform stages they are the usual flow-shop approximation:
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

Algorithm, `v = 1` (every schedule): exact. The objective is `c·Σ + (m−c)·T + σ` with
`Σ` fixed, so for each candidate bottleneck `B` (the distinct values of
`compute_time(a, b)`, sorted) a DP finds the smallest `σ` over partitions into exactly
`S` stages with every stage time `≤ B` and every stage's memory `≤` the limit. Stage
constraints are hereditary (a sub-range of a feasible stage is feasible), so the
feasible starts of a stage ending at `b` form a window that only moves right as `b`
grows: one DP is `O(S·L)` with a sliding-window minimum. The smallest feasible `B`
is found by binary search (`O(log L)` DPs); larger candidates are scanned only while
`(m−c)·B + c·Σ + σ_min` can still beat the best found, where `σ_min` is the least send
cost of any memory-feasible partition. When all cut costs are equal (a uniform
decoder) that stops at the first candidate. Total `O(S·L·(log L + scanned))` after an
`O(L² log L)` sort of the candidates.

Algorithm, `v > 1` (interleaved): a stage's time is the sum of `v` non-adjacent model
stages, which no interval DP captures. Exact by exhaustive search when there are at
most `EXHAUSTIVE_LIMIT` ways to cut (every model of up to 17 layers; with `S·v = 4`
up to 50 layers). Otherwise a heuristic, from three starts: the `v = 1` method
balancing the `S·v` model stages (once with each chunk held to `1/v` of the device
memory, which makes every stage fit, once without memory), and a greedy that cuts in
model order giving each chunk its fair share of its stage's remaining time budget
(smallest budget that works, by bisection). A local search then moves one cut, or a
run of up to three model stages, by one layer while that lowers (memory excess,
iteration time, stage times in decreasing order), and `KICKS` seeded random
perturbations restart it. When no start fits, a search that minimises the largest peak
comes first. The result is deterministic, fits whenever it is returned, and is not
proven optimal: on a uniform 96-block decoder it reaches the integrality bound
(⌈96/S⌉ blocks on the slowest stage); on random 8-14-layer models it matched the
exhaustive optimum in about two thirds of the cases, within 2 % in nine of ten. An
`InfeasiblePartition`'s shortfall is then the smallest one the search found (an upper
bound of the true one).

No torch import: templates are planned anywhere.
"""
from __future__ import annotations

import math
import random
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations
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

EXHAUSTIVE_LIMIT = 20_000
"""Interleaved partitions are searched exhaustively up to this many ways to cut."""

KICKS = 4
"""Random restarts of the interleaved heuristic's local search."""

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
# The partitioner
# ---------------------------------------------------------------------------


class _Problem:
    """Prefix sums and schedule facts of one partition_layers call."""

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


def _min_send_cut(prob: _Problem, weights: Sequence[int], limit: float, bottleneck: float,
                  parts: int, offsets: Sequence[float] | None = None) -> list[int] | None:
    """Bounds of a partition of [0, L) into `parts` non-empty ranges minimising the sum of
    cut costs, with part p's compute + offsets[p] ≤ bottleneck and state + weights[p]·act
    ≤ limit; None when none exists. O(parts·L): the feasible starts of a part ending at b
    form a window [lo, b) whose lo never decreases, so a monotone deque gives the minimum."""
    L, C, cut = prob.L, prob.C, prob.cut
    inf = math.inf
    prev: list[float] = []
    choices: list[list[int]] = []
    for p in range(parts):
        off = offsets[p] if offsets is not None else 0.0  # added as the candidates add it
        mem = prob.mem_prefix(weights[p])
        g = [inf] * (L + 1)
        arg = [-1] * (L + 1)
        last = L - (parts - 1 - p)
        if p == 0:
            for b in range(1, last + 1):
                if C[b] - C[0] + off > bottleneck or mem[b] - mem[0] > limit:
                    break
                g[b] = 0.0
        else:
            window: deque[tuple[float, int]] = deque()
            lo = 0
            for b in range(p + 1, last + 1):
                a = b - 1
                h = prev[a]
                if h < inf:
                    h += cut[a]
                    while window and window[-1][0] >= h:
                        window.pop()
                    window.append((h, a))
                cb, mb = C[b], mem[b]
                while lo < b and (cb - C[lo] + off > bottleneck or mb - mem[lo] > limit):
                    lo += 1
                while window and window[0][1] < lo:
                    window.popleft()
                if window:
                    g[b], arg[b] = window[0]
        if all(x == inf for x in g):
            return None
        choices.append(arg)
        prev = g
    if prev[L] == inf:
        return None
    bounds = [L]
    for p in range(parts - 1, 0, -1):
        bounds.append(choices[p][bounds[-1]])
    bounds.append(0)
    return bounds[::-1]


def _smallest_limit(prob: _Problem, weights: Sequence[int], parts: int) -> tuple[int, list[int]]:
    """Smallest memory limit (integer bytes) a partition into `parts` ranges meets, and one
    such partition. Binary search; the largest part's bytes are a valid upper bound."""
    top = max(prob.mem_prefix(w)[prob.L] for w in weights)
    lo, hi = 0, top
    best = _min_send_cut(prob, weights, hi, math.inf, parts)
    while lo < hi:
        mid = (lo + hi) // 2
        found = _min_send_cut(prob, weights, mid, math.inf, parts)
        if found is None:
            lo = mid + 1
        else:
            hi, best = mid, found
    return hi, best


def _candidates(prob: _Problem, offsets: Sequence[float]) -> list[float]:
    """Every value a part's time (compute + its offset) can take."""
    C, L = prob.C, prob.L
    return sorted({C[b] - C[a] + off for off in set(offsets)
                   for a in range(L) for b in range(a + 1, L + 1)})


def _exact_contiguous(prob: _Problem, weights: Sequence[int], limit: float, beta: float,
                      score, offsets: Sequence[float]) -> list[int] | None:
    """Bounds minimising score(bounds) = const + beta·(max part time) + Σ cuts, under the
    memory limit, where part p's time is its compute plus offsets[p]; None if memory
    allows no partition. `score` evaluates a candidate exactly (the caller's objective);
    the DP ranks partitions of one bottleneck by cuts."""
    parts = len(weights)
    cands = _candidates(prob, offsets)
    # Smallest feasible bottleneck: binary search (feasibility is monotone in B).
    top = _min_send_cut(prob, weights, limit, cands[-1], parts, offsets)
    if top is None:
        return None
    if beta <= 0:
        return top  # the bottleneck does not matter: fewest sends wins
    sigma_min = sum(prob.cut[b] for b in top[1:-1])
    largest_layer = max(prob.C[i + 1] - prob.C[i] for i in range(prob.L)) + min(offsets)
    lo, hi = bisect_left(cands, largest_layer), len(cands) - 1
    found = {hi: top}
    while lo < hi:
        mid = (lo + hi) // 2
        bounds = _min_send_cut(prob, weights, limit, cands[mid], parts, offsets)
        if bounds is None:
            lo = mid + 1
        else:
            hi = mid
            found[mid] = bounds
    best = found[hi]
    best_score = score(best)
    slowest = max(prob.C[b] - prob.C[a] + off for (a, b), off in zip(zip(best, best[1:]), offsets))
    base = best_score - beta * slowest - sum(prob.cut[b] for b in best[1:-1])  # the constant part
    for i in range(hi + 1, len(cands)):
        if base + beta * cands[i] + sigma_min >= best_score:
            break
        bounds = _min_send_cut(prob, weights, limit, cands[i], parts, offsets)
        value = score(bounds)
        if value < best_score:
            best, best_score = bounds, value
    return best


def partition_layers(costs: CostModel, num_stages: int, *, num_microbatches: int,
                     schedule: str = "1f1b", virtual_stages: int = 1,
                     memory_bytes: int | None = None, also_fits: Sequence[int] = ()) -> StagePartition:
    """The partition of the layers into `num_stages` stages (`num_stages·virtual_stages`
    model stages of at least one layer each) minimising `pipeline_iteration_time` with
    every stage's peak memory ≤ `memory_bytes` (default: the device's memory), for
    `num_microbatches` and for each count in `also_fits` (the reported peaks are the
    largest over them all).

    Exact for `virtual_stages == 1`, and for the interleaved schedule on small instances
    (at most EXHAUSTIVE_LIMIT ways to cut); a heuristic for larger interleaved ones (see
    the module docstring). Raises InfeasiblePartition when nothing fits, ValueError for
    a shape the schedule cannot run or too few layers.
    """
    for m in (num_microbatches, *also_fits):
        check_schedule_shape(schedule, num_stages, virtual_stages, m)
    L = costs.num_layers
    parts = num_stages * virtual_stages
    if L < parts:
        raise ValueError(
            f"cannot cut {L} layers into {parts} model stages ({num_stages} stages x "
            f"{virtual_stages} virtual stages): every model stage needs at least one layer; "
            f"use at most {L // virtual_stages} stages"
            + (" or fewer virtual stages" if virtual_stages > 1 else ""))
    memory = costs.hardware.device_memory_bytes if memory_bytes is None else memory_bytes
    prob = _Problem(costs, num_stages, num_microbatches, schedule, virtual_stages, int(memory), also_fits)
    if virtual_stages == 1:
        bounds = _solve_single(prob)
    elif math.comb(L - 1, parts - 1) <= EXHAUSTIVE_LIMIT:
        bounds = _solve_exhaustive(prob)
    else:
        bounds = _solve_heuristic(prob)
    return prob.result(bounds)


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
    prob = _Problem(costs, num_stages, num_microbatches, schedule, virtual_stages,
                    costs.hardware.device_memory_bytes)
    return prob.result(bounds)


def _solve_single(prob: _Problem) -> list[int]:
    weights = [max(vec[0] for vec in profile) for profile in prob.profiles]
    beta = prob.m - prob.c
    score = prob.pipeline_time  # what the DP's bottleneck scan can bound (module docstring)
    bounds = _exact_contiguous(prob, weights, prob.memory, beta, score, prob.overhead)
    if bounds is None:
        min_peak, _ = _smallest_limit(prob, weights, prob.S)
        raise prob.infeasible(min_peak, exact=True)
    return bounds


def _solve_exhaustive(prob: _Problem) -> list[int]:
    best, best_value, min_peak = None, math.inf, None
    for inner in combinations(range(1, prob.L), prob.P - 1):
        bounds = (0, *inner, prob.L)
        value, peak, _ = prob.objective(bounds)
        min_peak = peak if min_peak is None else min(min_peak, peak)
        if peak <= prob.memory and value < best_value:
            best, best_value = list(bounds), value
    if best is None:
        raise prob.infeasible(min_peak, exact=True)
    return best


def _chunk_weights(prob: _Problem) -> list[int]:
    """Per model stage j: the most microbatches of its chunk its stage ever holds."""
    S = prob.S
    return [max(vec[j // S] for vec in prob.profiles[j % S]) for j in range(prob.P)]


def _local_search(prob: _Problem, bounds: Sequence[int], memory_first: bool,
                  span_limit: int = 3) -> list[int]:
    """Move single cuts by one layer while the key decreases (first improvement).

    Key: (memory excess, iteration time, stage times in decreasing order), or with
    `memory_first` (largest peak, iteration time). A move changes two model stages, so
    only their two stages are re-evaluated.
    """
    S, m, c, cut, limit = prob.S, prob.m, prob.c, prob.cut, prob.memory
    bounds = list(bounds)
    stages = [prob.stage(bounds, s) for s in range(S)]
    times, peaks = [t for t, _ in stages], [p for _, p in stages]
    sends = sum(cut[b] for b in bounds[1:-1])

    def key():
        slowest = max(times)
        value = m * slowest + c * (sum(times) - slowest) + sends
        if memory_first:
            return (max(peaks), value)
        return (max(0, max(peaks) - limit), value, sorted(times, reverse=True))

    # (first cut, last cut, step): move one cut, or shift a run of model stages along.
    moves = [(i, j, step) for span in range(span_limit) for i in range(1, prob.P - span)
             for j in (i + span,) for step in (-1, 1)]
    current = key()
    improved = True
    budget = 200 * prob.L * prob.P
    while improved and budget > 0:
        improved = False
        for i, j, step in moves:
            if not (bounds[i - 1] < bounds[i] + step and bounds[j] + step < bounds[j + 1]):
                continue
            budget -= 1
            olds = bounds[i:j + 1]
            touched = {k % S for k in range(i - 1, j + 1)}
            saved = [(s, times[s], peaks[s]) for s in touched]
            for k in range(i, j + 1):
                bounds[k] += step
            delta = sum(cut[b + step] - cut[b] for b in olds)
            sends += delta
            for s in touched:
                times[s], peaks[s] = prob.stage(bounds, s)
            value = key()
            if value < current:
                current, improved = value, True
                continue
            bounds[i:j + 1] = olds
            sends -= delta
            for s, t, p in saved:
                times[s], peaks[s] = t, p
    return bounds


def _greedy_cut(prob: _Problem, budget: float) -> list[int] | None:
    """Cut model stages in order, each stage's time held to `budget`: chunk c of a stage
    aims at its fair share, remaining budget / (v − c), rounded to the nearest layer,
    within memory; the last model stage takes what is left. None when that breaks the
    budget or the memory."""
    S, v, P, L, C = prob.S, prob.v, prob.P, prob.L, prob.C
    state, act = prob.state, prob.act
    left = [budget - prob.overhead[s] for s in range(S)]
    held_state = [0] * S
    held_act = [[0] * v for _ in range(S)]

    def fits(s: int, c: int, start: int, stop: int) -> bool:
        acts = held_act[s]
        saved, acts[c] = acts[c], act[stop] - act[start]
        peak = max(sum(n * x for n, x in zip(vec, acts)) for vec in prob.profiles[s])
        acts[c] = saved
        return held_state[s] + state[stop] - state[start] + peak <= prob.memory

    bounds = [0]
    for j in range(P):
        s, c = j % S, j // S
        start = bounds[-1]
        last = L - (P - 1 - j)
        if j == P - 1:
            stop = L
        else:
            share = left[s] / (v - c)
            stop = start + 1
            while stop < last:
                longer = C[stop + 1] - C[start]
                if longer > left[s] or (longer > share and
                                        longer - share > share - (C[stop] - C[start])):
                    break
                if not fits(s, c, start, stop + 1):
                    break
                stop += 1
        if C[stop] - C[start] > left[s] or not fits(s, c, start, stop):
            return None
        left[s] -= C[stop] - C[start]
        held_state[s] += state[stop] - state[start]
        held_act[s][c] = act[stop] - act[start]
        bounds.append(stop)
    return bounds


def _balanced_greedy(prob: _Problem) -> list[int] | None:
    """`_greedy_cut` with about the smallest budget it meets. Budgets rise from the lower
    bound max(Σ/S, largest layer), by 0.5 % steps up to +10 %, then by 5 % up to twice
    the bound, until one works; bisection refines. None if none up to there works."""
    C, L = prob.C, prob.L
    floor = max(max(C[i + 1] - C[i] for i in range(L)) + min(prob.overhead),
                (C[L] - C[0] + sum(prob.overhead)) / prob.S)
    budgets = [floor * (1 + 0.005 * k) for k in range(21)]
    while budgets[-1] < 2 * floor:
        budgets.append(budgets[-1] * 1.05)
    lo = found = None
    for budget in budgets:
        found = _greedy_cut(prob, budget)
        if found is not None:
            break
        lo = budget
    if found is None:
        return None
    hi = budget
    if lo is not None:
        for _ in range(10):
            mid = (lo + hi) / 2
            better = _greedy_cut(prob, mid)
            if better is None:
                lo = mid
            else:
                hi, found = mid, better
    return found


def _solve_heuristic(prob: _Problem) -> list[int]:
    weights = _chunk_weights(prob)
    beta = prob.v * (prob.m - prob.c)

    def chunk_score(bounds):
        C, cut, off = prob.C, prob.cut, prob.chunk_overhead
        return beta * max(C[b] - C[a] + o for (a, b), o in zip(zip(bounds, bounds[1:]), off)) + \
            sum(cut[b] for b in bounds[1:-1])

    def key(bounds):
        value, peak, times = prob.objective(bounds)
        return (max(0, peak - prob.memory), value, sorted(times, reverse=True))

    starts = []
    for limit in (prob.memory // prob.v, math.inf):
        bounds = _exact_contiguous(prob, weights, limit, beta, chunk_score, prob.chunk_overhead)
        if bounds is not None:
            starts.append(bounds)
    bounds = _balanced_greedy(prob)
    if bounds is not None:
        starts.append(bounds)
    best = min((_local_search(prob, b, memory_first=False) for b in starts), key=key)
    if key(best)[0] > 0:
        # Nothing found fits: search for the smallest peak first, then for time from there.
        _, balanced = _smallest_limit(prob, weights, prob.P)
        lowest = _local_search(prob, balanced, memory_first=True)
        best = min(best, _local_search(prob, lowest, memory_first=False), key=key)
        if key(best)[0] > 0:
            raise prob.infeasible(min(prob.objective(lowest)[1], prob.objective(best)[1]),
                                  exact=False)
    # Kicks: perturb the best cut at random (seeded: the result is deterministic) and
    # search again, keeping what improves.
    rng = random.Random(0)
    for _ in range(KICKS):
        kicked = list(best)
        for _ in range(max(2, prob.P // 4)):
            i = rng.randrange(1, prob.P)
            step = rng.choice((-2, -1, 1, 2))
            if kicked[i - 1] < kicked[i] + step < kicked[i + 1]:
                kicked[i] += step
        candidate = _local_search(prob, kicked, memory_first=False)
        if key(candidate) < key(best):
            best = candidate
    return best


if __name__ == "__main__":  # timing demo: a GPT-3-175B-sized model, tp=8, on H100s
    import time

    from planaria.templates.costs import Hardware, LayerCost, ModelShape

    shape = ModelShape(n_layers=96, d_model=12288, n_heads=96, vocab_size=50257, seq_len=2048)
    hw = Hardware("h100", 80 * _GIB, 989e12, 8, 450e9, 50e9)
    tp, tokens = 8, 2048  # micro batch 1
    block_params = 12 * shape.d_model ** 2
    block_s = 6 * block_params * tokens / tp / (hw.peak_flops * hw.matmul_efficiency)
    block_state = 16 * block_params // tp
    block_act = (34 * tokens * shape.d_model + 5 * shape.n_heads * tokens ** 2) // tp
    hidden = 2 * tokens * shape.d_model
    # Uniform blocks; the embedding and the head (vocabulary projection, loss) are heavier.
    scale = {"embedding": (0.3, 1.5, 1.0), "block": (1.0, 1.0, 1.0), "head": (2.0, 1.5, 2.0)}
    layers = []
    for i in range(shape.num_layers):
        t, st, act = scale[shape.layer_kind(i)]
        layers.append(LayerCost(forward_s=t * block_s / 3, backward_s=2 * t * block_s / 3,
                                state_bytes=int(st * block_state),
                                activation_bytes=int(act * block_act), output_bytes=hidden))
    costs = CostModel(shape, hw, tp, 1, tuple(layers))
    for name, v in (("1f1b", 1), ("zb1f1b", 1), ("gpipe", 1), ("interleaved", 2)):
        total = 0.0
        for s in range(8, 25):
            start = time.perf_counter()
            try:
                part = partition_layers(costs, s, num_microbatches=2 * s, schedule=name,
                                        virtual_stages=v)
                note = f"slowest stage {max(part.stage_times) * 1e3:.1f} ms, peak " \
                       f"{max(part.peak_memory_bytes) / _GIB:.1f} GiB"
            except InfeasiblePartition as err:
                note = f"infeasible, {err.shortfall_bytes / _GIB:.1f} GiB short"
            elapsed = time.perf_counter() - start
            total += elapsed
            print(f"{name:11s} v={v} S={s:2d}: {elapsed * 1e3:6.1f} ms  {note}")
        print(f"{name:11s} v={v} S=8..24: {total:.2f} s in all")
