"""A worker's part in connecting a join's next epoch ahead of the stop.

The controller writes a join's next epoch as prepared, `connect_ahead` set, before it
asks the epoch in force to stop (`planaria.elastic.leave_planning`). Each worker of the
prepared plan connects its groups meanwhile (`planaria.runtime.parallel.prepared_groups`):
a survivor from its epoch watcher's thread at the join's word (it stops once they are
connected: `EpochWatcher`), a joiner while it waits for the epoch it is planned into.
At the epoch's start the worker takes them (`take`) if they connected, and makes a
rendezvous otherwise: every rank decides alike (the module docstring of
`prepared_groups` says why).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from datetime import timedelta

import torch

from planaria.runtime.contract.epochs import EpochRecord
from planaria.runtime.parallel.prepared_groups import PreparedGroups
from planaria.runtime.parallel.release import epoch_release
from planaria.runtime.worker.coordination import StoreCoordinator
from planaria.templates.plan import Plan


FIRST = "prepared/first"
"""Where, on the epoch's bootstrap store, a survivor tells the joiners the epoch's first
iteration (`tell_first`)."""


def tell_first(store, first: int) -> None:
    """The prepared epoch's first iteration, which its survivors agreed on as they stopped
    (the step after the last they committed), for its joiners. Fixed width: the store's
    traffic does not depend on the step's number."""
    store.set(FIRST, f"{first:020d}")


def told_first(store) -> int:
    """The first iteration the survivors told (`tell_first`), waited for: a joiner enters
    a prepared epoch as soon as its groups connected, before the survivors stopped."""
    store.wait([FIRST])
    return int(store.get(FIRST))


def teller(old: Plan | None, new: Plan) -> int | None:
    """The rank of `new` that tells the first iteration: its lowest-ranked worker that was
    in `old`, the plan it trained under (None for a worker new to the job)."""
    if old is None:
        return None
    kept = set(old.rank_of_worker())
    return min((r for w, r in new.rank_of_worker().items() if w in kept), default=None)


def agree_on_first(store, entry: str, plan: Plan, trained: Plan | None, rank: int) -> int:
    """An epoch entered over groups connected ahead: its first iteration, as the worker
    that enters it as `rank` of `plan` knows it or is told. `entry` is how it enters:
    "early" (a joiner, from the prepared record, before the stop: it is told the
    survivors' first iteration), "stopped" (a survivor, at the step boundary all agreed
    on: the lowest-ranked of them, `teller` of `trained`, the plan it trained under,
    tells it) or "published" (from the controller's record: its first iteration, told
    too, the same value)."""
    if entry == "early":
        return told_first(store)
    if entry == "published" or rank == teller(trained, plan):
        tell_first(store, plan.first_iteration)
    return plan.first_iteration


class ConnectAhead:
    """The groups this worker connects ahead for its next epoch, at most one set."""

    def __init__(self, coordinator: StoreCoordinator, backend: str, device: torch.device, connect_timeout_s: float,
                 *, release: bool, keep_ports: Collection[int], log: Callable[[str], None]):
        """`release`: the epochs' collectives can be released (`comm.release`): a prepared
        epoch's release is made before its first connection, as any epoch's."""
        self.coordinator, self.backend, self.device = coordinator, backend, device
        self.connect_timeout_s, self.release, self.keep_ports = connect_timeout_s, release, keep_ports
        self.log = log
        self._prepared: PreparedGroups | None = None
        self._record: EpochRecord | None = None
        """The prepared record `_prepared` was connected for."""

    def start(self, before: int, record: EpochRecord, tied_layers: tuple[int, ...],
              current_release=None, snapshot_group=None) -> threading.Event | None:
        """Connect the groups of epoch `before + 1`, prepared as `record`, when it asks for
        that and this worker is in its plan: an event set once they connected or failed
        to, else None. `current_release`: the release of the epoch this worker trains in,
        told to spare the next epoch's bootstrap store, which that epoch needs whether or
        not this one fails. `snapshot_group`: what makes the epoch's peer-snapshot group
        with the others (`PeerSnapshots.group_maker`), or None."""
        worker = self.coordinator.worker
        ranks = record.plan.rank_of_worker()
        if not record.connect_ahead or worker not in ranks:
            return None
        epoch, rank = before + 1, ranks[worker]
        if self._prepared is not None:
            if self._prepared.epoch == epoch:
                return self._prepared.done
            self.drop()
        release = epoch_release(self.backend, self.keep_ports) if self.release else None

        def store():
            # Its word followed while the groups connect: the rendezvous's looks whether the
            # epoch was given up read a mirror, not etcd (each 10 ms of a wait, per worker).
            # Kept when the groups are taken: the epoch's watcher follows it from there.
            prepared.followed = self.coordinator.follow_epoch(epoch)
            found = self.coordinator.rendezvous_store(epoch, host=rank == 0, close_older=False)
            port = self.coordinator.epoch_store_port(epoch)
            if port is not None and current_release is not None:
                current_release.keep(port)
            return found

        prepared = PreparedGroups(epoch, record.plan, rank, store, self.backend, self.device,
                                  timedelta(seconds=self.connect_timeout_s), tied_layers, snapshot_group)
        prepared.release = release
        self._prepared, self._record = prepared.start(), record
        return prepared.done

    def prepared_record(self, epoch: int) -> EpochRecord | None:
        """The prepared record of `epoch` whose groups this worker connects (or connected),
        or None. The controller writes a prepared record once (`PlannedLeaves.prepare`):
        this is what a read of it would return, without the read."""
        prepared = self._prepared
        return self._record if prepared is not None and prepared.epoch == epoch else None

    def give_up(self, epoch: int) -> bool:
        """Give up the connection of `epoch` if it has not reached its barrier
        (`PreparedGroups.give_up_short_of_barrier`): True if given up."""
        prepared = self._prepared
        return prepared is not None and prepared.epoch == epoch and prepared.give_up_short_of_barrier()

    def connected(self, epoch: int) -> bool:
        """The groups of `epoch` are connected ahead."""
        prepared = self._prepared
        return prepared is not None and prepared.epoch == epoch and prepared.connected

    def take(self, epoch: int, plan: Plan) -> PreparedGroups | None:
        """The groups connected ahead for `epoch` and `plan`, waited for if still
        connecting (a joiner can be a moment behind); None, the others dropped, when
        there are none or they did not connect. The epoch's word stays followed
        (`followed`): the epoch's watcher takes the follow over (`EpochWatcher.start`)."""
        prepared, self._prepared, self._record = self._prepared, None, None
        if prepared is None:
            return None
        if not prepared.matches(epoch, plan):
            self._discard(prepared)
            return None
        if prepared.give_up_short_of_barrier():
            self.log(f"epoch {epoch}: its groups were still connecting at the switch, short of their "
                     "barrier, so no rank connected them; a rendezvous instead, at once")
            self._discard(prepared)
            return None
        if not prepared.done.wait(self.connect_timeout_s) or not prepared.connected:
            self.log(f"epoch {epoch}: its groups could not be connected ahead "
                     f"({prepared.error or 'still connecting'}); a rendezvous instead")
            self._discard(prepared)
            return None
        return prepared

    def drop(self) -> None:
        """Give up the groups connected ahead (the epoch before was released: their
        connections were shut down with its own)."""
        prepared, self._prepared, self._record = self._prepared, None, None
        if prepared is not None:
            self._discard(prepared)

    def _discard(self, prepared: PreparedGroups) -> None:
        prepared.discard()
        if prepared.done.is_set():  # (still connecting: its thread is following the word)
            self.coordinator.unfollow_epoch(prepared.epoch)
