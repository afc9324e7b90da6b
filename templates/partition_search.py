"""The interleaved heuristic: a cut of the layers into the `S·v` model stages of a
pipeline of `v > 1` virtual stages, when there are too many ways to cut to try them all
(`partition_layers` in `templates/partition.py` decides).

A stage's time is the sum of `v` non-adjacent model stages, which no interval DP
captures. The heuristic starts from three cuts: the `v = 1` method
(`templates/partition_dp.py`) balancing the `S·v` model stages (once with each chunk
held to `1/v` of the device memory, which makes every stage fit, once without memory),
and a greedy that cuts in model order giving each chunk its fair share of its stage's
remaining time budget (smallest budget that works, by bisection). A local search then
moves one cut, or a run of up to three model stages, by one layer while that lowers
(memory excess, iteration time, stage times in decreasing order), and `KICKS` seeded
random perturbations restart it. When no start fits, a search that minimises the
largest peak comes first. The result is deterministic, fits whenever it is returned,
and is not proven optimal: on a uniform 96-block decoder it reaches the integrality
bound (⌈96/S⌉ blocks on the slowest stage); on random 8-14-layer models it matched the
exhaustive optimum in about two thirds of the cases, within 2 % in nine of ten. An
`InfeasiblePartition`'s shortfall is then the smallest one the search found (an upper
bound of the true one).

No torch import: templates are planned anywhere.
"""
from __future__ import annotations

import math
import random
from typing import Sequence

from planaria.templates.partition_cost import PartitionProblem
from planaria.templates.partition_dp import exact_contiguous, smallest_limit

KICKS = 4
"""Random restarts of the interleaved heuristic's local search."""


def _chunk_weights(prob: PartitionProblem) -> list[int]:
    """Per model stage j: the most microbatches of its chunk its stage ever holds."""
    S = prob.S
    return [max(vec[j // S] for vec in prob.profiles[j % S]) for j in range(prob.P)]


def _local_search(prob: PartitionProblem, bounds: Sequence[int], memory_first: bool,
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


def _greedy_cut(prob: PartitionProblem, budget: float) -> list[int] | None:
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


def _balanced_greedy(prob: PartitionProblem) -> list[int] | None:
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


def solve_heuristic(prob: PartitionProblem) -> list[int]:
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
        bounds = exact_contiguous(prob, weights, limit, beta, chunk_score, prob.chunk_overhead)
        if bounds is not None:
            starts.append(bounds)
    bounds = _balanced_greedy(prob)
    if bounds is not None:
        starts.append(bounds)
    best = min((_local_search(prob, b, memory_first=False) for b in starts), key=key)
    if key(best)[0] > 0:
        # Nothing found fits: search for the smallest peak first, then for time from there.
        _, balanced = smallest_limit(prob, weights, prob.P)
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
