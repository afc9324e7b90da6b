"""Pipeline schedules as data, and a simulator that checks them before anything runs.

This module owns:

* `Action`, one compute step: forward or backward of one model stage on one microbatch;
* the builders of the named schedules (`SCHEDULES`): each returns, per pipeline rank,
  the ordered list of that rank's compute actions;
* `check_schedule_shape`, which rejects (rank, chunk, microbatch) shapes a schedule
  cannot serve, with a message saying what to change;
* `simulate`, which replays the lists under ideal conditions (zero communication
  latency, fixed compute times) to prove the order cannot deadlock and to measure the
  pipeline bubble;
* `format_schedule`, for printing.

Stage numbering follows the looped (interleaved) convention: with `p` pipeline ranks
and `v` virtual stages (chunks) per rank there are `p*v` model stages, and model stage
`s` lives on rank `s % p` as that rank's local chunk `s // p`.

Turning actions into torch.distributed.pipelining `_Action`s and executing them is the
runtime's job. This module imports neither torch nor any other Planaria module, so a
schedule can be built and checked on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

from planaria.templates.plan import SCHEDULE_NAMES

FORWARD = "F"
BACKWARD = "B"
BACKWARD_INPUT = "I"
BACKWARD_WEIGHT = "W"
_SIMULATED_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)

SCHEDULES = SCHEDULE_NAMES  # the plan contract's list: one list of one thing


@dataclass(frozen=True)
class Action:
    """Run `kind` of model stage `stage` on microbatch `microbatch`.

    kind is "F" (forward), "B" (full backward: input and weight gradients), or, in
    zero-bubble schedules, "I" (input gradient only, which the previous stage waits
    for) and "W" (weight gradient, which nobody waits for and so can fill bubbles).
    """

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        # Same compact form torch prints for its actions, e.g. "1F0".
        return f"{self.stage}{self.kind}{self.microbatch}"


# ---------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------


def _is_positive_int(value: object) -> bool:
    # bool is an int subclass; True as a rank count is a bug, not a 1.
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _interleaved_rounds(num_ranks: int, num_microbatches: int) -> tuple[int, int]:
    """(rounds, microbatches per round) of the interleaved schedule.

    Megatron groups microbatches in rounds of `num_ranks`; like torch's "flexible"
    variant we allow fewer microbatches than ranks (one short round) and rounds
    longer than `num_ranks`, as long as the rounds are of equal size.
    """
    rounds = max(1, num_microbatches // num_ranks)
    return rounds, num_microbatches // rounds


def _interleaved_accepts(num_ranks: int, num_microbatches: int) -> bool:
    rounds, _ = _interleaved_rounds(num_ranks, num_microbatches)
    return num_microbatches % rounds == 0


def _interleaved_shape_error(num_ranks: int, num_microbatches: int) -> str:
    rounds, _ = _interleaved_rounds(num_ranks, num_microbatches)
    below = next(
        (m for m in range(num_microbatches - 1, 0, -1) if _interleaved_accepts(num_ranks, m)),
        None,
    )
    # Multiples of num_ranks are always accepted, so this search ends.
    above = next(m for m in count(num_microbatches + 1) if _interleaved_accepts(num_ranks, m))
    choices = f"{below} or {above}" if below is not None else str(above)
    return (
        f"schedule 'interleaved' runs microbatches in rounds of equal size: with "
        f"num_ranks={num_ranks}, num_microbatches={num_microbatches} makes {rounds} rounds, "
        f"which do not divide {num_microbatches}; use num_microbatches={choices} "
        f"(any multiple of num_ranks works)"
    )


def check_schedule_shape(
    name: str, num_ranks: int, virtual_stages: int, num_microbatches: int
) -> None:
    """Raise ValueError, saying what to change, if schedule `name` cannot serve this shape."""
    if name not in SCHEDULES:
        raise ValueError(
            f"unknown schedule {name!r}; valid schedules are: {', '.join(SCHEDULES)}"
        )
    sizes = (
        ("num_ranks", num_ranks),
        ("virtual_stages", virtual_stages),
        ("num_microbatches", num_microbatches),
    )
    for label, value in sizes:
        if not _is_positive_int(value):
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if name in ("gpipe", "1f1b", "zb1f1b") and virtual_stages != 1:
        raise ValueError(
            f"schedule {name!r} runs one stage per rank, but virtual_stages={virtual_stages}; "
            f"use schedule 'interleaved' for virtual_stages > 1, or set virtual_stages=1"
        )
    if name == "interleaved" and not _interleaved_accepts(num_ranks, num_microbatches):
        raise ValueError(_interleaved_shape_error(num_ranks, num_microbatches))


# ---------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------


def _one_forward_one_backward(
    forwards: list[Action], backwards: list[Action], warmup: int
) -> list[Action]:
    """Merge a rank's forward and backward orders the 1F1B way.

    `warmup` forwards first (to fill the pipeline), then one forward and one backward
    alternately until the forwards run out, then the remaining backwards (cooldown).
    Alternating caps the activations a rank holds at warmup + 1 microbatches.
    """
    order = forwards[:warmup]
    steady = len(forwards) - warmup
    for i in range(steady):
        order.append(forwards[warmup + i])
        order.append(backwards[i])
    order.extend(backwards[steady:])
    return order


def _gpipe(num_ranks: int, num_microbatches: int) -> dict[int, list[Action]]:
    schedule = {}
    for rank in range(num_ranks):
        forwards = [Action(rank, FORWARD, mb) for mb in range(num_microbatches)]
        backwards = [Action(rank, BACKWARD, mb) for mb in range(num_microbatches)]
        schedule[rank] = forwards + backwards
    return schedule


def _1f1b(num_ranks: int, num_microbatches: int) -> dict[int, list[Action]]:
    schedule = {}
    for rank in range(num_ranks):
        forwards = [Action(rank, FORWARD, mb) for mb in range(num_microbatches)]
        backwards = [Action(rank, BACKWARD, mb) for mb in range(num_microbatches)]
        # A rank must have enough forwards in flight that the first microbatch can reach
        # the last stage and come back: one per downstream rank.
        warmup = min(num_ranks - rank - 1, num_microbatches)
        schedule[rank] = _one_forward_one_backward(forwards, backwards, warmup)
    return schedule


def _interleaved_order(
    num_ranks: int, rank: int, num_microbatches: int, kind: str, chunks: range
) -> list[Action]:
    """A rank's actions of one kind, depth-first: round by round, chunk by chunk."""
    rounds, per_round = _interleaved_rounds(num_ranks, num_microbatches)
    return [
        Action(chunk * num_ranks + rank, kind, r * per_round + i)
        for r in range(rounds)
        for chunk in chunks
        for i in range(per_round)
    ]


def _interleaved(
    num_ranks: int, virtual_stages: int, num_microbatches: int
) -> dict[int, list[Action]]:
    _, per_round = _interleaved_rounds(num_ranks, num_microbatches)
    schedule = {}
    for rank in range(num_ranks):
        chunks = range(virtual_stages)
        forwards = _interleaved_order(num_ranks, rank, num_microbatches, FORWARD, chunks)
        backwards = _interleaved_order(
            num_ranks, rank, num_microbatches, BACKWARD, chunks[::-1]
        )
        # Megatron's warmup: the last rank must run a whole round through every chunk but
        # its last before the first backward can start there; each rank further up needs
        # two more forwards in flight, one for each direction of the extra hop.
        warmup = (virtual_stages - 1) * per_round + 2 * (num_ranks - 1 - rank)
        warmup = min(warmup, num_microbatches * virtual_stages)
        schedule[rank] = _one_forward_one_backward(forwards, backwards, warmup)
    return schedule


def _zb1f1b(num_ranks: int, num_microbatches: int) -> dict[int, list[Action]]:
    """1F1B with split backwards, in the spirit of ZB-H1 (Qi et al., "Zero Bubble
    Pipeline Parallelism", ICLR 2024).

    Each backward is split into I (input gradient, which the previous stage waits for)
    and W (weight gradient, which nobody waits for). The order comes from list
    scheduling with unit times: each rank, whenever it is free, runs the ready action
    that can start first, preferring I (the critical path), then F, then W, so W's fill
    time that 1F1B spends waiting. Rank r keeps at most `num_ranks - r` microbatches
    alive (forwarded, weight gradient not yet done): the activation bound of 1F1B,
    since W still needs the layer inputs. With F = I = W the bubble is 2(p-1)/(3m),
    two thirds of 1F1B's (p-1)/m. (The paper's ZB-H1 reaches one third by counting
    a pending W as cheaper than a whole microbatch of activations.)

    A fixed per-rank order that completes once can never deadlock, whatever the real
    durations turn out to be, so unit times are enough to derive it.
    """
    p, m = num_ranks, num_microbatches
    finish: dict[Action, float] = {}
    order: dict[int, list[Action]] = {r: [] for r in range(p)}
    free_at = [0.0] * p
    next_forward, next_input = [0] * p, [0] * p
    pending_weight: list[list[int]] = [[] for _ in range(p)]
    weights_done = [0] * p
    for _ in range(3 * p * m):
        best = None
        for r in range(p):
            for priority, action, deps in _zb1f1b_candidates(
                    r, p, m, next_forward, next_input, pending_weight, weights_done):
                if any(d not in finish for d in deps):
                    continue
                start = max([free_at[r]] + [finish[d] for d in deps])
                if best is None or (start, priority, r) < best[0]:
                    best = ((start, priority, r), action)
        (start, _, r), action = best
        finish[action] = free_at[r] = start + 1.0
        order[r].append(action)
        if action.kind == FORWARD:
            next_forward[r] += 1
        elif action.kind == BACKWARD_INPUT:
            next_input[r] += 1
            pending_weight[r].append(action.microbatch)
        else:
            pending_weight[r].pop(0)
            weights_done[r] += 1
    return order


def _zb1f1b_candidates(r, p, m, next_forward, next_input, pending_weight, weights_done):
    """(priority, action, dependencies) rank r could run next: I, then F, then W."""
    if next_input[r] < next_forward[r]:
        mb = next_input[r]
        deps = [Action(r, FORWARD, mb)] + ([Action(r + 1, BACKWARD_INPUT, mb)] if r < p - 1 else [])
        yield 0, Action(r, BACKWARD_INPUT, mb), deps
    if next_forward[r] < m and next_forward[r] - weights_done[r] < p - r:
        mb = next_forward[r]
        yield 1, Action(r, FORWARD, mb), ([Action(r - 1, FORWARD, mb)] if r > 0 else [])
    if pending_weight[r]:
        mb = pending_weight[r][0]
        yield 2, Action(r, BACKWARD_WEIGHT, mb), [Action(r, BACKWARD_INPUT, mb)]


def build_schedule(
    name: str, num_ranks: int, virtual_stages: int, num_microbatches: int
) -> dict[int, list[Action]]:
    """Per pipeline rank, the ordered compute actions of schedule `name`."""
    check_schedule_shape(name, num_ranks, virtual_stages, num_microbatches)
    if name == "gpipe":
        return _gpipe(num_ranks, num_microbatches)
    if name == "1f1b":
        return _1f1b(num_ranks, num_microbatches)
    if name == "zb1f1b":
        return _zb1f1b(num_ranks, num_microbatches)
    return _interleaved(num_ranks, virtual_stages, num_microbatches)


# ---------------------------------------------------------------------------
# Simulation
# ---------------------------------------------------------------------------


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
        if not _is_positive_int(value):
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


def format_schedule(schedule: dict[int, list[Action]]) -> str:
    """One line per rank, actions in compact form, padded into columns by step."""
    width = max((len(str(a)) for actions in schedule.values() for a in actions), default=0)
    lines = []
    for rank in sorted(schedule):
        cells = " ".join(str(action).ljust(width) for action in schedule[rank])
        lines.append(f"rank {rank}: {cells}".rstrip())
    return "\n".join(lines)
