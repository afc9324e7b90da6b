"""Pipeline schedules as data: per pipeline rank, the ordered list of compute actions.

This module owns:

* `Action`, one compute step: forward or backward of one model stage on one microbatch;
* the builders of the named schedules (`SCHEDULES`): each returns, per pipeline rank,
  the ordered list of that rank's compute actions;
* `check_schedule_shape`, which rejects (rank, chunk, microbatch) shapes a schedule
  cannot serve, with a message saying what to change;
* `format_schedule`, for printing.

`templates/schedule_simulator.py` checks these lists before anything runs: it refuses
incomplete ones, finds deadlocks and measures the bubble.

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


def is_positive_int(value: object) -> bool:
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
        if not is_positive_int(value):
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


def format_schedule(schedule: dict[int, list[Action]]) -> str:
    """One line per rank, actions in compact form, padded into columns by step."""
    width = max((len(str(a)) for actions in schedule.values() for a in actions), default=0)
    lines = []
    for rank in sorted(schedule):
        cells = " ".join(str(action).ljust(width) for action in schedule[rank])
        lines.append(f"rank {rank}: {cells}".rstrip())
    return "\n".join(lines)
