"""The plan contract's `transfers` / `missing_layers`: what moves, and from whom, when a
job goes from one plan to the next."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planaria.templates.layout import plan_from_layout
from planaria.templates.plan import (
    PipelinePlan,
    Plan,
    PlanError,
    StagePlan,
    Transfer,
    missing_layers,
    transfers,
)
from tests.templates.plan_cases import good_plan, layout_args, relabel


def holders(plan: Plan) -> dict[tuple[int, int], set[tuple[str, int]]]:
    return {key: {plan.worker(r) for r in ranks} for key, ranks in plan.replica_groups().items()}


def check_transfer_contract(old: Plan, new: Plan) -> list[Transfer]:
    """Properties every `transfers` result must have; returns the transfers."""
    result = transfers(old, new)
    alive = set(new.rank_of_worker())
    old_h, new_h = holders(old), holders(new)
    lost = set(missing_layers(old, new))
    for t in result:
        key = (t.layer, t.tp_rank)
        assert t.dst in new_h[key], f"{t} sends a shard the receiver does not need"
        assert t.dst not in old_h[key], f"{t} sends a shard the receiver already holds"
        assert t.src in old_h[key], f"{t} comes from a worker that does not hold it"
        assert t.src in alive, f"{t} comes from a worker that is gone"
        assert t.src[1] == t.dst[1] == t.tp_rank
        assert key not in lost
    received = Counter((t.layer, t.tp_rank, t.dst) for t in result)
    needed = {
        (key[0], key[1], dst)
        for key, dsts in new_h.items() for dst in dsts
        if dst not in old_h[key] and key not in lost
    }
    assert set(received) == needed, "every lacking shard with a live holder is sent"
    assert all(n == 1 for n in received.values()), "no shard is sent twice to one worker"
    assert lost == {key for key, hs in old_h.items() if not hs & alive}
    return result


# ---------------------------------------------------------------- 4. transfers
BATCH = dict(n_blocks=4, tp=1, virtual_stages=1, global_batch=4, micro_batch=1)


def old_plan() -> Plan:
    """2 pipelines x 2 stages on node0..node3; 6 layers: node0/node2 hold 0-2, node1/node3 3-5."""
    plan = plan_from_layout([[2, 2], [2, 2]], schedule="1f1b", **BATCH)
    assert [s.node for p in plan.pipelines for s in p.stages] == ["node0", "node1", "node2", "node3"]
    return plan


def stage(node: str, rank: int, start: int, stop: int) -> StagePlan:
    return StagePlan(node=node, ranks=(rank,), chunks=((start, stop),))


def plan_of(*pipelines: tuple[StagePlan, ...], epoch: int = 1) -> Plan:
    counts = [2] * len(pipelines) if len(pipelines) == 2 else [4 // len(pipelines)] * len(pipelines)
    counts[-1] += 4 - sum(counts)
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    return Plan(
        epoch=epoch, first_iteration=100, num_layers=6, tp=1, schedule="1f1b", virtual_stages=1,
        global_batch=4, micro_batch=1,
        pipelines=tuple(PipelinePlan("manual", stages, c, o)
                        for stages, c, o in zip(pipelines, counts, offsets)),
    )


def test_transfers_after_a_node_dies():
    old = old_plan()
    # node1 (second half of pipeline 0) died: node0 now runs the whole model alone
    new = plan_of(
        (stage("node0", 0, 0, 6),),
        (stage("node2", 1, 0, 3), stage("node3", 2, 3, 6)),
    )
    result = check_transfer_contract(old, new)
    assert sorted(result, key=lambda t: t.layer) == [
        Transfer(layer=layer, tp_rank=0, src=("node3", 0), dst=("node0", 0)) for layer in (3, 4, 5)
    ]
    assert all(t.src != ("node1", 0) for t in result)
    assert missing_layers(old, new) == []


def test_transfers_spread_sources_over_surviving_replicas():
    old = old_plan()
    # node1 died; node3 takes a whole pipeline and needs layers 0-2, held by node0 and node2
    new = plan_of(
        (stage("node0", 0, 0, 3), stage("node2", 1, 3, 6)),
        (stage("node3", 2, 0, 6),),
    )
    result = check_transfer_contract(old, new)
    to_node3 = [t for t in result if t.dst == ("node3", 0)]
    assert sorted(t.layer for t in to_node3) == [0, 1, 2]
    senders = Counter(t.src for t in to_node3)
    assert set(senders) == {("node0", 0), ("node2", 0)}, "both replicas send"
    assert max(senders.values()) - min(senders.values()) <= 1
    # node2 switches to layers 3-5, whose only survivor is node3
    assert sorted((t.layer, t.src) for t in result if t.dst == ("node2", 0)) == [
        (layer, ("node3", 0)) for layer in (3, 4, 5)
    ]
    assert all(t.src != ("node1", 0) for t in result)


def test_a_fresh_node_loads_from_all_replicas_evenly():
    old = plan_from_layout([[4], [4]], schedule="gpipe", **BATCH)  # node0, node1: all 6 layers
    new = plan_of(
        (stage("node0", 0, 0, 6),),
        (stage("node1", 1, 0, 6),),
        (stage("spare", 2, 0, 6),),
    )
    result = check_transfer_contract(old, new)
    assert {t.dst for t in result} == {("spare", 0)}
    assert sorted(t.layer for t in result) == list(range(6))
    assert Counter(t.src for t in result) == {("node0", 0): 3, ("node1", 0): 3}


def test_nothing_moves_when_the_plan_is_unchanged():
    old = old_plan()
    assert transfers(old, replace(old, epoch=1)) == []
    assert missing_layers(old, replace(old, epoch=1)) == []


def test_layers_whose_holders_all_died_are_missing_not_transferred():
    old = old_plan()
    # node1 and node3 both died: nobody holds layers 3-5 any more
    new = plan_of(
        (stage("node0", 0, 0, 3), stage("node2", 1, 3, 6)),
    )
    assert missing_layers(old, new) == [(3, 0), (4, 0), (5, 0)]
    assert transfers(old, new) == []
    check_transfer_contract(old, new)

    # partial loss: node0's copy of layers 0-2 is still sent where needed
    new = plan_of((stage("node2", 0, 0, 6),))
    result = check_transfer_contract(old, new)
    assert result == []  # node2 already has 0-2, and 3-5 are gone
    assert missing_layers(old, new) == [(3, 0), (4, 0), (5, 0)]


def test_transfers_with_tensor_parallelism_keep_shards_on_their_tp_rank():
    args = dict(n_blocks=4, tp=2, schedule="1f1b", virtual_stages=1, global_batch=4, micro_batch=1)
    old = plan_from_layout([[2, 2], [2, 2]], **args)
    new = relabel(plan_from_layout([[4], [2, 2]], **args),
                  {"node0": "node0", "node1": "node2", "node2": "node3"})
    result = check_transfer_contract(old, new)
    assert sorted((t.layer, t.tp_rank, t.src, t.dst) for t in result) == [
        (layer, t, ("node3", t), ("node0", t)) for layer in (3, 4, 5) for t in (0, 1)
    ]


def test_transfers_refuse_incompatible_plans():
    old = good_plan()
    with pytest.raises(PlanError, match="different tp or num_layers"):
        transfers(old, good_plan(tp=1))
    with pytest.raises(PlanError, match="different tp or num_layers"):
        transfers(old, plan_from_layout([[3, 3], [3, 3]], n_blocks=6, tp=2, schedule="1f1b",
                                        virtual_stages=1, global_batch=8, micro_batch=2))


@st.composite
def plan_pairs(draw):
    """Two plans of the same job over the same nodes (renamed), the new one maybe on fewer."""
    tp = draw(st.integers(1, 2))
    n_blocks = draw(st.integers(2, 8))
    nodes = draw(st.integers(1, 6))
    old = plan_from_layout(**draw(layout_args(tp=tp, n_blocks=n_blocks, num_stages_total=nodes)))
    survivors = draw(st.integers(1, nodes))
    new = plan_from_layout(**draw(layout_args(tp=tp, n_blocks=n_blocks,
                                              num_stages_total=survivors)))
    names = [f"node{i}" for i in range(nodes)]
    chosen = draw(st.permutations(names))[:survivors]
    new = relabel(new, {f"node{i}": chosen[i] for i in range(survivors)})
    return old, new


@settings(max_examples=80, deadline=None)
@given(plan_pairs())
def test_transfers_property(pair):
    old, new = pair
    result = check_transfer_contract(old, new)
    if set(new.rank_of_worker()) == set(old.rank_of_worker()):
        assert missing_layers(old, new) == []
    # sources are balanced per shard: a source is only chosen when no other live holder
    # of that shard had sent fewer so far
    load: Counter = Counter()
    alive = set(new.rank_of_worker())
    old_h = holders(old)
    for t in result:
        candidates = [w for w in old_h[(t.layer, t.tp_rank)] if w in alive]
        assert load[t.src] == min(load[w] for w in candidates)
        load[t.src] += 1
