"""The placement of peer snapshots (planaria.templates.snapshots), on the planner's plans.

The rule: each shard's remote copies sit on distinct nodes that hold no replica of its
layer, as many as such nodes allow up to `copies`; so a set of failed nodes takes a
layer's state beyond the reach of replicas and peer memory only if it holds every one
of the layer's replica nodes and copy nodes: at least R + m of them. Checked by brute
force over every set of failed nodes of plans the planner makes for random jobs.
"""
from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from planaria.templates.job_templates import PlannerSettings
from planaria.templates.planner import Planner
from planaria.templates.snapshots import lost_with, owners, snapshot_placement
from tests.templates.planner_cases import instances

PROPERTY = settings(max_examples=25, deadline=None)


def nodes_of_layer(plan, layer: int) -> set[str]:
    return {s.node for p in plan.pipelines for s in p.stages if layer in set(s.layers())}


@PROPERTY
@given(instance=instances(max_n0=3), data=st.data())
def test_copies_sit_on_distinct_nodes_without_the_layer(instance, data):
    costs, f, total = instance
    planner = Planner(costs, PlannerSettings(fault_tolerance=f, global_batch=total, micro_batch=1))
    num_nodes = data.draw(st.integers(planner.n0, 2 * planner.n0 + 4))
    plan = planner.instantiate(num_nodes, [f"n{i}" for i in range(num_nodes)]).plan
    copies = data.draw(st.integers(0, 3))
    placement = snapshot_placement(plan, copies)
    assert set(placement) == set(plan.replica_groups()) == set(owners(plan))
    for (layer, t), holders in placement.items():
        without = set(plan.nodes()) - nodes_of_layer(plan, layer)
        assert len(holders) == min(copies, len(without))
        assert len({node for node, _ in holders}) == len(holders)
        assert {node for node, _ in holders} <= without
        ranks = plan.rank_of_worker()
        assert all(plan.rank_info(ranks[w]).tp_rank == t for w in holders)  # a shard of its own tp rank


@PROPERTY
@given(instance=instances(max_n0=3), data=st.data())
def test_a_layer_is_lost_to_memory_only_with_all_its_replica_and_copy_nodes(instance, data):
    costs, f, total = instance
    planner = Planner(costs, PlannerSettings(fault_tolerance=f, global_batch=total, micro_batch=1))
    num_nodes = data.draw(st.integers(planner.n0, min(8, 2 * planner.n0 + 3)))
    plan = planner.instantiate(num_nodes, [f"n{i}" for i in range(num_nodes)]).plan
    copies = data.draw(st.integers(0, 2))
    placement = snapshot_placement(plan, copies)
    needed = {layer: nodes_of_layer(plan, layer) | {w[0] for t in range(plan.tp) for w in placement[(layer, t)]}
              for layer in range(plan.num_layers)}
    bound = min(len(n) for n in needed.values())
    for size in range(len(plan.nodes()) + 1):
        for failed in itertools.combinations(plan.nodes(), size):
            lost = lost_with(plan, copies, failed)
            assert lost == [layer for layer in range(plan.num_layers) if needed[layer] <= set(failed)]
            if size < bound:
                assert not lost  # the stated bound: fewer than R + m failures lose nothing


def test_a_six_node_job_keeps_each_layer_through_four_failures():
    """The replay's job (6 nodes, f=1, two-stage pipelines): each layer has 3 replica
    nodes and 2 copy nodes, so any 4 nodes may fail together without a disk read."""
    from planaria.templates.layout import plan_from_layout

    plan = plan_from_layout(layout=[[1, 2]] * 3, n_blocks=3, tp=1, schedule="1f1b", virtual_stages=1,
                            global_batch=6, micro_batch=1)
    for failed in itertools.combinations(plan.nodes(), 4):
        assert lost_with(plan, 2, failed) == []
    assert lost_with(plan, 1, ["node0", "node2", "node4", "node1"]) == [0]  # one copy: not always


def test_host_memory_counts_two_rounds_of_own_layers_and_kept_copies():
    """Layer l's state is 16(l+1) bytes, its snapshot 12(l+1) (weight and two moments of
    the four). By the placement (least loaded first, ties in node order), node0 keeps
    copies of layers 2 and 3 (36 + 48 bytes) beside its own layers 0 and 1 (12 + 24)."""
    from planaria.templates.layout import plan_from_layout
    from planaria.templates.snapshots import snapshot_host_bytes

    plan = plan_from_layout(layout=[[1, 2]] * 3, n_blocks=3, tp=1, schedule="1f1b", virtual_stages=1,
                            global_batch=6, micro_batch=1)
    placement = snapshot_placement(plan, 2, lambda layer: 12 * (layer + 1))
    assert [layer for (layer, _), holders in sorted(placement.items()) if ("node0", 0) in holders] == [2, 3]
    assert snapshot_host_bytes(plan, 2, lambda layer: 16 * (layer + 1))["node0"] == 2 * (12 + 24 + 36 + 48)
