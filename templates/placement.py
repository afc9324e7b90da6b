"""Which node runs which stage: placing nodes so that a new plan moves the least layer state.

When a running job gets a new plan (nodes lost or added), every stage of the new plan
needs its layers' state (parameters and optimizer state). A node that already holds
them from the current plan needs nothing; any other node must receive them from a
replica. Placement decides which surviving node takes which stage.

The placement is greedy: first every stage goes to a free node that already holds
exactly its layers, if there is one (a dictionary lookup on the layer set, so an
unchanged pipeline costs nothing to keep); then the remaining stages, largest first,
each to the free node missing the fewest bytes. An optimal assignment (Hungarian algorithm) costs
O(N³) for N nodes; after a failure almost every stage has an exact holder, which the
greedy keeps, so the difference is confined to the few stages that really change.
"""
from __future__ import annotations

from typing import Callable, Sequence

from planaria.templates.plan import Plan

StageLayers = frozenset[int]


def layers_held(current: Plan | None, node_ids: Sequence[str]) -> dict[str, StageLayers]:
    """Layers each of `node_ids` holds in `current` (empty for new nodes)."""
    held = {node: frozenset() for node in node_ids}
    if current is not None:
        for pipeline in current.pipelines:
            for stage in pipeline.stages:
                if stage.node in held:
                    held[stage.node] = frozenset(stage.layers())
    return held


def place_nodes(stages: Sequence[StageLayers], node_ids: Sequence[str], current: Plan | None,
                layer_bytes: Callable[[int], int]) -> list[str]:
    """A node id for each of `stages` (the new plan's stages, flattened in plan order)."""
    if len(stages) != len(node_ids):
        raise ValueError(f"{len(stages)} stages need as many nodes, got {len(node_ids)}")
    if current is None:
        return list(node_ids)  # nothing to keep: nodes in the order given
    held = layers_held(current, node_ids)
    by_layers: dict[StageLayers, list[str]] = {}
    for node in reversed(node_ids):  # popped from the end: node order decides ties
        by_layers.setdefault(held[node], []).append(node)
    free = set(node_ids)
    placed: list[str | None] = [None] * len(stages)

    def cost(stage: StageLayers) -> int:
        return sum(layer_bytes(layer) for layer in stage)

    order = sorted(range(len(stages)), key=lambda i: (-cost(stages[i]), i))
    # First every stage whose layers a free node already holds: keeping it costs nothing.
    for index in order:
        holders = by_layers.get(stages[index], [])
        while holders and holders[-1] not in free:
            holders.pop()
        if holders:
            placed[index] = holders.pop()
            free.discard(placed[index])
    # Then the rest, largest first, each to the free node missing the fewest bytes.
    for index in order:
        if placed[index] is None:
            stage = stages[index]
            placed[index] = min(free, key=lambda n: (cost(stage - held[n]), node_ids.index(n)))
            free.discard(placed[index])
    return placed  # type: ignore[return-value]


def moved_bytes(old: Plan, new: Plan, layer_bytes: Callable[[int], int]) -> int:
    """Bytes of layer state the move from `old` to `new` sends (one tp shard per transfer)."""
    from planaria.templates.plan import transfers

    return sum(layer_bytes(t.layer) for t in transfers(old, new))
