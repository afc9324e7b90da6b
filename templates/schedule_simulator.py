"""The simulator of pipeline schedules: it replays the action lists of
`templates/schedules.py` before anything runs.

This module owns:

* `simulate`, which replays the lists under ideal conditions (zero communication
  latency, fixed compute times) to prove the order cannot deadlock and to measure the
  pipeline bubble; it first refuses lists that are incomplete, mixed (B with I and W)
  or that put an action on the wrong rank;
* `replay`, the replay itself, with any action durations and message delays (the plan
  report's `templates/replay.py` draws them);
* `ScheduleDeadlock`, which names every rank's blocked action and what it waits for.

Like the schedules, it imports neither torch nor anything of Planaria's but the
schedules.
"""

from __future__ import annotations

from dataclasses import dataclass

from planaria.templates.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    is_positive_int,
)

_SIMULATED_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)


@dataclass(frozen=True)
class SimulationResult:
    """Outcome of `simulate`.

    bubble_fraction is (makespan - ideal) / ideal, where ideal is the largest per-rank
    busy time: the makespan a perfectly overlapped pipeline would reach.
    timeline holds, per rank, (start, end, action) in execution order.
    """

    makespan: float
    busy_time: dict[int, float]
    bubble_fraction: float
    timeline: dict[int, list[tuple[float, float, Action]]]


class ScheduleDeadlock(RuntimeError):
    """No rank can run its next action while actions remain.

    `blocked` maps each unfinished rank to the action it is stuck on.
    """

    def __init__(self, message: str, blocked: dict[int, Action]):
        super().__init__(message)
        self.blocked = blocked


def _dependencies(action: Action, num_stages: int, split_backward: bool = False) -> list[Action]:
    """Actions that must finish before `action` can start.

    `split_backward`: the schedule splits backwards into I and W, so the gradient a
    stage receives comes from the next stage's I rather than its B.
    """
    if action.kind == FORWARD:
        # The forward needs the previous stage's output activations.
        if action.stage == 0:
            return []
        return [Action(action.stage - 1, FORWARD, action.microbatch)]
    if action.kind == BACKWARD_WEIGHT:
        # The weight gradient needs the gradient of the stage's outputs, which I computed.
        return [Action(action.stage, BACKWARD_INPUT, action.microbatch)]
    # The backward needs its own stage's saved activations and the gradient coming
    # from the next stage.
    deps = [Action(action.stage, FORWARD, action.microbatch)]
    if action.stage < num_stages - 1:
        upstream_kind = BACKWARD_INPUT if split_backward else BACKWARD
        deps.append(Action(action.stage + 1, upstream_kind, action.microbatch))
    return deps


def _splits_backward(schedule: dict[int, list[Action]]) -> bool:
    return any(a.kind == BACKWARD_INPUT for actions in schedule.values() for a in actions)


def _check_actions(schedule: dict[int, list[Action]], num_ranks: int, num_stages: int,
                   num_microbatches: int) -> set[Action]:
    """Check every action is well-formed and on its stage's rank; return the set seen."""
    seen: set[Action] = set()
    for rank, actions in schedule.items():
        for action in actions:
            if action.kind not in _SIMULATED_KINDS:
                raise ValueError(
                    f"rank {rank}: action {action} has kind {action.kind!r}; "
                    f"the simulator handles {' and '.join(_SIMULATED_KINDS)} only"
                )
            if not (0 <= action.stage < num_stages and 0 <= action.microbatch < num_microbatches):
                raise ValueError(
                    f"rank {rank}: action {action} is out of range: stages are "
                    f"0..{num_stages - 1}, microbatches 0..{num_microbatches - 1}"
                )
            if action.stage % num_ranks != rank:
                raise ValueError(
                    f"rank {rank}: action {action} belongs on rank {action.stage % num_ranks} "
                    f"(model stage s lives on rank s % num_ranks)"
                )
            if action in seen:
                raise ValueError(f"rank {rank}: action {action} appears more than once")
            seen.add(action)
    return seen


def _check_complete(schedule: dict[int, list[Action]], num_ranks: int, virtual_stages: int,
                    num_microbatches: int) -> None:
    """Raise ValueError unless each (stage, microbatch) has one F, and one B or one I and one W.

    A schedule either splits all its backwards into I and W or none of them.
    """
    for label, value in (("num_ranks", num_ranks), ("virtual_stages", virtual_stages),
                         ("num_microbatches", num_microbatches)):
        if not is_positive_int(value):
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if set(schedule) != set(range(num_ranks)):
        raise ValueError(
            f"schedule must have one action list per rank 0..{num_ranks - 1}, "
            f"got ranks {sorted(schedule)}"
        )
    num_stages = num_ranks * virtual_stages
    seen = _check_actions(schedule, num_ranks, num_stages, num_microbatches)
    kinds = ((FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) if _splits_backward(schedule)
             else (FORWARD, BACKWARD))
    unexpected = [a for a in seen if a.kind not in kinds]
    if unexpected:
        raise ValueError(f"schedule mixes full backwards (B) with split ones (I, W): {unexpected[0]}")
    missing = [
        Action(stage, kind, mb)
        for stage in range(num_stages)
        for kind in kinds
        for mb in range(num_microbatches)
        if Action(stage, kind, mb) not in seen
    ]
    if missing:
        shown = ", ".join(
            f"{action} (rank {action.stage % num_ranks})" for action in missing[:6]
        )
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise ValueError(f"schedule is incomplete: missing {shown}{more}")


def _deadlock(schedule: dict[int, list[Action]], next_index: dict[int, int],
              finished: dict[Action, float], num_ranks: int, num_stages: int,
              split_backward: bool) -> ScheduleDeadlock:
    """Build the error naming every rank's blocked action and what it waits for."""
    lines = []
    blocked = {}
    for rank in sorted(schedule):
        actions, i = schedule[rank], next_index[rank]
        if i == len(actions):
            lines.append(f"rank {rank}: finished")
            continue
        action = actions[i]
        blocked[rank] = action
        waiting = ", ".join(
            f"{dep} (rank {dep.stage % num_ranks})"
            for dep in _dependencies(action, num_stages, split_backward)
            if dep not in finished
        )
        lines.append(f"rank {rank}: blocked at {action} (step {i}), waiting for {waiting}")
    message = "schedule deadlocks, no rank can run its next action:\n  " + "\n  ".join(lines)
    return ScheduleDeadlock(message, blocked)


def simulate(
    schedule: dict[int, list[Action]],
    num_ranks: int,
    virtual_stages: int,
    num_microbatches: int,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
) -> SimulationResult:
    """Replay `schedule` with zero communication latency; raise ScheduleDeadlock if it hangs.

    Each rank runs its list strictly in order, one action at a time, starting each as
    soon as the rank is free and the action's dependencies have finished (`replay`). A
    chunk holds 1/virtual_stages of its rank's layers, so one chunk's forward takes
    forward_time / virtual_stages (likewise backward). A split backward's I and W
    each take half of backward_time.
    """
    _check_complete(schedule, num_ranks, virtual_stages, num_microbatches)
    if not (forward_time > 0 and backward_time > 0):
        raise ValueError(
            f"forward_time and backward_time must be positive, got {forward_time}, {backward_time}"
        )
    num_stages = num_ranks * virtual_stages
    duration = {FORWARD: forward_time / virtual_stages, BACKWARD: backward_time / virtual_stages,
                BACKWARD_INPUT: backward_time / virtual_stages / 2,
                BACKWARD_WEIGHT: backward_time / virtual_stages / 2}
    timeline = replay(schedule, num_stages, lambda action: duration[action.kind])
    if isinstance(timeline, ScheduleDeadlock):
        raise timeline
    return _result(timeline)


def replay(schedule: dict[int, list[Action]], num_stages: int, duration,
           delay=lambda dependency, action: 0.0):
    """Each rank's timeline of (start, end, action), or the ScheduleDeadlock if it hangs.

    `duration(action)`: how long the action runs; `delay(dependency, action)`: how long
    after `dependency` ends its result reaches `action` (a message's transfer time).
    Because the order per rank is fixed and ranks share nothing, an action's start time
    is max(end of the rank's previous action, arrivals of its dependencies), whatever
    order we evaluate ranks in; so ranks advance in sweeps until all finish (the same
    times an event queue would produce) or a sweep advances none (a deadlock).
    """
    split = _splits_backward(schedule)
    finished: dict[Action, float] = {}
    next_index = {rank: 0 for rank in schedule}
    timeline: dict[int, list[tuple[float, float, Action]]] = {rank: [] for rank in schedule}
    remaining = sum(len(actions) for actions in schedule.values())
    while remaining:
        advanced = 0
        for rank, actions in schedule.items():
            while next_index[rank] < len(actions):
                action = actions[next_index[rank]]
                deps = _dependencies(action, num_stages, split)
                if any(dep not in finished for dep in deps):
                    break
                rank_free = timeline[rank][-1][1] if timeline[rank] else 0.0
                start = max([rank_free] + [finished[dep] + delay(dep, action) for dep in deps])
                end = start + max(duration(action), 0.0)
                finished[action] = end
                timeline[rank].append((start, end, action))
                next_index[rank] += 1
                advanced += 1
        if not advanced:
            return _deadlock(schedule, next_index, finished, len(schedule), num_stages, split)
        remaining -= advanced
    return timeline


def _result(timeline: dict[int, list[tuple[float, float, Action]]]) -> SimulationResult:
    makespan = max(end for events in timeline.values() for _, end, _ in events)
    busy = {rank: sum(end - start for start, end, _ in events) for rank, events in timeline.items()}
    ideal = max(busy.values())
    return SimulationResult(
        makespan=makespan,
        busy_time=busy,
        bubble_fraction=(makespan - ideal) / ideal,
        timeline=timeline,
    )
