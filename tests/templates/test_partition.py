"""Stage partitioning: the partitioner against a brute-force search over every cut
(feasibility, shortfall, optimum) and independent DPs, on a model of realistic size, and
its results and errors. (The schedule facts it relies on and the runtime's costs in the
stage times: `test_partition_cost.py`; the brute-force reference:
`brute_force_partition.py`.)"""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest

from planaria.templates import partition as partition_module
from planaria.templates.costs import CostModel, Hardware, LayerCost, ModelShape
from planaria.templates.partition import partition_layers
from planaria.templates.partition_cost import (
    InfeasiblePartition,
    in_flight_microbatches,
    pipeline_iteration_time,
)
from planaria.templates.plan import PipelinePlan, StagePlan
from tests.templates.brute_force_partition import (
    GIB,
    assert_consistent,
    check_against_brute_force,
    every_partition,
    make_costs,
    pick_limit,
    random_costs,
)
from tests.templates.schedule_spec import accepted


# --- brute force ---------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb1f1b", "interleaved"])
def test_partition_equals_brute_force_with_one_chunk_per_stage(schedule):
    rng = random.Random(f"v=1 {schedule}")
    outcomes = {"feasible": 0, "infeasible": 0}
    done = 0
    while done < 150:
        L = rng.randint(3, 10)  # a CostModel has at least embedding, block, head
        S = rng.randint(1, min(4, L))
        m = rng.randint(1, 8)
        if not accepted(schedule, S, 1, m):
            continue
        costs = random_costs(rng, L)
        candidates = every_partition(costs, S, 1, m, schedule)
        limit = pick_limit(rng, candidates)
        outcomes[check_against_brute_force(costs, S, 1, m, schedule, limit, candidates)] += 1
        done += 1
    assert min(outcomes.values()) > 10, outcomes


def independent_optimum(costs, S, m, schedule, limit):
    """For every bottleneck B, an O(S·L²) DP for the cheapest cuts with stages ≤ B."""
    L = costs.num_layers
    weights = [in_flight_microbatches(schedule, s, S, m) for s in range(S)]
    best = math.inf
    bottlenecks = {costs.compute_time(a, b) for a in range(L) for b in range(a + 1, L + 1)}
    for bottleneck in sorted(bottlenecks):
        cost = [[math.inf] * (L + 1) for _ in range(S + 1)]
        start = [[0] * (L + 1) for _ in range(S + 1)]
        cost[0][0] = 0.0
        for s in range(1, S + 1):
            for b in range(s, L + 1):
                for a in range(s - 1, b):
                    fits = (costs.compute_time(a, b) <= bottleneck and costs.state_bytes(a, b)
                            + weights[s - 1] * costs.activation_bytes(a, b) <= limit)
                    value = cost[s - 1][a] + (costs.send_time(a - 1) if a else 0.0)
                    if fits and value < cost[s][b]:
                        cost[s][b], start[s][b] = value, a
        if cost[S][L] == math.inf:
            continue
        bounds = [L]
        for s in range(S, 0, -1):
            bounds.append(start[s][bounds[-1]])
        bounds.reverse()
        times = [costs.compute_time(a, b) for a, b in zip(bounds, bounds[1:])]
        sends = [costs.send_time(b - 1) for b in bounds[1:-1]]
        best = min(best, pipeline_iteration_time(times, sends, m, schedule))
    return best


def test_partition_equals_an_independent_search_on_medium_models():
    rng = random.Random("medium")
    feasible = 0
    for _ in range(25):
        L, S, m = rng.randint(15, 24), rng.randint(2, 6), rng.randint(1, 12)
        schedule = rng.choice(["1f1b", "gpipe", "zb1f1b"])
        costs = random_costs(rng, L)
        limit = rng.randint(2000, 20000)
        expected = independent_optimum(costs, S, m, schedule, limit)
        if expected == math.inf:
            with pytest.raises(InfeasiblePartition):
                partition_layers(costs, S, num_microbatches=m, schedule=schedule,
                                 memory_bytes=limit)
            continue
        result = partition_layers(costs, S, num_microbatches=m, schedule=schedule,
                                  memory_bytes=limit)
        assert result.iteration_time(m) == pytest.approx(expected, rel=1e-12, abs=0)
        feasible += 1
    assert feasible > 10


def test_interleaved_partition_equals_brute_force_on_small_models():
    rng = random.Random("interleaved")
    outcomes = {"feasible": 0, "infeasible": 0}
    done = 0
    while done < 120:
        v = rng.randint(2, 3)
        L = rng.randint(max(3, 2 * v), 9)
        S = rng.randint(1, min(3, L // v))
        m = rng.randint(1, 7)
        if not accepted("interleaved", S, v, m):
            continue
        costs = random_costs(rng, L)
        candidates = every_partition(costs, S, v, m, "interleaved")
        limit = pick_limit(rng, candidates)
        outcomes[check_against_brute_force(costs, S, v, m, "interleaved", limit, candidates)] += 1
        done += 1
    assert min(outcomes.values()) > 10, outcomes


def test_interleaved_heuristic_returns_a_fitting_cut_close_to_the_optimum(monkeypatch):
    # Force the heuristic on instances the brute force can still check.
    monkeypatch.setattr(partition_module, "EXHAUSTIVE_LIMIT", 0)
    rng = random.Random("heuristic")
    ratios = []
    while len(ratios) < 40:
        v = rng.randint(2, 3)
        L = rng.randint(max(3, 2 * v), 11)
        S = rng.randint(1, min(3, L // v))
        m = rng.choice([1, S, 2 * S])
        if not accepted("interleaved", S, v, m):
            continue
        costs = random_costs(rng, L)
        candidates = every_partition(costs, S, v, m, "interleaved")
        limit = max(peak for _, _, peak in candidates)  # everything fits
        result = partition_layers(costs, S, num_microbatches=m, schedule="interleaved",
                                  virtual_stages=v, memory_bytes=limit)
        assert_consistent(result, costs, S, v, m, "interleaved", limit)
        best = min(value for _, value, _ in candidates)
        ratios.append(result.iteration_time(m) / best)
    assert min(ratios) >= 1 - 1e-12
    assert sorted(ratios)[len(ratios) // 2] <= 1 + 1e-12  # the median case is optimal
    assert max(ratios) < 1.25


# --- a model of realistic size -------------------------------------------------


def gpt_like(blocks=96, memory=80 * GIB):
    """Uniform blocks; a heavier embedding and head (GPT-3-175B-ish numbers at tp=8)."""
    block = LayerCost(forward_s=1.9e-3, backward_s=3.8e-3, state_bytes=int(3.4 * GIB),
                      activation_bytes=int(0.33 * GIB), output_bytes=50_331_648)
    embedding = LayerCost(0.6e-3, 1.2e-3, int(5.1 * GIB), int(0.33 * GIB), 50_331_648)
    head = LayerCost(3.8e-3, 7.6e-3, int(5.1 * GIB), int(0.66 * GIB), 0)
    shape = ModelShape(n_layers=blocks, d_model=12288, n_heads=96, vocab_size=50257, seq_len=2048)
    hardware = Hardware("h100", memory, 989e12, 8, 450e9, 50e9)
    return CostModel(shape, hardware, 8, 1, (embedding, *[block] * blocks, head))


def min_max_stage_time(costs, S, weights, limit):
    """Independent O(S·L²) DP: the smallest slowest-stage time of any cut that fits."""
    L = costs.num_layers
    best = [[math.inf] * (L + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for s in range(1, S + 1):
        for b in range(s, L + 1):
            for a in range(s - 1, b):
                if best[s - 1][a] == math.inf:
                    continue
                memory = costs.state_bytes(a, b) + weights[s - 1] * costs.activation_bytes(a, b)
                if memory <= limit:
                    best[s][b] = min(best[s][b], max(best[s - 1][a], costs.compute_time(a, b)))
    return best[S][L]


@pytest.mark.parametrize("num_stages", [8, 13, 24])
def test_large_model_matches_an_independent_min_max_dp(num_stages):
    # All cuts cost the same, so the optimum is the smallest slowest stage.
    costs = gpt_like()
    m = 2 * num_stages
    weights = [min(num_stages - s, m) for s in range(num_stages)]
    result = partition_layers(costs, num_stages, num_microbatches=m)
    expected = min_max_stage_time(costs, num_stages, weights, costs.hardware.device_memory_bytes)
    assert max(result.stage_times) == pytest.approx(expected, rel=1e-12)
    assert max(result.peak_memory_bytes) <= costs.hardware.device_memory_bytes


def test_large_model_interleaved_heuristic_reaches_the_integrality_bound():
    costs = gpt_like(memory=10 ** 15)  # memory is not the question here
    block = costs.compute_time(1, 2)
    for S in (8, 11, 16, 24):
        result = partition_layers(costs, S, num_microbatches=2 * S, schedule="interleaved",
                                  virtual_stages=2)
        total_blocks = costs.compute_time(0, costs.num_layers) / block  # 96 + 0.3 + 2
        assert max(result.stage_times) <= math.ceil(total_blocks / S) * block * (1 + 1e-9), S
        assert_valid_cut(result, costs, S, 2)


def assert_valid_cut(result, costs, S, v):
    stages = result.model_stages
    assert len(stages) == S * v and stages[0][0] == 0 and stages[-1][1] == costs.num_layers
    assert all(a < b for a, b in stages)
    assert all(stages[j][1] == stages[j + 1][0] for j in range(len(stages) - 1))


def test_memory_limit_binds_and_more_memory_never_hurts():
    costs = gpt_like()
    tight = partition_layers(costs, 9, num_microbatches=18)
    loose = partition_layers(costs, 9, num_microbatches=18, memory_bytes=10 ** 15)
    assert loose.iteration_time(18) <= tight.iteration_time(18)
    assert max(tight.peak_memory_bytes) <= 80 * GIB


# --- results, errors -----------------------------------------------------------


def test_stage_chunks_follow_the_looped_placement_of_the_plan():
    costs = make_costs([LayerCost(1.0, 2.0, 10, 5, 100)] * 12)
    result = partition_layers(costs, 3, num_microbatches=3, schedule="interleaved",
                              virtual_stages=2)
    stages = result.model_stages
    assert [result.stage_chunks(s) for s in range(3)] == \
        [(stages[0], stages[3]), (stages[1], stages[4]), (stages[2], stages[5])]
    assert result.stage_times == (12.0, 12.0, 12.0)  # 4 layers on each stage
    pipeline = PipelinePlan("t", tuple(StagePlan(f"n{s}", (s,), result.stage_chunks(s))
                                       for s in range(3)), 3, 0)
    assert tuple(pipeline.model_stages(2)) == result.model_stages
    with pytest.raises(ValueError, match="stage 3"):
        result.stage_chunks(3)


def test_uniform_layers_split_evenly_and_report_their_memory():
    costs = make_costs([LayerCost(1.0, 2.0, 10, 5, 100)] * 8)
    result = partition_layers(costs, 4, num_microbatches=8)
    assert result.model_stages == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert result.stage_times == (6.0, 6.0, 6.0, 6.0)
    # 1F1B: stage s holds min(S - s, m) microbatches of 2 layers x 5 bytes.
    assert result.peak_memory_bytes == (20 + 40, 20 + 30, 20 + 20, 20 + 10)
    assert result.iteration_time(8) == pytest.approx(4 * 6 + 7 * 6 + 3 * costs.send_time(0))


def test_default_memory_is_the_devices():
    layers = [LayerCost(1.0, 2.0, 100, 10, 100)] * 4
    with pytest.raises(InfeasiblePartition) as error:
        partition_layers(make_costs(layers, memory=200), 2, num_microbatches=4)
    # The best cut puts 2 layers on each stage: stage 0 holds 200 + 2·2·10 = 240 bytes.
    assert error.value.shortfall_bytes == 40
    assert partition_layers(make_costs(layers, memory=240), 2, num_microbatches=4)


def test_infeasible_partition_names_the_shortfall_and_the_fixes():
    layers = [LayerCost(1.0, 2.0, 100, 10, 100)] * 4
    with pytest.raises(InfeasiblePartition) as error:
        partition_layers(make_costs(layers), 2, num_microbatches=4, memory_bytes=200)
    message = str(error.value)
    assert isinstance(error.value, ValueError)
    for fragment in ("2 stages", "240 bytes", "200 bytes", "40 bytes", "more stages",
                     "tensor parallelism", "recomputation", "smaller micro batch"):
        assert fragment in message, fragment
    assert InfeasiblePartition("planner's own message", 7).shortfall_bytes == 7


def test_too_few_layers_and_bad_shapes_are_refused_with_the_fix():
    costs = make_costs([LayerCost(1.0, 2.0, 1, 1, 1)] * 5)
    with pytest.raises(ValueError, match="at most 5 stages"):
        partition_layers(costs, 6, num_microbatches=8)
    with pytest.raises(ValueError, match="at most 2 stages or fewer virtual stages"):
        partition_layers(costs, 3, num_microbatches=3, schedule="interleaved", virtual_stages=2)
    with pytest.raises(ValueError, match="use schedule 'interleaved'"):
        partition_layers(costs, 2, num_microbatches=4, virtual_stages=2)
    with pytest.raises(ValueError, match="num_microbatches="):
        partition_layers(costs, 2, num_microbatches=5, schedule="interleaved", virtual_stages=2)


def test_partition_module_does_not_import_torch():
    code = ("import sys; import planaria.templates.partition; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
