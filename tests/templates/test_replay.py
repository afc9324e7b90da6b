"""The schedule replay with message costs drawn from a measured spread
(planaria.templates.replay): it agrees with the closed form where that is exact, and
shows what the closed form cannot: stalled messages delaying the rank waiting for them."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planaria.templates.costs import CostModel, Hardware, LayerCost, ModelShape
from planaria.templates.partition_cost import evaluate_partition
from planaria.templates.replay import replay_iteration_time

GIB = 1 << 30
OVERHEAD = 2e-4


def uniform_costs(quantiles=(), output_bytes=0, latency=0.0, overhead=OVERHEAD, action=0.0):
    """Six layers of the same cost, so that equal cuts make equal model stages."""
    shape = ModelShape(n_layers=4, d_model=64, n_heads=4, vocab_size=256, seq_len=64)
    hw = Hardware(name="test", device_memory_bytes=80 * GIB, peak_flops=1e12, gpus_per_node=1,
                  intra_node_bandwidth=1e9, inter_node_bandwidth=1e9, link_latency_s=latency,
                  message_overhead_s=overhead, message_overhead_quantiles=tuple(quantiles),
                  collective_latency_s=5e-4, action_overhead_s=action)
    layer = LayerCost(forward_s=1e-3, backward_s=2e-3, state_bytes=1, activation_bytes=1,
                      output_bytes=output_bytes, optimizer_s=1e-4)
    return CostModel(shape=shape, hardware=hw, tp=1, micro_batch=1, layers=(layer,) * 6)


CASES = [  # schedule, stages, chunks per stage, microbatches, cut
    ("gpipe", 2, 1, 4, [(0, 3), (3, 6)]),
    ("1f1b", 2, 1, 4, [(0, 3), (3, 6)]),
    ("1f1b", 3, 1, 6, [(0, 2), (2, 4), (4, 6)]),
    ("interleaved", 3, 2, 6, [(i, i + 1) for i in range(6)]),
]


@pytest.mark.parametrize("schedule,S,v,m,cut", CASES)
def test_constant_message_costs_reproduce_the_formula_for_equal_stages(schedule, S, v, m, cut):
    # With two stages every stage touches the same number of boundary sides, so the
    # message work keeps them equal; with three the middle one touches more.
    costs = uniform_costs(overhead=OVERHEAD if S == 2 else 0.0)
    part = evaluate_partition(costs, cut, S, num_microbatches=m, schedule=schedule,
                              virtual_stages=v)
    result = replay_iteration_time(costs, part, m)
    assert result.trials == 1  # nothing random to draw
    assert result.mean_s == pytest.approx(part.iteration_time(m), rel=1e-12)


@pytest.mark.parametrize("schedule,S,v,m,cut", CASES + [("zb1f1b", 2, 1, 4, [(0, 3), (3, 6)])])
def test_the_runtimes_work_per_action_counts_as_in_the_formula(schedule, S, v, m, cut):
    # Every chunk runs the same actions, so equal stages stay equal: the formula is exact
    # (zb1f1b: forward, input and weight halves stay equal, three actions each).
    plain = uniform_costs(overhead=0.0)
    busy = uniform_costs(overhead=0.0, action=3e-4)
    times = []
    for costs in (plain, busy):
        part = evaluate_partition(costs, cut, S, num_microbatches=m, schedule=schedule,
                                  virtual_stages=v)
        times.append(replay_iteration_time(costs, part, m).mean_s)
        assert times[-1] == pytest.approx(part.iteration_time(m), rel=1e-12)
    assert times[1] > times[0] + m * 3e-4


@pytest.mark.parametrize("schedule,S,v,m,cut,at_least", [
    (*CASES[1], 1.0), (*CASES[2], 1.01), (*CASES[3], 1.01)])
def test_stalls_cost_more_than_their_mean_where_ranks_wait_for_each_other(schedule, S, v, m, cut,
                                                                          at_least):
    # 9 in 10 messages cost 0.1 ms, one in 10 stalls for 1.1 ms: the mean is 0.2 ms.
    stalled = [1e-4] * 9 + [1.1e-3]
    steady = uniform_costs()
    jittery = uniform_costs(quantiles=stalled)
    assert sum(stalled) / len(stalled) == pytest.approx(OVERHEAD)
    part = evaluate_partition(jittery, cut, S, num_microbatches=m, schedule=schedule,
                              virtual_stages=v)
    mean_only = replay_iteration_time(steady, part, m).mean_s
    result = replay_iteration_time(jittery, part, m, trials=400, seed=1)
    assert result.mean_s > mean_only * at_least
    assert result.p10_s <= result.mean_s <= result.p90_s
    assert replay_iteration_time(jittery, part, m, trials=400, seed=1) == result


def test_one_stage_pipelines_send_nothing():
    costs = uniform_costs(quantiles=[0.0, 1e-2])
    part = evaluate_partition(costs, [(0, 6)], 1, num_microbatches=4, schedule="1f1b")
    result = replay_iteration_time(costs, part, 4)
    assert result.mean_s == pytest.approx(part.iteration_time(4), rel=1e-12)


def test_transfers_delay_the_other_rank():
    quick = uniform_costs()
    slow = uniform_costs(output_bytes=10**6, latency=1e-4)  # 1.1 ms each way
    cut = [(0, 3), (3, 6)]
    parts = [evaluate_partition(c, cut, 2, num_microbatches=4, schedule="1f1b")
             for c in (quick, slow)]
    times = [replay_iteration_time(c, p, 4).mean_s for c, p in zip((quick, slow), parts)]
    # At least the first microbatch's round trip (one hop each way) is added.
    assert times[1] - times[0] >= 2 * 1.1e-3 - 1e-12


def test_bad_trials():
    costs = uniform_costs()
    part = evaluate_partition(costs, [(0, 3), (3, 6)], 2, num_microbatches=2, schedule="1f1b")
    with pytest.raises(ValueError, match="trials"):
        replay_iteration_time(costs, part, 2, trials=0)
    assert replace(part) == part
