"""An independent reference for stage partitioning: random layer costs, a cut's iteration
time and per-stage peaks computed from the schedules' own action lists, every cut of a
small model, and the check of `partition_layers` against them. Shared by
`test_partition.py` and `test_partition_cost.py`."""

from __future__ import annotations

from itertools import combinations

import pytest

from planaria.templates.costs import CostModel, Hardware, LayerCost, ModelShape
from planaria.templates.partition import partition_layers
from planaria.templates.partition_cost import (
    InfeasiblePartition,
    StagePartition,
    pipeline_iteration_time,
)
from planaria.templates.schedules import build_schedule

GIB = 1 << 30


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
