"""Stage partitioning: the schedule facts it relies on (activations in flight, iteration
time) against the schedules' own lists and simulator, and the partitioner against a
brute-force search over every cut (feasibility, shortfall, optimum)."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from itertools import combinations

import pytest

from planaria.templates import partition as partition_module
from planaria.templates.costs import CostModel, Hardware, LayerCost, ModelShape
from planaria.templates.partition import partition_layers
from planaria.templates.partition_cost import (
    InfeasiblePartition,
    StagePartition,
    evaluate_partition,
    in_flight_microbatches,
    pipeline_iteration_time,
)
from planaria.templates.plan import PipelinePlan, StagePlan
from planaria.templates.schedule_simulator import simulate
from planaria.templates.schedules import SCHEDULES, build_schedule, check_schedule_shape

GIB = 1 << 30


def accepted(name, p, v, m):
    try:
        check_schedule_shape(name, p, v, m)
    except ValueError:
        return False
    return True


def shapes(names=SCHEDULES, ranks=range(1, 7), microbatches=range(1, 13)):
    for name in names:
        for p in ranks:
            for v in (range(1, 5) if name == "interleaved" else (1,)):
                for m in microbatches:
                    if accepted(name, p, v, m):
                        yield name, p, v, m


def count_vectors(actions, num_ranks, v):
    """Per step of a rank's list, the microbatches of each local chunk in flight: forwarded,
    and not yet freed by their backward (B, or W for split backwards; I frees nothing)."""
    counts = [0] * v
    out = []
    for action in actions:
        chunk = action.stage // num_ranks
        counts[chunk] += {"F": 1, "B": -1, "I": 0, "W": -1}[action.kind]
        out.append(tuple(counts))
    return out


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


# --- brute force ---------------------------------------------------------------


def make_costs(layers, memory=80 * GIB):
    shape = ModelShape(n_layers=len(layers) - 2, d_model=8, n_heads=1, vocab_size=16, seq_len=8)
    hardware = Hardware("test", memory, 1e12, 8, 1e9, 1e9, link_latency_s=1e-6)
    return CostModel(shape, hardware, 1, 1, tuple(layers))


def random_costs(rng, num_layers):
    ties = rng.random() < 0.4
    equal_sends = rng.random() < 0.3

    def seconds():
        return rng.choice([0.5, 1.0, 1.5]) if ties else rng.uniform(0.05, 2.0)

    return make_costs([
        LayerCost(forward_s=seconds(), backward_s=seconds(),
                  state_bytes=rng.randint(0, 1000), activation_bytes=rng.randint(0, 300),
                  output_bytes=10 ** 6 if equal_sends else rng.randint(0, 10 ** 8))
        for _ in range(num_layers)])


def evaluate_cut(costs, bounds, num_stages, v, m, schedule, steps):
    """(iteration time, peak of each stage) of one cut, computed independently: stage memory
    from the schedule's own action lists (`steps`: count_vectors per rank), chunk by chunk."""
    S, P = num_stages, num_stages * v
    chunks = [(bounds[j], bounds[j + 1]) for j in range(P)]
    times, peaks = [], []
    for s in range(S):
        mine = [chunks[c * S + s] for c in range(v)]
        times.append(sum(costs.compute_time(a, b) for a, b in mine))
        acts = [costs.activation_bytes(a, b) for a, b in mine]
        held = max(sum(n * x for n, x in zip(vec, acts)) for vec in steps[s])
        peaks.append(sum(costs.state_bytes(a, b) for a, b in mine) + held)
    sends = [costs.send_time(b - 1) for b in bounds[1:-1]]
    return pipeline_iteration_time(times, sends, m, schedule, v), peaks


def schedule_steps(schedule, S, v, m):
    return {r: count_vectors(a, S, v) for r, a in build_schedule(schedule, S, v, m).items()}


def every_partition(costs, num_stages, v, m, schedule):
    """(bounds, iteration time, largest peak) of every cut into num_stages·v model stages."""
    L, P = costs.num_layers, num_stages * v
    steps = schedule_steps(schedule, num_stages, v, m)
    out = []
    for inner in combinations(range(1, L), P - 1):
        bounds = (0, *inner, L)
        value, peaks = evaluate_cut(costs, bounds, num_stages, v, m, schedule, steps)
        out.append((bounds, value, max(peaks)))
    return out


def pick_limit(rng, candidates):
    smallest = min(peak for _, _, peak in candidates)
    largest = max(peak for _, _, peak in candidates)
    return rng.choice([smallest - 1, smallest, smallest + 1, rng.randint(smallest, largest),
                       rng.randint(smallest, largest), largest, max(0, smallest - 50)])


def assert_consistent(result: StagePartition, costs, num_stages, v, m, schedule, limit):
    """The fields say what the cut is, and the cut fits."""
    P = num_stages * v
    bounds = [result.model_stages[0][0]] + [b for _, b in result.model_stages]
    assert bounds[0] == 0 and bounds[-1] == costs.num_layers
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    assert all(result.model_stages[j][1] == result.model_stages[j + 1][0] for j in range(P - 1))
    assert (result.num_stages, result.virtual_stages, result.schedule) == (num_stages, v, schedule)
    value, peaks = evaluate_cut(costs, bounds, num_stages, v, m, schedule,
                                schedule_steps(schedule, num_stages, v, m))
    assert result.iteration_time(m) == pytest.approx(value, rel=1e-12)
    assert list(result.peak_memory_bytes) == peaks
    assert max(peaks) <= limit
    assert len(result.send_times) == P - 1
    assert result.send_times == tuple(costs.send_time(b - 1) for b in bounds[1:-1])
    for s in range(num_stages):
        chunks = result.stage_chunks(s)
        assert len(chunks) == v
        assert result.stage_times[s] == pytest.approx(
            sum(costs.compute_time(a, b) for a, b in chunks), rel=1e-12)


def check_against_brute_force(costs, S, v, m, schedule, limit, candidates):
    feasible = [value for _, value, peak in candidates if peak <= limit]
    smallest_peak = min(peak for _, _, peak in candidates)
    if not feasible:
        with pytest.raises(InfeasiblePartition) as error:
            partition_layers(costs, S, num_microbatches=m, schedule=schedule,
                             virtual_stages=v, memory_bytes=limit)
        assert error.value.shortfall_bytes == smallest_peak - limit > 0
        return "infeasible"
    result = partition_layers(costs, S, num_microbatches=m, schedule=schedule,
                              virtual_stages=v, memory_bytes=limit)
    assert result.iteration_time(m) == pytest.approx(min(feasible), rel=1e-12, abs=0)
    assert_consistent(result, costs, S, v, m, schedule, limit)
    return "feasible"


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
