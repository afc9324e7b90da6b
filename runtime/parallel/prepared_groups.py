"""An epoch's process groups connected while the epoch before it still trains (a join's).

A join's next epoch is planned and written as prepared before its stop is asked for
(`planaria.elastic.leave_planning`, `EpochRecord.connect_ahead`). Its workers, the
survivors still training and the joiners, connect that epoch's world and every group
`EpochGroups.build` will create (`creation_order`), each a backend made directly on the
epoch's bootstrap store, on a thread of their own (`PreparedGroups.start`); a barrier over
the world ends it. A barrier that returned anywhere means that every rank entered it, so
had connected all its groups: a survivor lets the epoch in force stop only then
(`EpochWatcher`), and the switch at the step boundary holds no rendezvous.

At the switch the connected backends become torch's groups through torch's extension
point for third-party backends (`Backend.register_backend`): `init_process_group` and
each `dist.new_group` of the epoch call the registered creator, which hands them out in
creation order (`install`). They are then registered like any other group, which
torch.distributed.pipelining needs (its stages translate ranks through the registry:
`get_rank(group)`, `get_global_rank`). A group made outside the registry would not do,
and torch has one default group per process: the next epoch's world cannot be
initialised while the current one trains.

Every rank decides alone whether it enters over the prepared groups (they connected) or
over a fresh rendezvous, and all decide alike: each stops only once its own connection
ended, and a barrier completes on every rank or on none (short of a fault during it,
which fails the epoch it would have run, and the usual recovery follows).

The peer snapshots' gloo group of the epoch (`PeerSnapshots.group_maker`) is made with
them, before the barrier, when the epoch has one: made at the switch, its connection took
the CPU of the epoch's first steps on every worker (a join's longest gap).

A rank whose connection has not reached the barrier when it enters the epoch (the stop
came from a peer whose own connection failed) knows that no rank can have connected: the
barrier needs it. It gives its connection up at once (`give_up_short_of_barrier`), and
drops what it connected, so that a peer already waiting in the barrier fails there at
once too (over gloo its connection to this rank closed; NCCL's barrier notices no closed
peer and waits out its timeout, the connect timeout), instead of both waiting out the
connect timeout at the switch.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from planaria.runtime.contract.logs import error_line
from planaria.runtime.parallel.groups import creation_order
from planaria.runtime.parallel.release import group_options
from planaria.templates.plan import Plan

PREPARED_BACKEND = "planaria_prepared"
"""The name under which the connected backends are handed to torch (`install`)."""
GIVEN_UP = "given up short of its barrier: a peer's connection failed"
PREFIX = "prepared"
"""The key prefix of the prepared groups on the epoch's bootstrap store: a world and
groups of their own, apart from those of a rendezvous the epoch may fall back to."""


SNAPSHOTS = "peer-snapshots"
"""The prefix, under `PREFIX`, of the peer snapshots' group connected ahead."""


class BarrierGate:
    """Whether a connection may still enter its barrier, or was given up short of it
    (module docstring): one lock between the connecting thread and the one that gives
    up. The simulated workers of the scale harness use it too."""

    def __init__(self):
        self.lock = threading.Lock()
        self.in_barrier = self.given_up = False

    def enter(self) -> None:
        """The connecting thread, before its barrier: RuntimeError once given up."""
        with self.lock:
            if self.given_up:
                raise RuntimeError(GIVEN_UP)
            self.in_barrier = True

    def give_up(self, done: threading.Event) -> bool:
        """Give up unless the connection ended (`done`) or is in its barrier: True if given
        up, now or before."""
        with self.lock:
            if not self.given_up and (done.is_set() or self.in_barrier):
                return False
            self.given_up = True
            return True


class PreparedGroups:
    """One rank's groups of a prepared epoch, connected on a thread (module docstring)."""

    def __init__(self, epoch: int, plan: Plan, rank: int, store: Callable[[], dist.Store], backend: str,
                 device: torch.device, connect_timeout: timedelta, tied_layers: tuple[int, ...] = (),
                 snapshot_group: Callable[[dist.Store, int, int], object] | None = None):
        """`store`: the epoch's bootstrap store, asked for on the connecting thread (over
        etcd, finding it can wait for its host to publish it). `snapshot_group`: what
        makes the epoch's peer-snapshot group, on a store, as a rank of a world's size
        (`PeerSnapshots.group_maker`), or None; what it made is `snapshots` once
        connected."""
        self.epoch, self.plan, self.rank = epoch, plan, rank
        self.backend, self.device, self.connect_timeout = backend, device, connect_timeout
        self.tied_layers = tied_layers
        self._store = store
        self._snapshot_group = snapshot_group
        self.snapshots = None
        """The peer snapshots' group, connected with the others (None without)."""
        self.release = None
        """The release of the epoch's collectives, made before its first connection (the
        caller's: `epoch_release`)."""
        self.followed = False
        """The epoch's word is followed by the caller for the connection (the caller's:
        `ConnectAhead`, whose taker's epoch watcher keeps the follow)."""
        self.done = threading.Event()
        """Set when the connection ended, connected or not (`error`)."""
        self.error: str | None = None
        self.seconds: float | None = None
        self._backends: list = []
        self._gate = BarrierGate()
        self._made: list = []
        """The backends connected so far (`_add`, under the gate's lock); handed to
        `_backends` past the barrier."""

    def start(self) -> "PreparedGroups":
        threading.Thread(target=self._connect, daemon=True, name=f"prepared-groups-{self.epoch}").start()
        return self

    def _connect(self) -> None:
        started = time.perf_counter()
        try:
            prepared = dist.PrefixStore(PREFIX, self._store())
            self._add(self._make(dist.PrefixStore("world", prepared), self.rank, self.plan.world_size))
            for index, ranks in enumerate(creation_order(self.plan, self.tied_layers), start=1):
                if self.rank in ranks:
                    self._add(self._make(dist.PrefixStore(str(index), prepared), ranks.index(self.rank),
                                         len(ranks)))
            if self._snapshot_group is not None:
                self._add(self._snapshot_group(dist.PrefixStore(SNAPSHOTS, prepared), self.rank,
                                               self.plan.world_size))
            self._gate.enter()  # (past it, nothing gives the connection up: `_made` is this thread's)
            self._barrier(self._made[0])
            made, self._made = self._made, []
            if self._snapshot_group is not None:
                self.snapshots = made.pop()
            self._backends = made
            self.seconds = time.perf_counter() - started
        except Exception as err:  # noqa: BLE001 - any failure means a rendezvous at the switch
            self.error = error_line(err, 300)
            with self._gate.lock:
                self._made = []  # (their connections closed: a peer in the barrier fails at once)
        finally:
            self.done.set()

    def _add(self, backend) -> None:
        """One more backend connected; refused (and dropped) once the connection was given up."""
        with self._gate.lock:
            if self._gate.given_up:
                raise RuntimeError(GIVEN_UP)
            self._made.append(backend)

    def give_up_short_of_barrier(self) -> bool:
        """Give the connection up if it has not reached its barrier (module docstring): True
        if it was given up (now or before), its backends dropped (its thread ends at its
        next group, or at its connect timeout); False if it ended already or is in the
        barrier, whose outcome is every rank's."""
        if not self._gate.give_up(self.done):
            return False
        with self._gate.lock:  # (given up: `_add` appends no more)
            made, self._made = self._made, []
        del made  # (the last reference: their destructors close their connections)
        return True

    def _make(self, store: dist.Store, rank: int, size: int):
        """A backend of `size` ranks as `rank`, connected (NCCL: its communicator made now,
        `eager_connect_single_device`, not at its first collective)."""
        if self.backend == "nccl":
            options = group_options("nccl")
            options._timeout = self.connect_timeout
            backend = dist.ProcessGroupNCCL(store, rank, size, options)
            backend.eager_connect_single_device(self.device)
            return backend
        return dist.ProcessGroupGloo(store, rank, size, self.connect_timeout)

    def _barrier(self, world) -> None:
        world.allreduce([torch.zeros(1, device=self.device)]).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def connected(self) -> bool:
        return self.done.is_set() and self.error is None

    def matches(self, epoch: int, plan: Plan) -> bool:
        """Prepared for `epoch` with `plan` (its first iteration aside: set at the stop)."""
        return (epoch == self.epoch and plan.world_size == self.plan.world_size
                and plan.rank_of_worker() == self.plan.rank_of_worker()
                and creation_order(plan, self.tied_layers) == creation_order(self.plan, self.tied_layers))

    def install(self) -> str:
        """Register the backend whose creator hands the connected backends to torch, in
        creation order (the world first); its name, for `init_process_group`."""
        queue, self._backends = deque(self._backends), []

        def create(store, rank: int, size: int, timeout):
            if not queue:
                raise RuntimeError(f"epoch {self.epoch}: torch asked for more process groups than were prepared "
                                   f"({creation_order(self.plan, self.tied_layers)})")
            backend = queue.popleft()
            if (backend.rank(), backend.size()) != (rank, size):
                raise RuntimeError(f"epoch {self.epoch}: torch asked for a group as rank {rank} of {size}, "
                                   f"but the next one prepared is rank {backend.rank()} of {backend.size()}")
            return backend

        dist.Backend.register_backend(PREPARED_BACKEND, create, devices=["cuda" if self.backend == "nccl" else "cpu"])
        return PREPARED_BACKEND

    def discard(self) -> None:
        """Drop the connected backends (their destructors close their connections)."""
        self._backends, self.snapshots = [], None
