"""The simulated commit all-reduce across the harness's node processes.

At a thousand nodes the scale harness runs its nodes in several processes
(`node_host`): one interpreter does not carry thousands of agents', relays' and
workers' threads (docs/benchmarks.md). An epoch's ranks then sit in several processes,
and its steps must still meet as `data_plane.StepBarrier`'s do: every rank stops after
the same iteration, and a rank's release or death fails the step for all.

`StepHub` (the harness's process) decides each iteration's outcome by the same rule as
`StepBarrier`, from what the hosts tell it; `HostedDataPlane` (in each node process)
is `DataPlane`'s interface for the simulated workers. Arrivals are batched per host
(one message for all of a host's ranks that arrived within a few milliseconds), so the
messages per step grow with the hosts, not the workers. None of it touches etcd: it is
the data plane, simulated, not what the harness measures.
"""
from __future__ import annotations

import queue
import threading
from collections import defaultdict
from dataclasses import dataclass, field

from planaria.chaos.scale.data_plane import WAKE_S, PeerGone, Released, _closed, _raise_if_over, _timed_out

FLUSH_S = 0.002
"""How long a host gathers arrivals before it sends them (a step is a second or two)."""


@dataclass
class _Epoch:
    """The hub's view of one epoch's commit all-reduces."""

    world: int
    arrived: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    stop: dict[int, bool] = field(default_factory=lambda: defaultdict(bool))
    released_in: set[int] = field(default_factory=set)
    """Iterations that a released rank entered (or was waiting in when released)."""
    dead: set[int] = field(default_factory=set)
    dead_waiting: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Ranks that died while waiting in an iteration, by iteration (not "others" waiting)."""
    blocked: bool = False
    outcome: dict[int, bool] = field(default_factory=dict)

    def decide(self, iteration: int) -> bool | None:
        """`StepBarrier.step`'s rule: complete once every rank entered (unless blocked);
        failed once a released rank is in it or a rank died while others wait in it."""
        if iteration in self.outcome:
            return None
        if self.arrived[iteration] >= self.world and not self.blocked:
            self.outcome[iteration] = True
        elif iteration in self.released_in or (self.dead and self.arrived[iteration] > self.dead_waiting[iteration]):
            self.outcome[iteration] = False
        else:
            return None
        return self.outcome[iteration]


class StepHub:
    """Every epoch's commit all-reduces, decided for all node processes. `apply` takes a
    host's batch and returns the decisions it made, to be sent to every host."""

    def __init__(self):
        self._lock = threading.Lock()
        self._epochs: dict[int, _Epoch] = {}

    def apply(self, batches) -> list[tuple]:
        """`batches`: one batch (a dict) or several in the order they happened, each
        decided on before the next is taken (a death before the last arrival fails the
        iteration, as it would have in one process)."""
        decided = []
        for batch in [batches] if isinstance(batches, dict) else batches:
            decided += self._apply(batch)
        return decided

    def _apply(self, batch: dict) -> list[tuple]:
        decided = []
        with self._lock:
            for epoch, world in batch.get("worlds", {}).items():
                self._epochs.setdefault(epoch, _Epoch(world))
            for (epoch, iteration), (count, stop, released) in batch.get("arrived", {}).items():
                state = self._epochs[epoch]  # a host names an epoch's world before its first arrival
                state.arrived[iteration] += count
                state.stop[iteration] = state.stop[iteration] or stop
                if released:
                    state.released_in.add(iteration)
            for epoch, iteration in batch.get("released", []):
                self._epochs[epoch].released_in.add(iteration)
            for epoch, rank, waiting_in in batch.get("dead", []):
                state = self._epochs[epoch]  # (a rank dies in an epoch its host named)
                state.dead.add(rank)
                if waiting_in is not None:
                    state.dead_waiting[waiting_in] += 1
            if batch.get("block"):
                for state in self._epochs.values():
                    state.blocked = True
            for epoch, state in self._epochs.items():
                for iteration in list(state.arrived):
                    outcome = state.decide(iteration)
                    if outcome is not None:
                        decided.append((epoch, iteration, outcome, state.stop[iteration], sorted(state.dead)))
        return decided

    def block_all(self) -> list[tuple]:
        return self.apply({"block": True})


class HostedStepBarrier:
    """`StepBarrier`'s interface for the ranks of one epoch in this node process."""

    def __init__(self, plane: "HostedDataPlane", epoch: int):
        self.plane, self.epoch = plane, epoch
        self._waiting: dict[int, int] = {}
        """Rank -> the iteration it waits in."""
        self._released: set[int] = set()

    def step(self, rank: int, iteration: int, stop: bool, timeout_s: float | None = None) -> bool:
        """`StepBarrier.step`. Timed out undecided, the rank tells the hub it died, not
        waiting in it (which fails the all-reduce for every rank, as a real rank's
        dropped connections do), and waits as long again for the hub's word: the hub
        may have decided it complete before the word came."""
        plane, key = self.plane, (self.epoch, iteration)
        with plane.cond:
            self._waiting[rank] = iteration
            plane.send_arrival(self.epoch, iteration, stop, rank in self._released)
            try:
                if timeout_s is None:
                    while key not in plane.outcomes:
                        plane.cond.wait(WAKE_S)  # `on_decided` wakes it
                elif not plane.cond.wait_for(lambda: key in plane.outcomes, timeout_s):
                    self.plane.send({"dead": [(self.epoch, rank, None)]})
                    if not plane.cond.wait_for(lambda: key in plane.outcomes, timeout_s):
                        raise PeerGone(_timed_out(rank, iteration, timeout_s))
            finally:
                self._waiting.pop(rank, None)
            ok, stop_after, dead = plane.outcomes[(self.epoch, iteration)]
            if ok:
                return stop_after
            if rank in self._released:
                raise Released(f"rank {rank}: released at iteration {iteration}")
            raise PeerGone(_closed(rank, dead, iteration))

    def work(self, rank: int, iteration: int, seconds: float) -> None:
        """`StepBarrier.work`: a death anywhere in the epoch comes from the hub."""
        plane = self.plane
        with plane.cond:
            plane.cond.wait_for(lambda: rank in self._released or plane.deaths.get(self.epoch, set()) - {rank},
                                seconds)
            _raise_if_over(rank, iteration, self._released, plane.deaths.get(self.epoch, set()))

    def release(self, rank: int) -> str:
        with self.plane.cond:
            self._released.add(rank)
            self.plane.cond.notify_all()
            if rank in self._waiting:
                self.plane.send({"released": [(self.epoch, self._waiting[rank])]})
        return "released the simulated step"

    def fail(self, rank: int) -> None:
        with self.plane.cond:
            self.plane.send({"dead": [(self.epoch, rank, self._waiting.get(rank))]})


class HostedDataPlane:
    """`DataPlane`'s interface in a node process: the barriers' decisions come from the
    harness's `StepHub` over `link` (a `multiprocessing` connection), which `on_decided`
    is given by this process's reader of it."""

    def __init__(self, link):
        self.link = link
        self.cond = threading.Condition()
        self.outcomes: dict[tuple[int, int], tuple[bool, bool, list[int]]] = {}
        self.deaths: dict[int, set[int]] = {}
        """The ranks of each epoch that died, anywhere (the hub's word)."""
        self._epochs: dict[int, HostedStepBarrier] = {}
        self._worlds: dict[int, int] = {}
        self._outbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._sender, daemon=True, name="step-hub-sender").start()

    def epoch(self, epoch: int, world: int) -> HostedStepBarrier:
        with self.cond:
            if epoch not in self._epochs:
                self._epochs[epoch] = HostedStepBarrier(self, epoch)
                self.send({"worlds": {epoch: world}})
            return self._epochs[epoch]

    def block_all(self) -> None:
        self.send({"block": True})

    def send_arrival(self, epoch: int, iteration: int, stop: bool, released: bool) -> None:
        self._outbox.put(("arrived", (epoch, iteration), stop, released))

    def send(self, batch: dict) -> None:
        self._outbox.put(("batch", batch))

    def on_decided(self, decisions) -> None:
        """The hub's decisions (a list), or its word of deaths (`{"deaths": [(epoch, rank)]}`)."""
        with self.cond:
            if isinstance(decisions, dict):
                for epoch, rank in decisions["deaths"]:
                    self.deaths.setdefault(epoch, set()).add(rank)
                self.cond.notify_all()
                return
            for epoch, iteration, ok, stop, dead in decisions:
                self.outcomes[(epoch, iteration)] = (ok, stop, dead)
            self.cond.notify_all()

    def _sender(self) -> None:
        """One message per few milliseconds: every arrival gathered, merged by iteration."""
        while True:
            items = [self._outbox.get()]
            try:
                threading.Event().wait(FLUSH_S)
                while True:
                    items.append(self._outbox.get_nowait())
            except queue.Empty:
                pass
            try:
                self.link.send(("plane", _in_order(items)))
            except (OSError, EOFError):
                return


def _in_order(items: list[tuple]) -> list[dict]:
    """A host's messages of a few milliseconds as batches in their order: consecutive
    arrivals merged by iteration into one batch, every other message a batch of its own
    (a death or a release between two arrivals stays between them)."""
    batches: list[dict] = []
    for item in items:
        if item[0] == "arrived":
            _, key, stop, released = item
            if not batches or "arrived" not in batches[-1]:
                batches.append({"arrived": {}})
            arrived = batches[-1]["arrived"]
            count, any_stop, any_released = arrived.get(key, (0, False, False))
            arrived[key] = (count + 1, any_stop or stop, any_released or released)
        else:
            batches.append(item[1])
    return batches
