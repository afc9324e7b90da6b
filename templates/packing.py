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
is the plain loop, for jobs with fewer microbatches than pipelines of the smallest
size could use: there every pipeline needs a microbatch, so the count must be exact
up to the batch, and those jobs are small.

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
    needs a microbatch), counted exactly, so the table has `total` + 1 rows."""
    cap = total
    best = [[-1] * (cap + 1) for _ in range(num_nodes + 1)]
    choice: list[list[tuple[int, int] | None]] = [[None] * (cap + 1) for _ in range(num_nodes + 1)]
    best[0][0] = 0
    for n in range(1, num_nodes + 1):
        for size, capacity in items:
            if size > n:
                continue
            for k, value in enumerate(best[n - size][:cap]):
                if value >= 0 and value + capacity > best[n][k + 1]:
                    best[n][k + 1], choice[n][k + 1] = value + capacity, (size, k)
    finals = [k for k in range(max(1, min_pipelines), cap + 1) if best[num_nodes][k] >= total]
    if not finals:
        return None
    result, n, k = [], num_nodes, finals[0]
    while n:
        size, k = choice[n][k]
        result.append(size)
        n -= size
    return sorted(result, reverse=True)
