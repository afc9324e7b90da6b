"""The planner's regression tests: each reproduces a bug the planner's tests once found."""
from __future__ import annotations

import re

import pytest

from planaria.templates.job_templates import PlannerSettings
from planaria.templates.partition_cost import evaluate_partition
from planaria.templates.planner import Planner
from tests.templates.planner_cases import check_plan, true_peaks, uniform


def test_never_more_pipelines_than_microbatches():
    planner = Planner(uniform(6, memory=30, state=10, act=0),
                      PlannerSettings(fault_tolerance=0, global_batch=2, micro_batch=1))
    assert planner.n0 == 2
    choice = planner.instantiate(6)
    assert choice.plan.total_microbatches == 2


def test_short_batch_keeps_sizes_below_ceil_n_over_total():
    planner = Planner(uniform(12, memory=10**9, state=10, act=0),
                      PlannerSettings(fault_tolerance=1, global_batch=2, micro_batch=1))
    assert planner.n0 == 1
    choice = planner.instantiate(11)
    assert sorted(len(p.stages) for p in choice.plan.pipelines) == [5, 6]


def test_short_batch_skips_templates_larger_than_the_model():
    planner = Planner(uniform(6, memory=10**9, state=10, act=0),
                      PlannerSettings(fault_tolerance=0, global_batch=2, micro_batch=1))
    choice = planner.instantiate(8)
    assert sorted(len(p.stages) for p in choice.plan.pipelines) == [4, 4]


def test_templates_up_to_2n0_fit_when_n0_does():
    planner = Planner(uniform(3, memory=200, state=0, act=100),
                      PlannerSettings(fault_tolerance=0, global_batch=8, micro_batch=1))
    assert planner.n0 == 2
    check_plan(planner, planner.instantiate(2), 2, ["node0", "node1"])


@pytest.mark.parametrize("costs, cfg, num_nodes", [
    # 1f1b, degraded: f=1, 2 microbatches -> templates for m=1; N=2 -> one 2-stage
    # pipeline with m=2; stage 0 (3 layers of 100 bytes) holds 2 -> 600 > 300 bytes.
    (uniform(4, memory=300, state=0, act=100), PlannerSettings(1, 2, 1), 2),
    # gpipe, not degraded: f=1, 5 microbatches -> templates for m=2; split [3, 2]; the
    # first pipeline (one stage of 3 layers) holds 3 microbatches: 30 bytes of state
    # + 3 x 3 bytes of activations = 39 > 36 bytes (the template's m=2 peak is 36).
    (uniform(3, memory=36, state=10, act=1), PlannerSettings(1, 5, 1, schedule="gpipe"), 2),
])
def test_plans_fit_in_memory_for_the_microbatches_they_run(costs, cfg, num_nodes):
    planner = Planner(costs, cfg)
    choice = planner.instantiate(num_nodes)
    assert max(true_peaks(costs, choice.plan, cfg.schedule)) <= costs.hardware.device_memory_bytes


def interleaved_peaks(costs, plan):
    """Per pipeline, its largest stage peak for the microbatches it actually runs."""
    return [max(evaluate_partition(costs, p.model_stages(plan.virtual_stages), len(p.stages),
                                   num_microbatches=p.num_microbatches, schedule=plan.schedule,
                                   virtual_stages=plan.virtual_stages).peak_memory_bytes)
            for p in plan.pipelines]


def test_interleaved_plans_exist_for_every_node_count_and_fit_in_memory():
    """Interleaved pipelines run their microbatches in rounds of equal size, so only some
    counts suit a pipeline. Splitting the batch greedily found no split for 7 nodes here
    (and for most counts of a 175B job) where one exists; and a template checked at the
    whole batch held more activations when given a share of 2S - 1 microbatches (one
    round of 2S - 1, the largest round there is)."""
    costs = uniform(12, memory=10**6, state=2, act=1)
    planner = Planner(costs, PlannerSettings(fault_tolerance=2, global_batch=64, micro_batch=1,
                                             schedule="interleaved", virtual_stages=2))
    for n in range(planner.n0, 13):
        choice = planner.instantiate(n)
        check_plan(planner, choice, n, [f"node{i}" for i in range(n)])
        assert max(interleaved_peaks(costs, choice.plan)) <= costs.hardware.device_memory_bytes, n
    memory_limited = uniform(9, memory=20, state=2, act=1)
    planner = Planner(memory_limited, PlannerSettings(fault_tolerance=0, global_batch=8, micro_batch=1,
                                                      schedule="interleaved", virtual_stages=2))
    for n in range(planner.n0, 9):
        plan = planner.instantiate(n).plan
        assert max(interleaved_peaks(memory_limited, plan)) <= 20, (n, plan.pipelines)


def test_interleaved_split_minimises_the_slowest_pipeline_among_accepted_counts():
    costs = uniform(12, memory=10**6, state=2, act=1)
    planner = Planner(costs, PlannerSettings(fault_tolerance=2, global_batch=64, micro_batch=1,
                                             schedule="interleaved", virtual_stages=2))
    sizes = [3, 2, 2]
    counts = planner._split(sizes)
    accepted = [[m for m in range(1, 65) if planner._schedulable(s, m)] for s in sizes]
    best = min(max(planner.template(s).iteration_time(m) for s, m in zip(sizes, ms))
               for ms in ((a, b, 64 - a - b) for a in accepted[0] for b in accepted[1])
               if ms[2] in accepted[2])
    assert sum(counts) == 64 and all(m in a for m, a in zip(counts, accepted))
    assert max(planner.template(s).iteration_time(m) for s, m in zip(sizes, counts)) == best


def test_replanning_onto_entirely_new_nodes():
    planner = Planner(uniform(6, memory=10**6, state=2, act=1), PlannerSettings(1, 8, 1))
    current = planner.instantiate(4, node_ids=["a", "b", "c", "d"]).plan
    choice = planner.instantiate(4, node_ids=["e", "f", "g", "h"], current=current)  # IndexError once
    check_plan(planner, choice, 4, ["e", "f", "g", "h"])


def test_more_nodes_than_the_batch_can_use_leave_the_rest_idle_and_say_to_raise_the_batch():
    planner = Planner(uniform(6, memory=10**6, state=2, act=1), PlannerSettings(0, 4, 1))
    nodes = [f"node{i:02d}" for i in range(30)]
    choice = planner.instantiate(30, nodes)
    assert len(choice.plan.nodes()) == 4 * 6  # 4 microbatches: 4 pipelines of all 6 layers
    assert choice.idle_nodes == tuple(nodes[24:])
    assert re.search("more than this job can use.*raise train.global_batch", choice.idle_reason)


def test_interleaved_pipeline_sizes_are_chosen_by_the_split_the_schedule_accepts():
    """On 6 nodes, two 3-stage pipelines look fastest if any count ran, but 64 microbatches
    only split 60/4 over them in equal rounds; three 2-stage pipelines (22/22/20) are
    faster, and are chosen."""
    costs = uniform(12, memory=60, state=10, act=0)  # n0 = 2
    planner = Planner(costs, PlannerSettings(fault_tolerance=1, global_batch=64, micro_batch=1,
                                             schedule="interleaved", virtual_stages=2))
    nodes = [f"node{i}" for i in range(6)]
    two_deep = planner._evaluate([3, 3], nodes, None, 0, 0)
    assert [p.num_microbatches for p in two_deep.plan.pipelines] == [60, 4]
    choice = planner.instantiate(6)
    assert choice.iteration_time_s < two_deep.iteration_time_s
    assert sorted(len(p.stages) for p in choice.plan.pipelines) == [2, 2, 2]
    # One 3-stage pipeline cannot run 64 in equal rounds: a 2-stage one runs, the third node waits.
    alone = planner.instantiate(3)
    assert [len(p.stages) for p in alone.plan.pipelines] == [2] and alone.idle_nodes == ("node2",)
    assert "cannot split 64 microbatches over pipelines of [3]" in alone.idle_reason
