"""The job's templates (planaria.templates.job_templates): sizes n0..2n0-1, the deeper
ones that can win, `parallel.min_stages`, and a 175B model on H100s."""
from __future__ import annotations

import pytest

from planaria.templates.analytic import analytic_cost_model, hardware
from planaria.templates.costs import LayerCost, ModelShape
from planaria.templates.job_templates import PlannerSettings
from planaria.templates.planner import Planner
from tests.templates.planner_cases import check_plan, cost_model, uniform


# --- templates -----------------------------------------------------------------------


def test_template_sizes_are_n0_to_2n0_minus_1_when_the_batch_is_large():
    # 12 layers of 10 bytes; 40 bytes per device: n0 = 3.
    costs = uniform(12, memory=40, state=10, act=0)
    planner = Planner(costs, PlannerSettings(fault_tolerance=1, global_batch=256, micro_batch=2))
    assert planner.n0 == 3
    assert sorted(planner.templates) == [3, 4, 5]
    for n in (3, 5, 6, 7, 11, 20, 41):
        choice = planner.instantiate(n)
        assert {len(p.stages) for p in choice.plan.pipelines} <= {3, 4, 5}
    assert sorted(planner.templates) == [3, 4, 5]  # nothing built on demand


def test_deeper_templates_are_built_and_win_when_the_gradient_sync_dominates():
    """12 layers of 1,000 bytes on 4,000-byte devices: n0 = 3. Over a 10 B/s network the
    sync of a 4-layer stage's gradients takes 200 s a step, far more than its compute:
    6-stage pipelines (2 layers a stage) halve it. Sizes 7 to 11 also have 2-layer
    stages, so they cannot sync less and are not built."""
    layers = [LayerCost(1 / 3, 2 / 3, state_bytes=1000, activation_bytes=0, output_bytes=0)] * 12
    costs = cost_model(layers, memory=4000, inter_node_bandwidth=10)
    capped = Planner(costs, PlannerSettings(fault_tolerance=1, global_batch=64, micro_batch=1, depth=2))
    deeper = Planner(costs, PlannerSettings(fault_tolerance=1, global_batch=64, micro_batch=1))
    assert capped.standing_sizes == [3, 4, 5] and deeper.standing_sizes == [3, 4, 5, 6]
    nodes = [f"node{i}" for i in range(12)]
    slow, fast = capped.instantiate(12, nodes), deeper.instantiate(12, nodes)
    check_plan(deeper, fast, 12, nodes)
    assert [len(p.stages) for p in fast.plan.pipelines] == [6, 6]
    assert fast.iteration_time_s < 0.8 * slow.iteration_time_s
    # Where the sync is negligible (1 GB/s), no deeper template is built.
    quick = Planner(cost_model(layers, memory=4000), PlannerSettings(1, 64, 1))
    assert quick.standing_sizes == [3, 4, 5]


def test_template_depth_below_2_is_refused():
    with pytest.raises(ValueError, match="depth must be at least 2"):
        PlannerSettings(fault_tolerance=0, global_batch=8, micro_batch=1, depth=1)


def test_min_stages_sets_the_smallest_template():
    costs = uniform(10, memory=10**9, state=10, act=1)
    planner = Planner(costs, PlannerSettings(fault_tolerance=0, global_batch=64, micro_batch=1,
                                             min_stages=2))
    assert planner.n0 == 2
    assert sorted(planner.templates) == [2, 3]


def test_gpt3_175b_on_h100():
    costs = analytic_cost_model(ModelShape(96, 12288, 96, 51200, 2048), hardware("h100"),
                                tp=8, micro_batch=1, dtype="bfloat16", recompute=True)
    planner = Planner(costs, PlannerSettings(fault_tolerance=2, global_batch=1536, micro_batch=1))
    assert 1 <= planner.n0 <= 6
    for num_nodes in (18, 37, 64, 1024):
        ids = [f"h100-{i:04d}" for i in range(num_nodes)]
        choice = planner.instantiate(num_nodes, ids)
        check_plan(planner, choice, num_nodes, ids)
        assert not choice.degraded and len(choice.plan.pipelines) >= 3
        assert choice.plan.world_size == 8 * num_nodes
        assert choice.planning_time_s >= 0
