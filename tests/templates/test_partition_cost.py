"""The cost of a cut: the schedule facts stage partitioning relies on (activations in
flight, iteration time) against the schedules' own lists and simulator, and the
runtime's per-microbatch message work and per-iteration terms in stage and iteration
times, with the partitioner against brute force when they are counted."""

from __future__ import annotations

import random
from itertools import combinations

import pytest

from planaria.templates import partition as partition_module
from planaria.templates.costs import LayerCost
from planaria.templates.partition import partition_layers
from planaria.templates.partition_cost import (
    evaluate_partition,
    in_flight_microbatches,
    pipeline_iteration_time,
)
from planaria.templates.schedule_simulator import simulate
from planaria.templates.schedules import SCHEDULES, build_schedule
from tests.templates.brute_force_partition import (
    count_vectors,
    make_costs,
    random_costs,
)
from tests.templates.schedule_spec import accepted


def shapes(names=SCHEDULES, ranks=range(1, 7), microbatches=range(1, 13)):
    for name in names:
        for p in ranks:
            for v in (range(1, 5) if name == "interleaved" else (1,)):
                for m in microbatches:
                    if accepted(name, p, v, m):
                        yield name, p, v, m


# --- schedule facts ------------------------------------------------------------


def test_in_flight_microbatches_match_the_schedules_lists():
    checked = 0
    for name, p, v, m in shapes():
        for rank, actions in build_schedule(name, p, v, m).items():
            peak = max(sum(c) for c in count_vectors(actions, p, v))
            assert in_flight_microbatches(name, rank, p, m, v) == peak, (name, p, v, m, rank)
            checked += 1
    assert checked > 500


def test_in_flight_microbatches_by_formula():
    assert in_flight_microbatches("gpipe", 0, 4, 7) == 7
    assert [in_flight_microbatches("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight_microbatches("zb1f1b", s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    # Megatron: (v-1)·per_round + 2(p-1-rank) + 1 chunk-microbatches, capped at m·v.
    assert [in_flight_microbatches("interleaved", s, 4, 8, 2) for s in range(4)] == [11, 9, 7, 5]
    assert in_flight_microbatches("interleaved", 0, 4, 1, 3) == 3
    with pytest.raises(ValueError, match="stage 4"):
        in_flight_microbatches("1f1b", 4, 4, 8)
    with pytest.raises(ValueError, match="virtual_stages"):
        in_flight_microbatches("1f1b", 0, 4, 8, 2)


@pytest.mark.parametrize("backward_time", [1.0, 2.0, 3.0])
def test_iteration_time_equals_the_simulated_makespan_for_uniform_stages(backward_time):
    t = 1.0 + backward_time
    checked = 0
    for name, p, v, m in shapes(ranks=range(1, 6), microbatches=range(1, 11)):
        if name == "zb1f1b" and backward_time != 2.0:
            continue  # the 2/3 bubble assumes F = I = W (module docstring)
        makespan = simulate(build_schedule(name, p, v, m), p, v, m, 1.0, backward_time).makespan
        model = pipeline_iteration_time([t] * p, [0.0] * (p * v - 1), m, name, v)
        assert model == pytest.approx(makespan, rel=1e-12, abs=1e-12), (name, p, v, m)
        checked += 1
    assert checked > 100


def test_zb1f1b_formula_deviates_from_the_simulator_when_backward_is_not_twice_forward():
    # Documented: the simulated bubble is (p-1)(F + B/2); the formula takes F + B only.
    p, m = 4, 8
    simulated = simulate(build_schedule("zb1f1b", p, 1, m), p, 1, m, 1.0, 1.0).makespan
    assert simulated == pytest.approx(2 * m + (p - 1) * 1.5)
    assert pipeline_iteration_time([2.0] * p, [0.0] * (p - 1), m, "zb1f1b") == \
        pytest.approx(2 * m + (p - 1) * 2 * 2 / 3)


def test_iteration_time_for_uneven_stages_and_sends():
    times, sends = [1.0, 3.0, 2.0], [0.25, 0.5]
    assert pipeline_iteration_time(times, sends, 4, "1f1b") == pytest.approx(6 + 3 * 3 + 0.75)
    assert pipeline_iteration_time(times, sends, 4, "gpipe") == pytest.approx(6 + 3 * 3 + 0.75)
    assert pipeline_iteration_time(times, sends, 4, "zb1f1b") == pytest.approx(4 * 3 + 2 + 0.75)
    # interleaved, m ≥ S: m·T + (Σ − T)/v; m < S adds the wrap-around wait.
    five = [0.1] * 5
    assert pipeline_iteration_time(times, five, 3, "interleaved", 2) == pytest.approx(9 + 1.5 + 0.5)
    assert pipeline_iteration_time(times, five, 1, "interleaved", 2) == pytest.approx(6 + 0.5)
    with pytest.raises(ValueError, match="boundaries"):
        pipeline_iteration_time(times, sends, 4, "interleaved", 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        pipeline_iteration_time(times, sends, 4, "looped")


def test_iteration_time_increases_with_microbatches():
    times = [1.0, 3.0, 2.0, 0.5]
    for name in SCHEDULES:
        for v in ((1, 2, 3) if name == "interleaved" else (1,)):
            sends = [0.01] * (4 * v - 1)
            values = [pipeline_iteration_time(times, sends, m, name, v) for m in range(1, 20)]
            assert all(a < b for a, b in zip(values, values[1:])), (name, v)


# --- per-microbatch message work and per-iteration terms ----------------------------


def with_runtime_costs(costs, rng, message=None, commit=None, action=None):
    """`costs` with a random message overhead, runtime work per action, commit and
    per-layer update time."""
    from dataclasses import replace

    hw = replace(costs.hardware,
                 message_overhead_s=rng.uniform(0.0, 0.3) if message is None else message,
                 collective_latency_s=rng.uniform(0.0, 0.5) if commit is None else commit,
                 action_overhead_s=rng.uniform(0.0, 0.2) if action is None else action)
    layers = tuple(replace(l, optimizer_s=rng.uniform(0.0, 0.4)) for l in costs.layers)
    return replace(costs, hardware=hw, layers=layers)


def runtime_cut(costs, bounds, S, v, m, schedule):
    """(per-microbatch formula, full iteration time, stage times) of a cut, computed
    independently: every model-stage boundary costs each adjacent stage one message out
    and one in per microbatch (when S > 1); every action (forward and backward, and
    zb1f1b's backward in two) costs its stage the runtime's work per action; every
    stage updates its layers once."""
    P = S * v
    chunks = [(bounds[j], bounds[j + 1]) for j in range(P)]
    side = 2 * costs.hardware.message_overhead_s if S > 1 else 0.0
    actions = (3 if schedule == "zb1f1b" else 2) * costs.hardware.action_overhead_s
    times, updates = [], []
    for s in range(S):
        mine = [(j, chunks[j]) for j in range(s, P, S)]
        sides = sum((j > 0) + (j < P - 1) for j, _ in mine)
        times.append(sum(costs.compute_time(a, b) for _, (a, b) in mine) + sides * side
                     + len(mine) * actions)
        updates.append(sum(costs.update_time(a, b) for _, (a, b) in mine))
    sends = [costs.send_time(b - 1) for b in bounds[1:-1]]
    pipeline = pipeline_iteration_time(times, sends, m, schedule, v)
    return pipeline, pipeline + max(updates) + costs.commit_time(), times


def test_message_work_and_updates_enter_stage_and_iteration_times():
    rng = random.Random("runtime terms")
    for _ in range(60):
        v = rng.choice([1, 2])
        schedule = "interleaved" if v == 2 else rng.choice(["1f1b", "gpipe", "zb1f1b"])
        L = rng.randint(2 * v + 1, 9)
        S = rng.randint(1, min(3, L // v))
        m = rng.randint(1, 6)
        if not accepted(schedule, S, v, m):
            continue
        costs = with_runtime_costs(random_costs(rng, L), rng)
        inner = sorted(rng.sample(range(1, L), S * v - 1))
        bounds = [0, *inner, L]
        ranges = [(bounds[j], bounds[j + 1]) for j in range(S * v)]
        part = evaluate_partition(costs, ranges, S, num_microbatches=m, schedule=schedule,
                                  virtual_stages=v)
        pipeline, total, times = runtime_cut(costs, bounds, S, v, m, schedule)
        assert part.stage_times == pytest.approx(times, rel=1e-12)
        assert part.iteration_time(m) == pytest.approx(total, rel=1e-12)
        assert part.fixed_time_s == costs.commit_time()
        assert max(part.update_times) == pytest.approx(total - pipeline - costs.commit_time())


def test_a_two_stage_pipeline_pays_two_messages_per_microbatch_on_each_stage():
    layers = [LayerCost(forward_s=1.0, backward_s=2.0, state_bytes=0, activation_bytes=0,
                        output_bytes=0, optimizer_s=0.5)] * 4
    costs = make_costs(layers)
    from dataclasses import replace

    costs = replace(costs, hardware=replace(costs.hardware, message_overhead_s=0.1,
                                            collective_latency_s=0.25, link_latency_s=0.0))
    part = partition_layers(costs, 2, num_microbatches=4, schedule="1f1b")
    assert part.model_stages == ((0, 2), (2, 4))
    assert part.stage_times == pytest.approx((6.2, 6.2))  # 2 layers x 3 s + 2 messages x 0.1 s
    assert part.update_times == pytest.approx((1.0, 1.0))
    # m·T + (Σ - T) + sends (0: no latency, no bytes) + the update + the commit
    assert part.iteration_time(4) == pytest.approx(4 * 6.2 + 6.2 + 1.0 + 0.25)
    # Interleaved, 2 x 2 chunks: the first and last stage each have 3 boundary sides.
    inter = evaluate_partition(costs, [(0, 1), (1, 2), (2, 3), (3, 4)], 2, num_microbatches=4,
                               schedule="interleaved", virtual_stages=2)
    assert inter.stage_times == pytest.approx((6.6, 6.6))
    # One stage: chunks hand over in the process, no messages.
    alone = partition_layers(costs, 1, num_microbatches=4, schedule="1f1b")
    assert alone.stage_times == pytest.approx((12.0,))
    assert alone.iteration_time(4) == pytest.approx(4 * 12.0 + 2.0 + 0.25)


def test_the_runtimes_work_per_action_is_paid_by_every_chunk_of_every_stage():
    from dataclasses import replace

    layers = [LayerCost(forward_s=1.0, backward_s=2.0, state_bytes=0, activation_bytes=0,
                        output_bytes=0)] * 4
    costs = make_costs(layers)
    costs = replace(costs, hardware=replace(costs.hardware, action_overhead_s=0.05,
                                            link_latency_s=0.0))
    part = partition_layers(costs, 2, num_microbatches=4, schedule="1f1b")
    assert part.stage_times == pytest.approx((6.1, 6.1))  # forward and backward: 2 x 0.05
    assert part.iteration_time(4) == pytest.approx(5 * 6.1)
    inter = evaluate_partition(costs, [(0, 1), (1, 2), (2, 3), (3, 4)], 2, num_microbatches=4,
                               schedule="interleaved", virtual_stages=2)
    assert inter.stage_times == pytest.approx((6.2, 6.2))  # two chunks, two actions each
    zero_bubble = partition_layers(costs, 2, num_microbatches=4, schedule="zb1f1b")
    assert zero_bubble.stage_times == pytest.approx((6.15, 6.15))  # F, I and W
    alone = partition_layers(costs, 1, num_microbatches=4, schedule="1f1b")  # actions all the same
    assert alone.stage_times == pytest.approx((12.1,))


def test_zero_runtime_costs_leave_partitions_and_times_unchanged():
    rng = random.Random("zeros")
    for _ in range(40):
        L = rng.randint(3, 9)
        S = rng.randint(1, min(3, L))
        m = rng.randint(1, 6)
        costs = random_costs(rng, L)
        plain = partition_layers(costs, S, num_microbatches=m, schedule="1f1b")
        assert plain.update_times == (0.0,) * S and plain.fixed_time_s == 0.0
        times = pipeline_iteration_time(plain.stage_times, plain.send_times, m, "1f1b")
        assert plain.iteration_time(m) == times


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb1f1b"])
def test_one_chunk_partition_with_message_work_equals_brute_force(schedule):
    """The exact search optimises the per-microbatch terms (messages included)."""
    rng = random.Random(f"messages {schedule}")
    done = 0
    while done < 80:
        L = rng.randint(3, 9)
        S = rng.randint(1, min(4, L))
        m = rng.randint(1, 8)
        if not accepted(schedule, S, 1, m):
            continue
        costs = with_runtime_costs(random_costs(rng, L), rng)
        best = min(runtime_cut(costs, (0, *inner, L), S, 1, m, schedule)[0]
                   for inner in combinations(range(1, L), S - 1))
        part = partition_layers(costs, S, num_microbatches=m, schedule=schedule)
        pipeline = part.iteration_time(m) - max(part.update_times) - part.fixed_time_s
        assert pipeline == pytest.approx(best, rel=1e-9)
        done += 1


def test_interleaved_partition_with_runtime_costs_equals_brute_force():
    """The exhaustive interleaved search minimises the whole iteration time."""
    rng = random.Random("messages interleaved")
    done = 0
    while done < 60:
        L = rng.randint(4, 9)
        S = rng.randint(1, min(3, L // 2))
        m = rng.randint(1, 7)
        if not accepted("interleaved", S, 2, m):
            continue
        costs = with_runtime_costs(random_costs(rng, L), rng)
        best = min(runtime_cut(costs, (0, *inner, L), S, 2, m, "interleaved")[1]
                   for inner in combinations(range(1, L), 2 * S - 1))
        part = partition_layers(costs, S, num_microbatches=m, schedule="interleaved",
                                virtual_stages=2)
        assert part.iteration_time(m) == pytest.approx(best, rel=1e-9)
        done += 1


def test_interleaved_heuristic_with_message_work_fits_and_is_close(monkeypatch):
    monkeypatch.setattr(partition_module, "EXHAUSTIVE_LIMIT", 0)
    rng = random.Random("heuristic messages")
    for _ in range(20):
        L = rng.randint(6, 10)
        S = rng.randint(2, min(3, L // 2))
        m = 2 * S
        costs = with_runtime_costs(random_costs(rng, L), rng)
        part = partition_layers(costs, S, num_microbatches=m, schedule="interleaved",
                                virtual_stages=2)
        best = min(runtime_cut(costs, (0, *inner, L), S, 2, m, "interleaved")[1]
                   for inner in combinations(range(1, L), 2 * S - 1))
        assert best * (1 - 1e-12) <= part.iteration_time(m) <= 1.25 * best  # rounding


def test_evaluate_partition_refuses_ranges_that_do_not_cover_the_layers():
    costs = make_costs([LayerCost(1.0, 2.0, 0, 0, 0)] * 4)
    with pytest.raises(ValueError, match="contiguous"):
        evaluate_partition(costs, [(0, 2), (3, 4)], 2, num_microbatches=2)
    with pytest.raises(ValueError, match="4 model stages"):
        evaluate_partition(costs, [(0, 2), (2, 4)], 2, num_microbatches=2, schedule="interleaved",
                           virtual_stages=2)
    chosen = partition_layers(costs, 2, num_microbatches=2)
    assert evaluate_partition(costs, chosen.model_stages, 2, num_microbatches=2) == chosen
