"""Stage partitioning: the cut of the layers into pipeline stages that minimises the
iteration time of the chosen schedule within each device's memory.

A pipeline of `S` stages with `v` virtual stages has `S·v` model stages, contiguous
layer ranges in model order; model stage `j` is local chunk `j // S` of stage `j % S`
(the looped placement of `templates/plan.py`). The partitioner picks the `S·v - 1` cut
positions.

What a cut costs, its iteration time and its peak memory, is `templates/partition_cost.py`'s
(`StagePartition`, `pipeline_iteration_time`, `evaluate_partition`). This module owns
`partition_layers`, which chooses the search:

* `v = 1` (every schedule): exact, by the DP over contiguous cuts
  (`templates/partition_dp.py`).
* `v > 1` (interleaved): exact by exhaustive search when there are at most
  `EXHAUSTIVE_LIMIT` ways to cut (every model of up to 17 layers; with `S·v = 4` up to
  50 layers); otherwise the heuristic of `templates/partition_search.py`, whose cut fits
  whenever it is returned and is not proven optimal.

No torch import: templates are planned anywhere.
"""
from __future__ import annotations

import math
from itertools import combinations
from typing import Sequence

from planaria.templates.costs import CostModel
from planaria.templates.partition_cost import PartitionProblem, StagePartition
from planaria.templates.partition_dp import exact_contiguous, smallest_limit
from planaria.templates.partition_search import solve_heuristic
from planaria.templates.schedules import check_schedule_shape

EXHAUSTIVE_LIMIT = 20_000
"""Interleaved partitions are searched exhaustively up to this many ways to cut."""


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
    prob = PartitionProblem(costs, num_stages, num_microbatches, schedule, virtual_stages, int(memory), also_fits)
    if virtual_stages == 1:
        bounds = _solve_single(prob)
    elif math.comb(L - 1, parts - 1) <= EXHAUSTIVE_LIMIT:
        bounds = _solve_exhaustive(prob)
    else:
        bounds = solve_heuristic(prob)
    return prob.result(bounds)


def _solve_single(prob: PartitionProblem) -> list[int]:
    weights = [max(vec[0] for vec in profile) for profile in prob.profiles]
    beta = prob.m - prob.c
    score = prob.pipeline_time  # what the DP's bottleneck scan can bound (module docstring)
    bounds = exact_contiguous(prob, weights, prob.memory, beta, score, prob.overhead)
    if bounds is None:
        min_peak, _ = smallest_limit(prob, weights, prob.S)
        raise prob.infeasible(min_peak, exact=True)
    return bounds


def _solve_exhaustive(prob: PartitionProblem) -> list[int]:
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


if __name__ == "__main__":  # timing demo: a GPT-3-175B-sized model, tp=8, on H100s
    import time

    from planaria.templates.costs import Hardware, LayerCost, ModelShape
    from planaria.templates.partition_cost import InfeasiblePartition

    GIB = 1 << 30
    shape = ModelShape(n_layers=96, d_model=12288, n_heads=96, vocab_size=50257, seq_len=2048)
    hw = Hardware("h100", 80 * GIB, 989e12, 8, 450e9, 50e9)
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
                       f"{max(part.peak_memory_bytes) / GIB:.1f} GiB"
            except InfeasiblePartition as err:
                note = f"infeasible, {err.shortfall_bytes / GIB:.1f} GiB short"
            elapsed = time.perf_counter() - start
            total += elapsed
            print(f"{name:11s} v={v} S={s:2d}: {elapsed * 1e3:6.1f} ms  {note}")
        print(f"{name:11s} v={v} S=8..24: {total:.2f} s in all")
