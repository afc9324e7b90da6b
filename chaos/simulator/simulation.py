"""The simulation loop: a policy's decisions turned into time, tokens and node-seconds.

A policy (`planaria.chaos.simulator.policies`) decides, at the start and at every
change of the live nodes, what the job does next (`Outcome`): which nodes train at
what throughput, how long it is down first, and what work the change destroyed (the
iteration in flight, or everything since the last checkpoint). The engine owns the
clock and the books:

- work is kept at three levels: the iteration in flight (lost by any failure), the
  iterations committed since the last checkpoint (lost when the policy falls back to
  the checkpoint), and checkpointed work (never lost);
- every live node-second goes to exactly one account: `trained` (work that was kept),
  `redone` (work later lost), `checkpointing`, `recovering` (the job is down),
  `unused` (live but outside the plan) and `stalled` (too few nodes to train at all).
  They add up to the trace's node-seconds (the conservation test checks it);
- checkpoints: every `checkpoint_every_s` of training the job pauses for the plan's
  `checkpoint_s`, and the work before it becomes safe when the write completes.

A join does not destroy work: the job finishes its iteration first (it drains), then
reconfigures; Planaria's runtime stops at an iteration boundary when asked to.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from planaria.chaos.simulator.availability import Availability, Change

ACCOUNTS = ("trained", "redone", "checkpointing", "recovering", "unused", "stalled", "booting")
LOSSES = ("none", "iteration", "checkpoint")


@dataclass(frozen=True)
class Running:
    """A plan in force: the nodes it uses and what it trains."""

    nodes: int
    tokens_per_s: float
    iteration_s: float
    checkpoint_s: float = 0.0
    """The pause to write a checkpoint of this plan (0: the policy does not checkpoint)."""


@dataclass(frozen=True)
class Outcome:
    """A policy's decision at a change."""

    running: Running | None
    """What trains next; None when the job cannot train (too few nodes)."""
    downtime_s: float = 0.0
    """Down before `running` starts (after draining, for a join)."""
    lost: str = "none"
    """"none", "iteration" (the one in flight) or "checkpoint" (all since the last one)."""
    drain: bool = False
    """Finish the iteration in flight on the old plan first (a join)."""
    commit_partial: bool = False
    """The iteration in flight counts as committed: the switch happened at an iteration
    boundary before this moment (a planned leave, announced ahead)."""
    note: str = ""

    def __post_init__(self) -> None:
        if self.lost not in LOSSES:
            raise ValueError(f"lost must be one of {LOSSES}, got {self.lost!r}")
        if self.downtime_s < 0:
            raise ValueError(f"downtime must not be negative, got {self.downtime_s}")


@dataclass
class _Phase:
    kind: str  # "train", "down" or "stall"
    until: float
    running: Running | None = None


@dataclass
class SimResult:
    """One policy over one trace."""

    policy: str
    duration_s: float
    accounts: dict[str, float]
    """Node-seconds per account (see the module docstring)."""
    tokens: float
    train_s: float
    """Seconds in which the job trained work it kept."""
    events: list[dict] = field(default_factory=list)
    series: list[tuple[float, float, int, int]] = field(default_factory=list)
    """(time, tokens/s, live nodes, nodes training) from that time on."""
    token_times: list[tuple[float, float]] = field(default_factory=list)
    """(time, tokens kept so far) at each phase boundary, for time-to-target."""
    checkpoint_every_s: float = math.inf
    checkpoints: int = 0
    checkpoint_loads: int = 0
    stalled_at: list[float] = field(default_factory=list)

    @property
    def ettr(self) -> float:
        """Effective training time ratio: time spent on work that was kept / wall time."""
        return self.train_s / self.duration_s if self.duration_s else 0.0

    def time_to_tokens(self, target: float) -> float | None:
        """When the kept tokens reach `target` for good (work later lost does not count);
        None when not within the trace."""
        points = [(0.0, 0.0), *self.token_times]
        if points[-1][1] < target:
            return None
        last_below = max(i for i, (_, tokens) in enumerate(points) if tokens < target) if target > 0 else None
        if last_below is None:
            return 0.0
        (t0, k0), (t1, k1) = points[last_below], points[last_below + 1]
        return t1 if k1 == k0 else t0 + (t1 - t0) * (target - k0) / (k1 - k0)


class _Books:
    """The three levels of work, and the node-second accounts."""

    def __init__(self) -> None:
        self.accounts = dict.fromkeys(ACCOUNTS, 0.0)
        self.safe_tokens = 0.0
        self.safe_train_s = 0.0
        # Since the last checkpoint, committed iterations: (tokens, train seconds, node-seconds).
        self.committed = [0.0, 0.0, 0.0]
        # The iteration in flight.
        self.partial = [0.0, 0.0, 0.0]
        self.partial_iteration_s = 0.0

    def train(self, running: Running, seconds: float, live: int) -> None:
        self.accounts["unused"] += (live - running.nodes) * seconds
        iteration = running.iteration_s
        room = iteration - self.partial_iteration_s
        if seconds < room * (1 - 1e-12):
            self._add(self.partial, running, seconds)
            self.partial_iteration_s += seconds
            return
        # Finish the iteration in flight, commit whole iterations at once, start the next.
        self._add(self.partial, running, room)
        self._commit_iteration()
        left = seconds - room
        whole = math.floor(left / iteration * (1 + 1e-12))
        self._add(self.committed, running, whole * iteration)
        left = max(0.0, left - whole * iteration)
        self._add(self.partial, running, left)
        self.partial_iteration_s = left

    def _add(self, bucket: list[float], running: Running, seconds: float) -> None:
        bucket[0] += running.tokens_per_s * seconds
        bucket[1] += seconds
        bucket[2] += running.nodes * seconds

    def commit_partial(self) -> None:
        """The iteration in flight was finished (at a boundary the model does not place)."""
        self._commit_iteration()
        self.partial_iteration_s = 0.0

    def _commit_iteration(self) -> None:
        for i in range(3):
            self.committed[i] += self.partial[i]
        self.partial = [0.0, 0.0, 0.0]
        self.partial_iteration_s = 0.0

    def checkpoint_done(self) -> None:
        """The write completed: committed iterations are safe (checkpoints are taken at
        iteration boundaries, so none is in flight)."""
        self.safe_tokens += self.committed[0]
        self.safe_train_s += self.committed[1]
        self.accounts["trained"] += self.committed[2]
        self.committed = [0.0, 0.0, 0.0]

    def lose(self, what: str) -> None:
        if what in ("iteration", "checkpoint"):
            self.accounts["redone"] += self.partial[2]
            self.partial = [0.0, 0.0, 0.0]
            self.partial_iteration_s = 0.0
        if what == "checkpoint":
            self.accounts["redone"] += self.committed[2]
            self.committed = [0.0, 0.0, 0.0]

    def restart_iteration(self) -> None:
        """A new plan starts a fresh iteration (whatever was in flight was drained or lost)."""
        self.lose("iteration")

    def close(self) -> None:
        """The trace ends: what the job holds in memory is kept."""
        self._commit_iteration()
        self.checkpoint_done()

    @property
    def kept_tokens(self) -> float:
        return self.safe_tokens + self.committed[0] + self.partial[0]


def simulate(policy, availability: Availability) -> SimResult:
    """Run `policy` over `availability` (see the module docstring)."""
    books = _Books()
    live = set(availability.initial)
    result = SimResult(policy.name, availability.duration_s, books.accounts, 0.0, 0.0,
                       checkpoint_every_s=policy.checkpoint_every_s)
    clock = _Clock(books, result, policy.checkpoint_every_s)
    clock.apply(0.0, policy.start(sorted(live)), len(live))
    for change in availability.changes:
        clock.advance(change.at_s, len(live))
        live = (live | set(change.added)) - set(change.removed)
        outcome = policy.change(change.at_s, change, sorted(live), clock.current)
        result.events.append(_event_record(change, outcome, len(live)))
        clock.apply(change.at_s, outcome, len(live))
    clock.advance(availability.duration_s, len(live))
    books.close()
    result.tokens = books.safe_tokens
    result.train_s = books.safe_train_s
    result.token_times.append((availability.duration_s, books.safe_tokens))
    return result


def _event_record(change: Change, outcome: Outcome, live: int) -> dict:
    return {"at_s": change.at_s, "added": len(change.added), "removed": len(change.removed),
            "live": live, "lost": outcome.lost, "downtime_s": outcome.downtime_s,
            "nodes_training": outcome.running.nodes if outcome.running else 0, "note": outcome.note}


class _Clock:
    """Phases in force (drain, down, train or stall) and the checkpoint cadence."""

    def __init__(self, books: _Books, result: SimResult, checkpoint_every_s: float):
        self.books, self.result = books, result
        self.every = checkpoint_every_s
        self.phases: list[_Phase] = []
        self.now = 0.0
        self.since_checkpoint_s = 0.0
        self.writing_left_s = 0.0  # of a checkpoint being written
        self.current: Running | None = None

    def apply(self, at: float, outcome: Outcome, live: int) -> None:
        if outcome.commit_partial:
            self.books.commit_partial()
        if outcome.lost != "none":
            self.books.lose(outcome.lost)
            if outcome.lost == "checkpoint":
                self.result.checkpoint_loads += 1
                self.since_checkpoint_s = 0.0
            self.writing_left_s = 0.0  # a write under way when the job fails is worthless
        # The plan training right now (a drain or a plan in force), not the latest decided.
        active = self.phases[0].running if self.phases and self.phases[0].kind == "train" else None
        self.phases = []
        start = at
        if outcome.drain and active is not None and self.books.partial_iteration_s > 0:
            start = at + max(0.0, active.iteration_s - self.books.partial_iteration_s)
            self.phases.append(_Phase("train", start, active))
        if outcome.running is None:
            self.phases.append(_Phase("stall", math.inf))
            self.result.stalled_at.append(at)
        else:
            if outcome.downtime_s > 0:
                self.phases.append(_Phase("down", start + outcome.downtime_s))
            self.phases.append(_Phase("train", math.inf, outcome.running))
        self.current = outcome.running

    def advance(self, to: float, live: int) -> None:
        while self.now < to and self.phases:
            phase = self.phases[0]
            end = min(to, phase.until)
            self._spend(phase, end, live)
            self.now = end
            if end >= phase.until:
                self.phases.pop(0)
                if phase.kind == "down" or (phase.kind == "train" and self.phases):
                    self.books.restart_iteration()  # drained: the next plan starts afresh
        self.now = to

    def _spend(self, phase: _Phase, end: float, live: int) -> None:
        accounts = self.books.accounts
        t = self.now
        if phase.kind != "train":
            accounts["recovering" if phase.kind == "down" else "stalled"] += live * (end - t)
            self._record(t, 0.0, live, 0)
            return
        running = phase.running
        self._record(t, running.tokens_per_s, live, running.nodes)
        while end - t > 1e-9:
            if self.writing_left_s > 0:
                pause = min(end - t, self.writing_left_s)
                accounts["checkpointing"] += running.nodes * pause
                accounts["unused"] += (live - running.nodes) * pause
                self.writing_left_s -= pause
                t += pause
                if self.writing_left_s <= 1e-9:
                    self.writing_left_s = 0.0
                    self._checkpointed(t)
                continue
            due = self.since_checkpoint_s >= self.every
            if due and self.books.partial_iteration_s == 0:  # at an iteration boundary
                self.since_checkpoint_s = 0.0
                if running.checkpoint_s > 0:
                    self.writing_left_s = running.checkpoint_s
                else:
                    self._checkpointed(t)
                continue
            room = (running.iteration_s - self.books.partial_iteration_s if due
                    else self.every - self.since_checkpoint_s)
            run = min(end - t, room)
            self.books.train(running, run, live)
            self.since_checkpoint_s += run
            t += run
        self.result.token_times.append((end, self.books.kept_tokens))

    def _checkpointed(self, at: float) -> None:
        self.books.checkpoint_done()
        self.result.checkpoints += 1
        self.result.token_times.append((at, self.books.kept_tokens))

    def _record(self, at: float, tokens_per_s: float, live: int, nodes: int) -> None:
        point = (at, tokens_per_s, live, nodes)
        series = self.result.series
        if series and series[-1][1:] == point[1:]:
            return
        series.append(point)
