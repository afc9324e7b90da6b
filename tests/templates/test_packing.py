"""Packing pipelines onto nodes (`planaria.templates.packing`): the numpy tables give the
answers of plain dynamic programs written the obvious way, on random instances."""
from __future__ import annotations

from hypothesis import example, given, settings, strategies as st

from planaria.templates.packing import pack_short_batch


def short_batch_by_loops(num_nodes, items, min_pipelines, total):
    """The short-batch packing as a plain loop over nodes, sizes and pipeline counts (what
    `pack_short_batch` computed before its rows were vectorised): the oracle."""
    cap = total
    best = [[-1] * (cap + 1) for _ in range(num_nodes + 1)]
    choice = [[None] * (cap + 1) for _ in range(num_nodes + 1)]
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


@st.composite
def instances(draw):
    # Few sizes and capacities, so that ties (two multisets alike in microbatches) are
    # common: which one a packing returns is its tie-breaking, the planner's to rely on.
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4, unique=True))
    items = [(size, draw(st.integers(0, 3))) for size in sorted(sizes)]
    return draw(st.integers(1, 40)), items, draw(st.integers(0, 5)), draw(st.integers(1, 20))


@settings(max_examples=500, deadline=None)
@given(instances())
# Ties the random instances rarely draw: [4, 4, 1] and [5, 2, 2] run 7 microbatches alike
# on 9 nodes; the first size to reach a cell keeps it, as in the loops.
@example((9, [(1, 1), (2, 3), (4, 3), (5, 1)], 2, 6))
@example((25, [(1, 2), (2, 2), (4, 1), (5, 0)], 0, 7))
def test_short_batch_packing_is_the_plain_loops(instance):
    num_nodes, items, min_pipelines, total = instance
    assert pack_short_batch(num_nodes, items, min_pipelines, total) == \
        short_batch_by_loops(num_nodes, items, min_pipelines, total)


def test_a_found_short_batch_packing_fills_the_nodes_and_the_batch():
    sizes = pack_short_batch(20, [(2, 1), (3, 2), (5, 4)], 3, 7)
    capacity = {2: 1, 3: 2, 5: 4}
    assert sizes is not None and sum(sizes) == 20 and len(sizes) >= 3
    assert sum(capacity[s] for s in sizes) >= 7 and len(sizes) <= 7
