"""The data plane of simulated workers: where an epoch's steps meet, in memory.

A real epoch's workers meet in every step's collectives, and the commit all-reduce
carries a stop request, so that all of them stop after the same iteration (docs/recovery.md).
Simulated workers meet here instead: `StepBarrier.step` returns once every rank of the
epoch arrived for the iteration, with the OR of their stop requests, and blocks, like a
collective, while a rank is missing (dead, or cut off) until that rank's own collectives
are released (`release`: what the epoch watcher does on a failure). A rank whose
process died (`fail`) fails every other rank's step at once, as gloo's collectives fail
on a connection its peer's death closed. A join's groups connected ahead end with a
barrier over the prepared world (`PreparedGroups`), which completes on every rank or on
none: its ranks meet in a barrier of its own (`connect_barrier`), its one all-reduce bounded by
their connect timeout. None of it touches the control plane: it is what the harness
simulates, not what it measures.
"""
from __future__ import annotations

import threading
import time


WAKE_S = 5.0
"""How long a waiting rank sleeps before it looks again, unwoken: every change that can
decide a step (the last arrival, a release, a death) wakes the waiters at once; the look
is only a guard."""


class Released(RuntimeError):
    """This rank's collectives of the epoch were released (the control plane ended it)."""


class PeerGone(RuntimeError):
    """A rank of the epoch died: the collectives of the others fail."""


class StepBarrier:
    """The commit all-reduce of one epoch's `world` ranks."""

    def __init__(self, world: int):
        self.world = world
        self._cond = threading.Condition()
        self._arrived: dict[int, set[int]] = {}
        self._stop: dict[int, bool] = {}
        self._released: set[int] = set()
        self._dead: set[int] = set()
        self._outcome: dict[int, bool] = {}
        """Each iteration's all-reduce: completed (True) or failed (False), once decided."""
        self._blocked = False

    def step(self, rank: int, iteration: int, stop: bool, timeout_s: float | None = None) -> bool:
        """Wait for every rank at `iteration`; True when any asked to stop after it.
        `timeout_s`: how long it waits at most, as a real collective's timeout bounds it;
        undecided then, it fails for every rank (this one counted as dead: a real rank
        whose collective timed out drops its connections)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            arrived = self._arrived.setdefault(iteration, set())
            arrived.add(rank)
            self._stop[iteration] = self._stop.get(iteration, False) or stop
            while True:
                # One outcome per all-reduce, the first decided: it completed for every rank
                # once all entered it (a peer dying later fails the next one), or it failed
                # for every rank once one failed in it, even if the last rank to come finds
                # them all there (the exactly-once rule counts on it: docs/recovery.md).
                outcome = self._outcome.get(iteration)
                if outcome is None:
                    if len(arrived) >= self.world and not self._blocked:
                        outcome = self._outcome[iteration] = True
                    elif rank in self._released or self._dead - {rank}:
                        outcome = self._outcome[iteration] = False
                    if outcome is not None:
                        # The others learn it now. Only a decision wakes them: waking every
                        # waiting rank at each arrival made a step of N ranks N^2 wakes
                        # (67 million at 8,192 simulated workers).
                        self._cond.notify_all()
                if outcome:
                    return self._stop[iteration]
                if outcome is not None:
                    if rank in self._released:
                        raise Released(f"rank {rank}: released at iteration {iteration}")
                    raise PeerGone(_closed(rank, sorted(self._dead), iteration))
                if deadline is not None and time.monotonic() >= deadline:
                    self._outcome[iteration] = False
                    self._dead.add(rank)
                    self._cond.notify_all()
                    raise PeerGone(_timed_out(rank, iteration, timeout_s))
                self._cond.wait(WAKE_S if deadline is None else min(WAKE_S, max(0.0, deadline - time.monotonic())))

    def work(self, rank: int, iteration: int, seconds: float) -> None:
        """The step's computation, `seconds` long, whose collectives fail as soon as a peer
        dies or this rank is released: a real step's first collective fails within
        milliseconds of a peer's death (or of its release), not at the step's end."""
        with self._cond:
            self._cond.wait_for(lambda: rank in self._released or self._dead - {rank}, seconds)
            _raise_if_over(rank, iteration, self._released, self._dead)

    def release(self, rank: int) -> str:
        with self._cond:
            self._released.add(rank)
            self._cond.notify_all()
        return "released the simulated step"

    def fail(self, rank: int) -> None:
        """Rank `rank`'s process died: the others' steps fail, now or when they come."""
        with self._cond:
            self._dead.add(rank)
            self._cond.notify_all()

    def block(self) -> None:
        """No step completes any more (a partition across the epoch's groups)."""
        with self._cond:
            self._blocked = True


def connect_barrier(epoch: int) -> tuple[str, int]:
    """The key, among a data plane's epochs, of the barrier that ends the connection
    ahead of `epoch`'s groups: apart from the epoch's steps, whose barrier a rank that
    failed to connect ahead must not fail (the epoch then trains after a rendezvous)."""
    return ("prepared", epoch)


class DataPlane:
    """The step barriers of every epoch, made by the first rank that asks."""

    def __init__(self):
        self._lock = threading.Lock()
        self._epochs: dict[int, StepBarrier] = {}

    def epoch(self, epoch: int, world: int) -> StepBarrier:
        with self._lock:
            return self._epochs.setdefault(epoch, StepBarrier(world))

    def block_all(self) -> None:
        with self._lock:
            for barrier in self._epochs.values():
                barrier.block()


class RankRelease:
    """What `EpochWatcher` calls on a failure (`release.release()`), for one rank."""

    def __init__(self, barrier: StepBarrier, rank: int):
        self.barrier, self.rank = barrier, rank

    def release(self) -> str:
        return self.barrier.release(self.rank)


def _raise_if_over(rank: int, iteration: int, released, dead) -> None:
    """What a rank's collective raises once it was released, or a peer died."""
    if rank in released:
        raise Released(f"rank {rank}: released at iteration {iteration}")
    if set(dead) - {rank}:
        raise PeerGone(_closed(rank, sorted(dead), iteration))


def _timed_out(rank: int, iteration: int, timeout_s: float) -> str:
    """A rank's error when its collective timed out (gloo's words, about as long)."""
    return (f"[simulated gloo/transport/tcp/unbound_buffer.cc] Timed out waiting {timeout_s:.0f} s for the "
            f"collective of iteration {iteration} (rank {rank}): a peer never entered it.")


def _closed(rank: int, dead: list[int], iteration: int) -> str:
    """A survivor's error, in the words (and about the length) of gloo's: what its
    timing record reports."""
    return (f"[simulated gloo/transport/tcp/pair.cc] Connection closed by peer rank(s) {dead} (rank {rank}, "
            f"iteration {iteration}). This is typically caused by a remote worker crashing. Check the logs "
            "of the remote worker before reporting an error.")
