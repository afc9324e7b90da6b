"""Which node runs which stage: placing nodes so that a new plan moves the least layer state.

When a running job gets a new plan (nodes lost or added), every stage of the new plan
needs its layers' state (parameters and optimizer state). A node that already holds
them from the current plan needs nothing; any other node must receive them from a
replica. Placement decides which surviving node takes which stage.

The placement is greedy: first every stage goes to a free node that already holds
exactly its layers, if there is one (a dictionary lookup on the layer set, so an
unchanged pipeline costs nothing to keep); then the remaining stages, largest first,
each to the free node missing the fewest bytes. Nodes holding the same layers are
interchangeable, so each step looks at one candidate per distinct layer set, which
keeps re-planning for a thousand nodes well under a second. An optimal assignment (Hungarian algorithm) costs
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
    """A node id for each of `stages` (the new plan's stages, flattened in plan order).

    With more nodes than stages (a plan that cannot use them all), the ones left over
    are the last given (without `current`) or those holding the least of what the
    stages need, new nodes (holding nothing) before others."""
    if len(stages) > len(node_ids):
        raise ValueError(f"{len(stages)} stages need as many nodes, got {len(node_ids)}")
    if current is None:
        return list(node_ids[:len(stages)])  # nothing to keep: nodes in the order given
    held = layers_held(current, node_ids)
    # Free nodes grouped by the layers they hold, each group in node order (popped from
    # the end). Nodes holding the same layers are interchangeable, so the search below
    # looks at one candidate per group, not at every node.
    groups: dict[StageLayers, list[str]] = {}
    for node in reversed(node_ids):
        groups.setdefault(held[node], []).append(node)
    position = {node: i for i, node in enumerate(node_ids)}
    placed: list[str | None] = [None] * len(stages)

    def cost(layers: StageLayers) -> int:
        return sum(layer_bytes(layer) for layer in layers)

    def take(layers: StageLayers) -> str:
        node = groups[layers].pop()
        if not groups[layers]:
            del groups[layers]
        return node

    order = sorted(range(len(stages)), key=lambda i: (-cost(stages[i]), i))
    # First every stage whose layers a free node already holds: keeping it costs nothing.
    for index in order:
        if stages[index] in groups:
            placed[index] = take(stages[index])
    # Then the rest, largest first, each to the free node missing the fewest bytes.
    for index in order:
        if placed[index] is None:
            stage = stages[index]
            # Ties go to a node that holds layers over a new one: with more nodes than
            # stages, the new ones are then those left over, as joiners no plan uses are.
            best = min(groups, key=lambda h: (cost(stage - h), not h, position[groups[h][-1]]))
            placed[index] = take(best)
    return placed  # type: ignore[return-value]


def moved_bytes(old: Plan, new: Plan, layer_bytes: Callable[[int], int]) -> int:
    """Bytes of layer state the move from `old` to `new` sends: one tp shard per transfer.

    The same count as `planaria.templates.plan.transfers` (a shard a worker lacks and
    some survivor holds), computed per node from layer sets, without choosing sources.
    """
    new_nodes = [stage.node for pipeline in new.pipelines for stage in pipeline.stages]
    held = layers_held(old, new_nodes)
    surviving = frozenset().union(*held.values())
    total = 0
    for pipeline in new.pipelines:
        for stage in pipeline.stages:
            missing = (frozenset(stage.layers()) - held[stage.node]) & surviving
            total += new.tp * sum(layer_bytes(layer) for layer in missing)
    return total
