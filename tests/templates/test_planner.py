"""The planner (planaria.templates.planner): the instantiation of a job's templates into
a valid Plan for N nodes (over fewer nodes, with the others named, when no set of
pipelines uses them all), against brute force on small instances, with property tests
over random layer costs, memory limits, f and N; and bad input refused.

Which templates exist: `test_job_templates.py`. Regression tests reproducing bugs these
tests once found: `test_planner_regressions.py`.
"""
from __future__ import annotations

import math
from itertools import combinations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planaria.templates.analytic import hardware
from planaria.templates.costs import LayerCost
from planaria.templates.job_templates import PlannerSettings
from planaria.templates.partition_cost import (
    InfeasiblePartition,
    in_flight_microbatches,
    pipeline_iteration_time,
)
from planaria.templates.planner import Planner
from tests.templates.planner_cases import (
    check_plan,
    cost_model,
    instances,
    memory_limited,
    uniform,
)

PROPERTY = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# --- property tests ------------------------------------------------------------------


@PROPERTY
@given(instance=instances(), data=st.data())
def test_every_node_count_gets_a_valid_plan(instance, data):
    costs, f, total = instance
    micro = data.draw(st.integers(1, 3))
    planner = Planner(costs, PlannerSettings(fault_tolerance=f, global_batch=total * micro,
                                             micro_batch=micro))
    n0 = planner.n0
    assert 1 <= n0 <= 4
    # n0..2n0-1, then deeper sizes, each with a smaller largest stage than all before it
    deeper = planner.standing_sizes[n0:]
    assert planner.standing_sizes[:n0] == list(range(n0, 2 * n0))
    assert sorted(planner.templates) == planner.standing_sizes
    assert all(2 * n0 <= s <= 4 * n0 - 1 for s in deeper)
    grads = [min(planner._gradient_bytes(s) for s in range(n0, 2 * n0))]
    grads += [planner._gradient_bytes(s) for s in deeper]
    assert all(a > b for a, b in zip(grads, grads[1:]))
    full = (f + 1) * n0
    for num_nodes in range(n0, full + 13):
        ids = [f"host-{num_nodes}-{i}" for i in range(num_nodes)]
        choice = planner.instantiate(num_nodes, ids)
        check_plan(planner, choice, num_nodes, ids)
        assert all(len(p.stages) in planner.standing_sizes for p in choice.plan.pipelines)
        if num_nodes >= full:
            assert not choice.degraded
            assert len(choice.plan.pipelines) >= f + 1
        else:
            assert choice.degraded
            assert len(choice.plan.pipelines) == num_nodes // n0 >= 1
    with pytest.raises(ValueError, match=f"n0={n0}"):
        planner.instantiate(n0 - 1) if n0 > 1 else planner.instantiate(0)


def largest_packable(sizes, num_nodes, least, most):
    """The most nodes, up to num_nodes, that some multiset of `sizes` (between `least`
    and `most` of them) sums to exactly; 0 if none."""
    reach = {(0, 0)}  # (nodes, pipelines)
    for _ in range(most):
        reach |= {(n + s, k + 1) for n, k in reach for s in sizes if n + s <= num_nodes}
    return max((n for n, k in reach if k >= least), default=0)


@PROPERTY
@given(instance=memory_limited())
def test_every_node_count_gets_a_plan_on_all_nodes_or_names_the_idle_ones(instance):
    """Never an exception from N = (f+1)·n0 up: a plan on every node, or a plan over as
    many nodes as any set of templates fills, with the others named and the reason given."""
    costs, f, total, schedule = instance
    planner = Planner(costs, PlannerSettings(fault_tolerance=f, global_batch=total, micro_batch=1,
                                             schedule=schedule))
    n0 = planner.n0
    covered = 2 * n0 - 1 <= costs.num_layers and all(planner._feasible(s) for s in range(n0, 2 * n0))
    for num_nodes in range((f + 1) * n0, (f + 1) * n0 + 10):
        ids = [f"host-{i}" for i in range(num_nodes)]
        choice = planner.instantiate(num_nodes, ids)
        used = choice.plan.nodes()
        check_plan(planner, choice, len(used), used)
        assert sorted(used + list(choice.idle_nodes)) == sorted(ids)
        assert bool(choice.idle_nodes) == bool(choice.idle_reason)
        want = min(f + 1, num_nodes // n0)
        assert len(used) == largest_packable(planner._sizes_for(num_nodes), num_nodes, want, total)
        if len(used) >= (f + 1) * n0:
            assert not choice.degraded and len(choice.plan.pipelines) >= f + 1
        if covered and num_nodes <= total * (2 * n0 - 1):  # the docstring's guarantee
            assert not choice.idle_nodes, (num_nodes, choice.idle_reason)


def test_no_template_deeper_than_n0_fits_eight_nodes_train_on_six():
    """The issue's case: n0 = 3, f = 1, and a heavy first layer under a memory limit that
    only a 3-stage pipeline meets (stage 0, the first layer alone, holds 3 microbatches of
    its activations in a 3-stage 1F1B pipeline, 4 in a 4-stage one). 8 nodes: two
    pipelines of 3, and 2 nodes idle, named."""
    first = LayerCost(1 / 3, 2 / 3, state_bytes=10, activation_bytes=10, output_bytes=0)
    block = LayerCost(1 / 3, 2 / 3, state_bytes=10, activation_bytes=0, output_bytes=0)
    costs = cost_model([first] + [block] * 8, memory=40)
    planner = Planner(costs, PlannerSettings(fault_tolerance=1, global_batch=16, micro_batch=1))
    assert planner.n0 == 3 and planner.standing_sizes == [3]
    nodes = [f"node{i}" for i in range(8)]
    choice = planner.instantiate(8, nodes)
    assert [len(p.stages) for p in choice.plan.pipelines] == [3, 3]
    assert choice.idle_nodes == ("node6", "node7") and not choice.degraded
    assert "no set of pipelines uses all 8 nodes" in choice.idle_reason
    assert "[3]" in choice.idle_reason
    # After a failure the survivors keep their stages; the idle nodes are the ones holding least.
    survivors = [n for n in nodes if n != "node1"]
    again = planner.instantiate(7, survivors, current=choice.plan)
    assert len(again.idle_nodes) == 1 and len(again.plan.pipelines) == 2


def brute_force_best(planner, num_nodes):
    """min over multisets of the planner's template sizes summing to N (at least
    min(f+1, N//n0) of them) and integer splits (each ≥ 1) of max_p T_p(m_p)."""
    n0, f = planner.n0, planner.settings.fault_tolerance
    total = planner.settings.total_microbatches
    sizes = planner._sizes_for(num_nodes)
    least = min(f + 1, num_nodes // n0)
    best = math.inf

    def multisets(left, smallest):
        if left == 0:
            yield ()
        for s in sizes:
            if smallest <= s <= left:
                for rest in multisets(left - s, s):
                    yield (s, *rest)

    for chosen in multisets(num_nodes, n0):
        k = len(chosen)
        if not least <= k <= total:
            continue
        for cuts in combinations(range(1, total), k - 1):
            counts = [b - a for a, b in zip((0, *cuts), (*cuts, total))]
            best = min(best, max(planner.template(s).iteration_time(m)
                                 for s, m in zip(chosen, counts)))
    return best


def brute_force_partition(costs, stages, microbatches, schedule="1f1b"):
    """Best iteration time over every cut into `stages` stages that fits in memory."""
    best = math.inf
    for inner in combinations(range(1, costs.num_layers), stages - 1):
        bounds = (0, *inner, costs.num_layers)
        ranges = list(zip(bounds, bounds[1:]))
        peaks = [costs.state_bytes(a, b) + costs.activation_bytes(a, b)
                 * in_flight_microbatches(schedule, s, stages, microbatches)
                 for s, (a, b) in enumerate(ranges)]
        if max(peaks) > costs.hardware.device_memory_bytes:
            continue
        best = min(best, pipeline_iteration_time(
            [costs.compute_time(a, b) for a, b in ranges],
            [costs.send_time(b - 1) for b in bounds[1:-1]], microbatches, schedule))
    return best


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(instance=instances(min_layers=3, max_layers=6, min_n0=2, max_n0=3,
                          totals=st.integers(1, 8),
                          max_activation_share=16))
def test_partition_and_instantiation_equal_brute_force(instance):
    costs, f, total = instance
    assume(f + 1 <= total)
    planner = Planner(costs, PlannerSettings(fault_tolerance=f, global_batch=total, micro_batch=1))
    n0 = planner.n0
    reference = total
    for size, template in planner.templates.items():
        expected = brute_force_partition(costs, size, reference)
        assert template.iteration_time(reference) == pytest.approx(expected, rel=1e-12)
    # N//n0 ≤ total keeps clear of the short-batch bugs reproduced below.
    top = min(8, total * n0 + n0 - 1)
    for num_nodes in range(n0, top + 1):
        choice = planner.instantiate(num_nodes)
        check_plan(planner, choice, num_nodes, [f"node{i}" for i in range(num_nodes)])
        best = brute_force_best(planner, num_nodes)
        assert max(choice.pipeline_times_s) == pytest.approx(best, rel=1e-12), num_nodes


# --- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(fault_tolerance=0, global_batch=0, micro_batch=1), "global_batch"),
    (dict(fault_tolerance=0, global_batch=-4, micro_batch=1), "global_batch"),
    (dict(fault_tolerance=0, global_batch=8, micro_batch=0), "micro_batch"),
    (dict(fault_tolerance=0, global_batch=8, micro_batch=-2), "micro_batch"),
    (dict(fault_tolerance=-1, global_batch=8, micro_batch=1), "fault tolerance"),
    (dict(fault_tolerance=0, global_batch=10, micro_batch=4), "multiple"),
    (dict(fault_tolerance=0, global_batch=8, micro_batch=1, min_stages=0), "min_stages"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlannerSettings(**kwargs)


def test_too_few_nodes_names_n0():
    planner = Planner(uniform(12, memory=40, state=10, act=0),
                      PlannerSettings(fault_tolerance=0, global_batch=8, micro_batch=1))
    assert planner.n0 == 3
    for n in (0, 1, 2):
        with pytest.raises(ValueError, match="n0=3"):
            planner.instantiate(n)


def test_large_f_degrades_and_too_few_microbatches_are_refused():
    planner = Planner(uniform(12, memory=40, state=10, act=0),
                      PlannerSettings(fault_tolerance=5, global_batch=64, micro_batch=1))
    choice = planner.instantiate(7)  # room for 2 of the f+1 = 6 pipelines
    assert choice.degraded and choice.replicas == 2
    with pytest.raises(ValueError, match="n0=3"):
        planner.instantiate(2)
    short = Planner(uniform(12, memory=40, state=10, act=0),
                    PlannerSettings(fault_tolerance=5, global_batch=3, micro_batch=1))
    with pytest.raises(ValueError, match="microbatches"):
        short.instantiate(18)  # 6 pipelines of 3 nodes, 3 microbatches


def test_node_ids_must_match_the_node_count():
    planner = Planner(uniform(6, memory=10**9, state=10, act=1),
                      PlannerSettings(fault_tolerance=0, global_batch=8, micro_batch=1))
    with pytest.raises(ValueError, match="distinct node ids"):
        planner.instantiate(2, ["a", "a"])
    with pytest.raises(ValueError, match="distinct node ids"):
        planner.instantiate(3, ["a", "b"])


def test_model_that_fits_nowhere_is_refused_with_bytes_and_the_fix():
    # One layer alone needs 100 bytes; the device has 50.
    with pytest.raises(InfeasiblePartition) as info:
        Planner(uniform(5, memory=50, state=100, act=0),
                PlannerSettings(fault_tolerance=0, global_batch=8, micro_batch=1))
    message = str(info.value)
    assert "one layer per stage" in message and "bytes" in message
    assert "tensor parallelism" in message and "recomputation" in message
    assert info.value.shortfall_bytes == 50


def test_unknown_hardware_name():
    with pytest.raises(ValueError, match="unknown hardware 'tpu9'.*h100"):
        hardware("tpu9")
