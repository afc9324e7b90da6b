"""Replay of one pipeline's schedule with message costs drawn from their measured spread.

`StagePartition.iteration_time` charges every stage the mean cost of its messages, as
if each rank's time were its own. That is right when a rank has slack, and the
planner's search needs a closed form. Where it has none (the interleaved schedule,
whose every chunk hop crosses ranks, and to a lesser degree 1f1b), a message that
stalls delays the rank waiting for it too, and the iteration's expected time is above
the formula's. On CPU with gloo such stalls are common (1 to 5 ms on 5 to 15% of
messages, measured by `planaria.templates.gloo_links.measure_gloo_links` as the quantiles
`Hardware.message_overhead_quantiles`).

`replay_iteration_time` replays the schedule's action lists (`build_schedule`) action by
action, as `templates.schedule_simulator.simulate` does, with each action taking its chunk's
compute plus the runtime's own work per action (`Hardware.action_overhead_s`) plus one
drawn message cost per boundary side it touches, and each hop to the
other rank arriving a one-way transfer later. The mean makespan over many draws, plus
the slowest stage's update and the commit, is the expected iteration time. With every
draw at the mean it agrees with the formula where the formula is exact (equal stages).
It is an estimate of a given plan, for the plan's report and the cost model's accuracy
check; the planner still ranks plans by the formula.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from planaria.templates.costs import CostModel
from planaria.templates.partition_cost import StagePartition
from planaria.templates.schedule_simulator import ScheduleDeadlock, replay
from planaria.templates.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    build_schedule,
)


@dataclass(frozen=True)
class ReplayResult:
    """Expected iteration time of one pipeline, and the spread of the replays."""

    mean_s: float
    p10_s: float
    p90_s: float
    trials: int


def replay_iteration_time(costs: CostModel, partition: StagePartition, num_microbatches: int, *,
                          trials: int = 200, seed: int = 0) -> ReplayResult:
    """The expected iteration time of `partition` running `num_microbatches` (module docstring).

    Message costs are drawn uniformly from `costs.hardware.message_overhead_quantiles`,
    or are all `message_overhead_s` when it has none (then one replay is enough).
    """
    if trials < 1:
        raise ValueError(f"trials must be at least 1, got {trials}")
    hw = costs.hardware
    S, v = partition.num_stages, partition.virtual_stages
    schedule = build_schedule(partition.schedule, S, v, num_microbatches)
    durations = _chunk_durations(costs, partition)
    hops = [t / 2 for t in partition.send_times]  # send_times count both directions
    quantiles = hw.message_overhead_quantiles
    if not quantiles or S == 1:
        trials = 1
    rng = random.Random(seed)
    draw = (lambda: rng.choice(quantiles)) if quantiles else (lambda: hw.message_overhead_s)
    fixed = max(partition.update_times, default=0.0) + partition.fixed_time_s
    spans = sorted(_makespan(schedule, S * v, S, durations, hops, draw, hw.action_overhead_s)
                   + fixed for _ in range(trials))
    return ReplayResult(mean_s=statistics.fmean(spans), p10_s=_quantile(spans, 0.1),
                        p90_s=_quantile(spans, 0.9), trials=trials)


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _chunk_durations(costs: CostModel, partition: StagePartition) -> list[dict[str, float]]:
    """Per model stage, the compute of each action kind for one microbatch (a split
    backward's input and weight halves each take half the backward, as in `simulate`)."""
    durations = []
    for start, stop in partition.model_stages:
        forward = sum(layer.forward_s for layer in costs.layers[start:stop])
        backward = sum(layer.backward_s for layer in costs.layers[start:stop])
        durations.append({FORWARD: forward, BACKWARD: backward, BACKWARD_INPUT: backward / 2,
                          BACKWARD_WEIGHT: backward / 2})
    return durations


def _messages(action: Action, num_model_stages: int, num_ranks: int) -> int:
    """Boundary sides this action sends or receives on (a weight gradient touches none)."""
    if num_ranks == 1 or action.kind == BACKWARD_WEIGHT:
        return 0
    return (action.stage > 0) + (action.stage < num_model_stages - 1)


def _makespan(schedule: dict[int, list[Action]], num_model_stages: int, num_ranks: int,
              durations: list[dict[str, float]], hops: list[float], draw,
              action_overhead: float = 0.0) -> float:
    """One replay (`templates.schedule_simulator.replay`), with drawn message costs and transfers."""
    def duration(action: Action) -> float:
        messages = _messages(action, num_model_stages, num_ranks)
        return (durations[action.stage][action.kind] + action_overhead
                + sum(draw() for _ in range(messages)))

    def delay(dependency: Action, action: Action) -> float:
        crossed = dependency.stage % num_ranks != action.stage % num_ranks
        return hops[min(dependency.stage, action.stage)] if crossed else 0.0

    timeline = replay(schedule, num_model_stages, duration, delay)
    if isinstance(timeline, ScheduleDeadlock):  # build_schedule's lists never deadlock
        raise RuntimeError(f"replay of a {num_ranks}-rank schedule deadlocked: {timeline}")
    return max(end for events in timeline.values() for _, end, _ in events)
