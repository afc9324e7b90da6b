"""Packing pipelines onto nodes: which template sizes, summing to N nodes, run the most
microbatches by a deadline.

The planner's instantiation (`planaria.templates.planner`) asks this question once per
candidate deadline and per size class, so it is its inner loop. Each template size `s`
finishes `c_s` microbatches by the deadline (its capacity); the answer is an unbounded
knapsack over node counts, with the number of pipelines tracked up to the fewest the
plan needs (f+1), since every count from there on is as good:

    best[k][n] = most microbatches that k pipelines (k = cap: cap or more) on exactly n
                 nodes run by the deadline.

Two forms. `most_microbatches` and `pack` vectorise the table over n with numpy: a size
adds any number j of pipelines, and for the "cap or more" row the best j for every n
is a running maximum along each residue class mod s (`_add_any_copies`), so one size
costs a few array passes instead of a Python loop over N·k. That keeps the search for
a thousand nodes and a dozen template sizes well under a second. `pack_short_batch`
is for jobs with fewer microbatches than pipelines of the smallest size could use:
there every pipeline needs a microbatch, so the count must be exact up to the batch,
so the table is built one pipeline count at a time, up to the fewest that run the
batch, each over every node count with numpy (as a plain loop over nodes, sizes and
pipeline counts it took 5 s a call at 2,048 nodes, 40 s an instantiation).

No torch, no planner state: plain integers in, sizes out.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

_NONE = -(1 << 40)
"""No multiset reaches this cell. Far below any real count, and far enough from the
int64 limit that adding a few million microbatches to it cannot overflow."""


def most_microbatches(num_nodes: int, items: Sequence[tuple[int, int]], min_pipelines: int) -> int:
    """The most microbatches that pipelines of the sizes in `items` ((size, capacity)
    pairs), at least `min_pipelines` of them, summing to exactly `num_nodes` nodes, run
    by the deadline the capacities were counted for; -1 when no such multiset exists."""
    tables = _tables(num_nodes, items, max(1, min_pipelines))
    value = int(tables[-1][-1, num_nodes])
    return value if value >= 0 else -1


def pack(num_nodes: int, items: Sequence[tuple[int, int]], min_pipelines: int,
         total: int) -> list[int] | None:
    """Sizes (largest first) from `items`, at least `min_pipelines` of them, summing to
    `num_nodes`, whose capacities add up to `total` or more; None if there are none."""
    cap = max(1, min_pipelines)
    tables = _tables(num_nodes, items, cap)
    if tables[-1][cap, num_nodes] < total:
        return None
    sizes: list[int] = []
    k, n = cap, num_nodes
    for i in range(len(items), 0, -1):  # undo one size at a time
        size, capacity = items[i - 1]
        before, target = tables[i - 1], tables[i][k, n]
        copies, k = _copies(before, k, n, size, capacity, target, cap)
        sizes += [size] * copies
        n -= copies * size
    assert n == 0 and k == 0, "the packing table does not retrace to zero nodes"
    return sorted(sizes, reverse=True)


def _tables(num_nodes: int, items: Sequence[tuple[int, int]], cap: int) -> list[np.ndarray]:
    """best[k][n] (module docstring) after each item: tables[i] uses the first i items."""
    table = np.full((cap + 1, num_nodes + 1), _NONE, dtype=np.int64)
    table[0, 0] = 0
    tables = [table]
    for size, capacity in items:
        new = table.copy()
        for k in range(1, cap):  # exactly k pipelines: j of this size on k − j others
            for j in range(1, k + 1):
                np.maximum(new[k], _shift(table[k - j], j * size) + j * capacity, out=new[k])
        # cap or more: reach the row with the copies it takes, then add any number more
        reach = table[cap].copy()
        for k in range(cap):
            j = cap - k
            np.maximum(reach, _shift(table[k], j * size) + j * capacity, out=reach)
        new[cap] = _add_any_copies(reach, size, capacity)
        table = new
        tables.append(table)
    return tables


def _shift(row: np.ndarray, by: int) -> np.ndarray:
    """row moved `by` nodes up: out[n] = row[n − by], none below `by`."""
    out = np.full_like(row, _NONE)
    if by < len(row):
        out[by:] = row[:len(row) - by]
    return out


def _add_any_copies(row: np.ndarray, size: int, capacity: int) -> np.ndarray:
    """out[n] = max over j ≥ 0 of row[n − j·size] + j·capacity.

    Along one residue class mod `size` (cells r, r+size, r+2·size, ...) this is a
    running maximum of row[r + i·size] − i·capacity, plus i·capacity back: one
    numpy accumulate over a (rows, size) view."""
    n = len(row)
    rows = -(-n // size)
    grid = np.full(rows * size, _NONE, dtype=np.int64)
    grid[:n] = row
    steps = (np.arange(rows, dtype=np.int64) * capacity)[:, None]
    best = np.maximum.accumulate(grid.reshape(rows, size) - steps, axis=0) + steps
    return best.reshape(-1)[:n]


def _copies(before: np.ndarray, k: int, n: int, size: int, capacity: int, target: int,
            cap: int) -> tuple[int, int]:
    """(j, k'): j pipelines of `size` and k' pipelines of the earlier sizes on n − j·size
    nodes that reach `target` in row k (table `before` holds the earlier sizes)."""
    for j in range(n // size + 1):
        rows = [k - j] if k < cap else range(max(0, cap - j), cap + 1)
        for k_before in rows:
            if k_before >= 0 and before[k_before, n - j * size] + j * capacity == target:
                return j, k_before
    raise AssertionError(f"no way back from {target} microbatches on {n} nodes")


def pack_short_batch(num_nodes: int, items: Sequence[tuple[int, int]], min_pipelines: int,
                     total: int) -> list[int] | None:
    """`pack` when the batch bounds the pipeline count: at most `total` pipelines (each
    needs a microbatch), counted exactly.

    best_k[n]: the most microbatches exactly k pipelines on exactly n nodes run by the
    deadline (-1: none), for k = 1, 2, ... in turn: layer k is layer k − 1 shifted by each
    size (one numpy pass over the nodes per size), and a cell keeps the first size, in
    the order of `items`, that reaches its best. The fewest pipelines from `min_pipelines`
    on that run the whole batch answer, so the layers stop there: as many as the plan has
    pipelines, not as many as the batch has microbatches."""
    first = max(1, min_pipelines)
    layer = np.full(num_nodes + 1, -1, dtype=np.int64)
    layer[0] = 0
    chosen: list[np.ndarray] = [np.zeros(num_nodes + 1, dtype=np.int32)]
    """chosen[k][n]: the size of the last pipeline of layer k's best multiset on n nodes."""
    for k in range(1, total + 1):
        before, layer = layer, np.full(num_nodes + 1, -1, dtype=np.int64)
        sizes = np.zeros(num_nodes + 1, dtype=np.int32)
        for size, capacity in items:
            if size > num_nodes:
                continue
            reach = before[:num_nodes + 1 - size]
            candidate = np.where(reach >= 0, reach + capacity, -1)
            cells, last = layer[size:], sizes[size:]
            better = candidate > cells
            cells[better] = candidate[better]
            last[better] = size
        chosen.append(sizes)
        if k >= first and layer[num_nodes] >= total:
            return _retrace(chosen, num_nodes, k)
        if (layer < 0).all():  # no k pipelines fit, so no k + 1 do either
            return None
    return None


def _retrace(chosen: list[np.ndarray], n: int, k: int) -> list[int]:
    """The sizes of layer k's best multiset on n nodes, largest first."""
    result = []
    while n:
        size = int(chosen[k][n])
        result.append(size)
        n, k = n - size, k - 1
    return sorted(result, reverse=True)
