"""The exact search over contiguous cuts: a DP that, for a bound on the slowest part's
time, finds the cut of the layers into a given number of parts with the least send
cost within memory; and the search over those bounds.

`partition_layers` (`templates/partition.py`) cuts a pipeline of `v = 1` (every
schedule) with it, exactly. The objective is `c·Σ + (m−c)·T + σ` with `Σ` fixed, so for each candidate bottleneck `B` (the distinct values of
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

The interleaved heuristic (`templates/partition_search.py`) starts from the same search
over the `S·v` model stages, and uses `smallest_limit` when nothing fits.

No torch import: templates are planned anywhere.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from typing import Sequence

from planaria.templates.partition_cost import PartitionProblem


def _min_send_cut(prob: PartitionProblem, weights: Sequence[int], limit: float, bottleneck: float,
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


def smallest_limit(prob: PartitionProblem, weights: Sequence[int], parts: int) -> tuple[int, list[int]]:
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


def _candidates(prob: PartitionProblem, offsets: Sequence[float]) -> list[float]:
    """Every value a part's time (compute + its offset) can take."""
    C, L = prob.C, prob.L
    return sorted({C[b] - C[a] + off for off in set(offsets)
                   for a in range(L) for b in range(a + 1, L + 1)})


def exact_contiguous(prob: PartitionProblem, weights: Sequence[int], limit: float, beta: float,
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
