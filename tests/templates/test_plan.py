"""The plan contract: exact JSON round trip, derived views, and validation that names the
problem. (`transfers` / `missing_layers`, when a job moves from one plan to the next:
`test_plan_transfers.py`.)"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings

from planaria.templates.layout import plan_from_layout
from planaria.templates.plan import (
    PipelinePlan,
    Plan,
    PlanError,
    StagePlan,
)
from tests.templates.plan_cases import good_plan, layout_args

FAST = settings(max_examples=60, deadline=None)


def all_ranks(plan: Plan) -> list[int]:
    return [r for p in plan.pipelines for s in p.stages for r in s.ranks]


def replace_stage(plan: Plan, p: int, s: int, **changes) -> Plan:
    pipelines = list(plan.pipelines)
    stages = list(pipelines[p].stages)
    stages[s] = replace(stages[s], **changes)
    pipelines[p] = replace(pipelines[p], stages=tuple(stages))
    return replace(plan, pipelines=tuple(pipelines))


# ---------------------------------------------------------------- 1. JSON round trip
@FAST
@given(layout_args())
def test_json_round_trip_is_exact(args):
    plan = plan_from_layout(**args)
    text = plan.to_json()
    back = Plan.from_json(text)
    assert back == plan
    assert back.to_json() == text
    assert Plan.from_json(plan.to_json(indent=2)) == plan
    # the derived views survive too (they are rebuilt, not stored)
    assert back.world_size == plan.world_size
    assert back.replica_groups() == plan.replica_groups()
    assert [back.rank_info(r) for r in range(back.world_size)] == [
        plan.rank_info(r) for r in range(plan.world_size)
    ]
    assert "_rank_index" not in json.loads(text)


def test_from_dict_names_the_missing_field():
    data = good_plan().to_dict()
    for name in ("epoch", "micro_batch", "schedule", "pipelines"):
        broken = dict(data)
        del broken[name]
        with pytest.raises(ValueError, match=name):
            Plan.from_dict(broken)
    broken = json.loads(good_plan().to_json())
    del broken["pipelines"][1]["stages"][0]["chunks"]
    with pytest.raises(ValueError, match="chunks"):
        Plan.from_dict(broken)


def test_from_json_validates():
    data = json.loads(good_plan().to_json())
    data["pipelines"][0]["num_microbatches"] = 3
    with pytest.raises(PlanError, match="add up to"):
        Plan.from_json(json.dumps(data))


def test_ranks_out_of_order_within_a_pipeline_are_refused():
    """The runtime maps stage s to the s-th rank of its (ordered) group; a stored plan with
    swapped stages validated, then crashed the pipeline runtime."""
    for swap in ("stages", "tp ranks"):
        data = json.loads(good_plan().to_json())
        stages = data["pipelines"][0]["stages"]
        if swap == "stages":
            stages[0]["ranks"], stages[1]["ranks"] = stages[1]["ranks"], stages[0]["ranks"]
        else:
            stages[0]["ranks"] = stages[0]["ranks"][::-1]
        with pytest.raises(PlanError, match="ranks must increase from stage to stage"):
            Plan.from_json(json.dumps(data))


# ---------------------------------------------------------------- 2. derived views
@FAST
@given(layout_args())
def test_derived_views(args):
    plan = plan_from_layout(**args)
    ranks = all_ranks(plan)
    n_stages = sum(len(p.stages) for p in plan.pipelines)
    assert plan.world_size == n_stages * plan.tp
    assert sorted(ranks) == list(range(plan.world_size))
    assert plan.num_layers == args["n_blocks"] + 2
    assert plan.total_microbatches == args["global_batch"] // args["micro_batch"]

    # every rank has exactly one place, and it is where the pipelines put it
    for p, pipeline in enumerate(plan.pipelines):
        for s, stage in enumerate(pipeline.stages):
            for t, rank in enumerate(stage.ranks):
                info = plan.rank_info(rank)
                assert (info.pipeline, info.stage, info.tp_rank, info.node) == (p, s, t, stage.node)
                assert plan.stage_of(rank) == stage
                assert plan.worker(rank) == (stage.node, t)
    assert len(plan.rank_of_worker()) == plan.world_size
    with pytest.raises(ValueError, match=f"rank {plan.world_size} is not in the plan"):
        plan.rank_info(plan.world_size)

    # every (layer, tp rank) shard has one replica per pipeline, on that tp rank
    groups = plan.replica_groups()
    assert set(groups) == {(layer, t) for layer in range(plan.num_layers) for t in range(plan.tp)}
    for (layer, t), group in groups.items():
        infos = [plan.rank_info(r) for r in group]
        assert sorted(i.pipeline for i in infos) == list(range(len(plan.pipelines)))
        assert all(i.tp_rank == t for i in infos)
        assert all(layer in plan.layers_of(r) for r in group)

    # pipeline groups: one per (pipeline, tp rank), stages in order; their layers partition
    pgroups = plan.pipeline_groups()
    assert len(pgroups) == len(plan.pipelines) * plan.tp
    assert sorted(r for g in pgroups for r in g) == list(range(plan.world_size))
    for group in pgroups:
        infos = [plan.rank_info(r) for r in group]
        assert len({i.pipeline for i in infos}) == 1
        assert len({i.tp_rank for i in infos}) == 1
        assert [i.stage for i in infos] == list(range(len(group)))
        layers = [layer for r in group for layer in plan.layers_of(r)]
        assert sorted(layers) == list(range(plan.num_layers))

    # each pipeline's model stages run through the layers in order
    for pipeline in plan.pipelines:
        model = pipeline.model_stages(plan.virtual_stages)
        assert model[0][0] == 0 and model[-1][1] == plan.num_layers
        assert all(a[1] == b[0] for a, b in zip(model, model[1:]))

    # consecutive, non-overlapping batch slices
    offset = 0
    for pipeline in plan.pipelines:
        assert pipeline.sample_offset == offset
        offset += pipeline.num_microbatches * plan.micro_batch
    assert offset == plan.global_batch

    tp_groups = plan.tensor_parallel_groups()
    assert sorted(r for g in tp_groups for r in g) == list(range(plan.world_size))
    assert all(len(g) == plan.tp for g in tp_groups)


def test_layout_places_embedding_and_head_and_interleaves():
    plan = plan_from_layout([[1, 2, 3, 4]], n_blocks=10, tp=1, schedule="interleaved",
                            virtual_stages=2, global_batch=4, micro_batch=1)
    # 2 stages, model stage j on stage j % 2; embedding with the first, head with the last
    assert [s.chunks for s in plan.pipelines[0].stages] == [((0, 2), (4, 7)), ((2, 4), (7, 12))]
    assert plan.layers_of(0) == [0, 1, 4, 5, 6]
    assert plan.layers_of(1) == [2, 3, 7, 8, 9, 10, 11]
    assert [s.node for s in plan.pipelines[0].stages] == ["node0", "node1"]


# ---------------------------------------------------------------- 3. validation
def _pipeline_chunks(plan: Plan, p: int, chunks: list[tuple]) -> Plan:
    for s, c in enumerate(chunks):
        plan = replace_stage(plan, p, s, chunks=c)
    return plan


def test_a_good_plan_is_accepted():
    plan = good_plan()
    assert replace(plan, epoch=3) == replace(plan, epoch=3)
    assert replace(plan, schedule="gpipe").schedule == "gpipe"


@pytest.mark.parametrize("make, pattern", [
    pytest.param(lambda p: _pipeline_chunks(p, 1, [((0, 2),), ((3, 6),)]),
                 r"pipeline 1: model stage 1 covers layers \[3, 6\).*every layer must appear exactly once",
                 id="layer-missing-in-the-middle"),
    pytest.param(lambda p: _pipeline_chunks(p, 0, [((0, 3),), ((3, 5),)]),
                 r"pipeline 0 covers layers \[0, 5\) but the model has 6 layers",
                 id="last-layer-missing"),
    pytest.param(lambda p: _pipeline_chunks(p, 1, [((0, 3),), ((2, 6),)]),
                 r"pipeline 1: model stage 1 covers layers \[2, 6\).*exactly once",
                 id="layer-twice"),
    pytest.param(lambda p: _pipeline_chunks(p, 0, [((0, 3),), ((3, 7),)]),
                 r"pipeline 0 covers layers \[0, 7\) but the model has 6 layers",
                 id="layer-beyond-the-model"),
    pytest.param(lambda p: _pipeline_chunks(p, 0, [((0, 3),), ((3, 3),), ]),
                 r"model stage 1 covers layers \[3, 3\).*non-empty",
                 id="empty-stage"),
    pytest.param(lambda p: replace(p, pipelines=(replace(p.pipelines[0], num_microbatches=1),
                                                 p.pipelines[1])),
                 r"microbatches \[1, 2\] add up to 3, but global_batch 8 / micro_batch 2 = 4",
                 id="microbatches-do-not-add-up"),
    pytest.param(lambda p: replace(p, global_batch=16),
                 r"add up to 4, but global_batch 16 / micro_batch 2 = 8",
                 id="global-batch-changed"),
    pytest.param(lambda p: replace(p, global_batch=7),
                 r"global_batch 7 is not a multiple of micro_batch 2",
                 id="batch-not-multiple"),
    pytest.param(lambda p: replace(p, pipelines=(replace(p.pipelines[0], num_microbatches=0),
                                                 replace(p.pipelines[1], num_microbatches=4))),
                 r"at least one microbatch",
                 id="pipeline-without-microbatches"),
    pytest.param(lambda p: replace_stage(p, 1, 1, ranks=(2, 3)),
                 r"ranks must be 0\.\.7, each used once.*repeated: \[2, 3\]",
                 id="rank-used-twice"),
    pytest.param(lambda p: relabel_ranks(p, lambda r: r + 1),
                 r"ranks must be 0\.\.7, each used once; got \[1, 2, 3, 4, 5, 6, 7, 8\]$",
                 id="ranks-not-from-zero"),
    pytest.param(lambda p: replace_stage(p, 0, 1, ranks=(2,)),
                 r"pipeline 0 stage 1 has 1 ranks, but tp=2",
                 id="too-few-ranks-for-tp"),
    pytest.param(lambda p: replace(p, tp=1),
                 r"pipeline 0 stage 0 has 2 ranks, but tp=1",
                 id="too-many-ranks-for-tp"),
    pytest.param(lambda p: replace_stage(p, 0, 0, chunks=((0, 1), (1, 3))),
                 r"pipeline 0 stage 0 has 2 chunks, but virtual_stages=1",
                 id="chunks-vs-virtual-stages"),
    pytest.param(lambda p: replace(p, schedule="interleaved", virtual_stages=2),
                 r"has 1 chunks, but virtual_stages=2",
                 id="virtual-stages-without-chunks"),
    pytest.param(lambda p: replace(p, virtual_stages=2),
                 r"virtual_stages=2 needs schedule 'interleaved', not '1f1b'",
                 id="virtual-stages-with-1f1b"),
    pytest.param(lambda p: replace(p, schedule="zero-bubble"),
                 r"schedule 'zero-bubble' is unknown",
                 id="unknown-schedule"),
    pytest.param(lambda p: replace(p, pipelines=(p.pipelines[0],
                                                 replace(p.pipelines[1], sample_offset=2))),
                 r"pipeline 1 starts at sample 2, expected 4",
                 id="wrong-sample-offset"),
    pytest.param(lambda p: replace(p, pipelines=(replace(p.pipelines[0], sample_offset=1),
                                                 p.pipelines[1])),
                 r"pipeline 0 starts at sample 1, expected 0",
                 id="first-sample-offset-not-zero"),
    pytest.param(lambda p: replace_stage(p, 1, 0, node="node0"),
                 r"pipeline 1 stage 0: node 'node0' is used by more than one stage",
                 id="node-in-two-pipelines"),
    pytest.param(lambda p: replace_stage(p, 0, 1, node="node0"),
                 r"pipeline 0 stage 1: node 'node0' is used by more than one stage",
                 id="node-twice-in-one-pipeline"),
    pytest.param(lambda p: replace(p, pipelines=()),
                 r"at least one pipeline", id="no-pipelines"),
    pytest.param(lambda p: replace(p, pipelines=(replace(p.pipelines[0], stages=(),
                                                         num_microbatches=4),)),
                 r"pipeline 0 has no stages", id="pipeline-without-stages"),
    pytest.param(lambda p: replace(p, micro_batch=0), r"micro_batch must be at least 1",
                 id="zero-micro-batch"),
    pytest.param(lambda p: replace(p, tp=0), r"tp must be at least 1", id="zero-tp"),
    pytest.param(lambda p: replace(p, epoch=-1), r"must not be negative", id="negative-epoch"),
])
def test_invalid_plans_are_refused_with_a_reason(make, pattern):
    with pytest.raises(PlanError, match=pattern) as err:
        make(good_plan())
    assert isinstance(err.value, ValueError)


def relabel_ranks(plan: Plan, f) -> Plan:
    return replace(plan, pipelines=tuple(
        replace(p, stages=tuple(replace(s, ranks=tuple(f(r) for r in s.ranks)) for s in p.stages))
        for p in plan.pipelines
    ))


def test_plan_can_be_built_directly():
    plan = Plan(
        epoch=1, first_iteration=10, num_layers=3, tp=1, schedule="gpipe", virtual_stages=1,
        global_batch=2, micro_batch=1,
        pipelines=(PipelinePlan("t", (StagePlan("a", (1,), ((0, 3),)),), 1, 0),
                   PipelinePlan("t", (StagePlan("b", (0,), ((0, 3),)),), 1, 1)),
    )
    assert plan.rank_info(0).node == "b" and plan.rank_info(1).node == "a"
    assert plan.replica_groups() == {(0, 0): (0, 1), (1, 0): (0, 1), (2, 0): (0, 1)}


def test_plans_are_frozen():
    plan = good_plan()
    with pytest.raises(AttributeError):
        plan.epoch = 2  # type: ignore[misc]


def test_plan_from_layout_names_the_layout_problem():
    args = dict(n_blocks=4, tp=1, schedule="1f1b", virtual_stages=1, global_batch=4, micro_batch=1)
    with pytest.raises(ValueError, match=r"pipeline 1 is \[2, 1\].*adds up to 3.*model\.n_layers = 4"):
        plan_from_layout([[2, 2], [2, 1]], **args)
    with pytest.raises(ValueError, match=r"parallel\.microbatches has 3 entries but "
                                         r"the job has 2 pipeline\(s\)"):
        plan_from_layout([[2, 2], [4]], microbatches=[1, 1, 2], **args)
    with pytest.raises(PlanError, match=r"add up to 2, but global_batch 4 / micro_batch 1 = 4"):
        plan_from_layout([[2, 2], [4]], microbatches=[1, 1], **args)
    with pytest.raises(ValueError, match=r"4 microbatches cannot feed 5 pipelines"):
        plan_from_layout([[4]] * 5, **args)
    with pytest.raises(ValueError, match=r"positive whole number"):
        plan_from_layout([[4, 0]], **args)
    with pytest.raises(ValueError, match=r"3 model stages, not a multiple of "
                                         r"parallel\.virtual_stages = 2"):
        plan_from_layout([[1, 1, 2]], **{**args, "virtual_stages": 2, "schedule": "interleaved"})
    with pytest.raises(ValueError, match=r"at least one pipeline"):
        plan_from_layout([], **args)
    with pytest.raises(PlanError, match=r"needs schedule 'interleaved'"):
        plan_from_layout([[1, 3]], **{**args, "virtual_stages": 2})
