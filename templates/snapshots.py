"""Where the peer snapshots of each layer shard live (docs/recovery.md, "Peer snapshots").

Every `checkpoint.memory_every` steps each worker keeps a copy of the layer shards it
holds in its own host memory, and the owner of each shard (the first rank of its replica
group) sends one to `copies` workers on other nodes. This module places those remote
copies; it is pure (no torch), so that the controller, the planner's memory model and the
property tests read the same placement as the workers.

The rule: the copies of a shard of layer L go to distinct nodes that hold no replica of
L (at any tp rank), as many as there are such nodes up to `copies`, the least loaded
first (ties: the plan's node order). Then every layer L with replicas on R_L nodes and
copies on m_L = min(copies, nodes without L) others keeps a source of its state unless
all R_L + m_L of those nodes fail together: a set of failures that takes every replica
of L also takes its snapshots only when it has at least R_L + m_L nodes (`lost_with`).
"""
from __future__ import annotations

from typing import Callable, Iterable

from planaria.templates.plan import Plan, Worker

Shard = tuple[int, int]
"""(layer, tp rank)."""


def snapshot_placement(plan: Plan, copies: int,
                       shard_bytes: Callable[[int], int] = lambda layer: 1) -> dict[Shard, tuple[Worker, ...]]:
    """(layer, tp rank) -> the workers that keep a remote copy of that shard's snapshot.

    A copy goes to the worker of the same tp rank on the chosen node (each node runs one
    stage of `plan.tp` workers): the host memory of a node is shared, but its workers'
    processes hold what they receive, so the load spreads over them as the layers do.
    `shard_bytes(layer)`: a shard's size, to balance the nodes' load (default: equal)."""
    if copies < 0:
        raise ValueError(f"checkpoint.memory_copies must be >= 0, got {copies}")
    stage_of_node = {stage.node: stage for p in plan.pipelines for stage in p.stages}
    order = {node: i for i, node in enumerate(plan.nodes())}
    nodes_of_layer = _nodes_of_layers(plan)
    load = {node: 0 for node in order}
    placement: dict[Shard, tuple[Worker, ...]] = {}
    for layer in range(plan.num_layers):
        others = [n for n in order if n not in nodes_of_layer[layer]]
        for t in range(plan.tp):
            chosen = sorted(others, key=lambda n: (load[n], order[n]))[:copies]
            for node in chosen:
                load[node] += shard_bytes(layer)
            placement[(layer, t)] = tuple(plan.worker(stage_of_node[n].ranks[t]) for n in chosen)
    return placement


def _nodes_of_layers(plan: Plan) -> dict[int, set[str]]:
    nodes: dict[int, set[str]] = {layer: set() for layer in range(plan.num_layers)}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            for layer in stage.layers():
                nodes[layer].add(stage.node)
    return nodes


def lost_with(plan: Plan, copies: int, failed: Iterable[str]) -> list[int]:
    """The layers whose every replica and every snapshot copy are on `failed` nodes: what
    a failure of those nodes takes beyond the reach of replicas and peer memory (only
    the disk checkpoint has them then)."""
    failed = set(failed)
    placement = snapshot_placement(plan, copies)
    nodes_of_layer = _nodes_of_layers(plan)
    return [layer for layer in range(plan.num_layers)
            if nodes_of_layer[layer] <= failed
            and all(w[0] in failed for t in range(plan.tp) for w in placement[(layer, t)])]


def owners(plan: Plan) -> dict[Shard, Worker]:
    """(layer, tp rank) -> the worker that sends the shard's snapshot: the first rank of
    its replica group (the one that speaks for the shard in checkpoints, too)."""
    return {shard: plan.worker(ranks[0]) for shard, ranks in plan.replica_groups().items()}


SNAPSHOT_SHARE = 3 / 4
"""Of a layer's state (master weight, gradient, two Adam moments, all as wide as the
master weight: `LayerCost.held_bytes`), a snapshot keeps the weight and the moments."""

ROUNDS_KEPT = 2
"""Rounds a worker keeps at once: the newest one whole everywhere, and the one after it
(`planaria.runtime.state.peer_snapshots`)."""


def snapshot_host_bytes(plan: Plan, copies: int, state_bytes: Callable[[int], int]) -> dict[str, int]:
    """Host memory each node's workers keep for peer snapshots: `ROUNDS_KEPT` rounds of
    their own shards and of the copies placed on them. `state_bytes(layer)`: one
    worker's state of the layer (its tp shard), as the cost model counts it."""
    snapshot = lambda layer: int(state_bytes(layer) * SNAPSHOT_SHARE)  # noqa: E731
    per_node = {node: 0 for node in plan.nodes()}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            per_node[stage.node] += len(stage.ranks) * sum(snapshot(layer) for layer in stage.layers())
    for (layer, _), holders in snapshot_placement(plan, copies, snapshot).items():
        for node, _ in holders:
            per_node[node] += snapshot(layer)
    return {node: ROUNDS_KEPT * total for node, total in per_node.items()}
