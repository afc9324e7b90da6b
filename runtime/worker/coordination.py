"""How a worker talks to its control plane: a narrow interface over a key-value store.

The runtime needs five things from whoever coordinates the job (docs/recovery.md):
announce itself; wait for the next epoch's record (its plan, and what to do before it
starts); a rendezvous store for that epoch's process groups (over etcd, a TCPStore of the
epoch's own that its rank 0 hosts: `planaria.runtime.worker.epoch_store`); publish its status when
an epoch ends; and learn, cheaply at every iteration, whether the control plane wants
the job to stop at the next iteration boundary (a node joins). `StoreCoordinator`
implements it over any `torch.distributed.Store`: a `TCPStore` that a test harness or
local launcher owns, or the etcd-backed store of `planaria.elastic`.

The keys and records are the contract's (`planaria.runtime.contract.keys`,
`planaria.runtime.contract.epochs`): the controller writes and reads the same.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from planaria.runtime.contract import keys
from planaria.runtime.contract.deadline import ReachableDeadline
from planaria.runtime.contract.epochs import EpochRecord, EpochTiming, Progress
from planaria.runtime.contract.exactly_once import CommitRecord, WorkerStatus
from planaria.runtime.contract.membership import Announcement, Waiting
from planaria.runtime.contract.store_reads import (follow, generation, poll_pause, read_if_present, unfollow,
                                                   wait_for_change)
from planaria.runtime.worker.abandonable_store import CHANGE_WAIT_S, AbandonableStore
from planaria.runtime.worker.epoch_store import EpochStoreClient, EpochStoreHost, advertised_host
from planaria.runtime.worker.store_trace import traced
from planaria.templates.plan import Worker

POLL_S = 0.02
FAST_FOR_S = 0.25
"""A wait for the next epoch polls every 2 ms (`store_reads.FAST_POLL_S`) for its first FAST_FOR_S: it starts
as an epoch ends, and after a stop at a step boundary the next record follows within
tens of milliseconds (it took 10 ms on average, half a poll, of a planned leave's pause
of about 0.2 s). Later, and for a worker waiting as a spare, every POLL_S."""
FOLLOWED_WAIT_S = 5.0
"""A wait for the next epoch over a store that follows `epoch` and `done` is woken by
their change; it looks again this often besides (for its deadline only): a node's
relay answers every look, thousands of waiting workers a second at a thousand nodes
if they looked each second."""
ADDRESS_POLL_S = 0.1
"""A rank waiting for its epoch's bootstrap store to be published wakes at the key's change
(followed); in between, it asks this often whether the control plane ended the epoch
(a read of a mirror, where the epoch's end is followed too)."""


class JobEnded(Exception):
    """The control plane ended the job (`done`); `outcome` says how."""

    def __init__(self, outcome: str):
        super().__init__(outcome)
        self.outcome = outcome


class StoreCoordinator:
    """A worker's side of the control plane, over a `torch.distributed.Store`."""

    def __init__(self, store: dist.Store, worker: Worker, *, node_address: str | None = None,
                 connect_timeout_s: float = 30.0):
        """`node_address`: where the other nodes reach this worker's node, at which it hosts
        an epoch's bootstrap store as the plan's rank 0 (None: `epoch_store.advertised_host`,
        when first needed); `connect_timeout_s`: how long a connection to an epoch's store
        may take (`comm.connect_timeout_s`)."""
        self.store = store
        self.worker = worker
        self.node_address, self.connect_timeout_s = node_address, connect_timeout_s
        self._key = keys.worker_key(worker)
        self._rendezvous_stores: dict[int, AbandonableStore] = {}
        self._open: set[int] = set()
        """The epochs whose own bootstrap store this worker has not closed yet."""
        self._hosted: dict[int, EpochStoreHost] = {}
        self._lock = threading.Lock()
        self.followed_wait_s, self.abandon_wait_s = FOLLOWED_WAIT_S, CHANGE_WAIT_S
        """How long a wait on followed keys (for an epoch; a rendezvous's abandon watch)
        waits for a change before it looks anyway: a guard, the change wakes it at once.
        (The scale harness lengthens both: thousands of simulated workers' looks at their
        relays, which cost etcd nothing, are its own load, not the control plane's.)"""
        self.abandon_watch = None
        """`abandon_watch(epoch, interrupt, poll_s, change_wait_s)`: the watch of an epoch's
        rendezvous store (`AbandonableStore`'s `make_watch`), when not a thread of its own
        (the scale harness's simulated workers: tasks of one event loop)."""

    def announce(self) -> None:
        self.store.set(keys.member(self.worker), Announcement(os.getpid()).to_json())

    def wait_for_epoch(self, after: int, timeout_s: float,
                       on_prepared: Callable[[EpochRecord], bool] | None = None) -> tuple[int, EpochRecord]:
        """The first epoch newer than `after` and its record; JobEnded if the job ended
        first, TimeoutError if nothing came within `timeout_s`. `on_prepared`: given the
        record the controller prepared for the epoch after `after` (`prepared_record`),
        once, as soon as it is written (a joiner connects its groups meanwhile): when it
        returns True, that epoch and the prepared record are returned at once (its first
        iteration a placeholder, which the epoch's workers agree on as they enter it)."""
        # Followed (an etcd store): asked of a mirror, woken by its watch, no request.
        followed = follow(self.store, keys.DONE) & follow(self.store, keys.EPOCH)
        watching = on_prepared is not None and after >= 0
        if watching:
            followed &= follow(self.store, keys.epoch_prepared(after))
        try:
            return self._wait_for_epoch(after, timeout_s, followed, on_prepared if watching else None)
        finally:
            if watching:
                unfollow(self.store, keys.epoch_prepared(after))

    def _wait_for_epoch(self, after: int, timeout_s: float, followed: bool, on_prepared) -> tuple[int, EpochRecord]:
        deadline = ReachableDeadline(timeout_s)
        started = time.monotonic()
        while True:
            since = generation(self.store)
            if on_prepared is not None and (prepared := self.prepared_record(after)) is not None:
                if on_prepared(prepared):
                    return after + 1, prepared
                on_prepared = None
            if (done := read_if_present(self.store, keys.DONE)) is not None:
                raise JobEnded(done.decode())
            if (current := read_if_present(self.store, keys.EPOCH)) is not None and int(current) > after:
                epoch = int(current)
                return epoch, self.parse_record(self.store.get(keys.epoch_record(epoch)))
            if deadline.expired():
                if self._job_waits_for_nodes(timeout_s):
                    deadline = ReachableDeadline(timeout_s)  # so does this worker
                    continue
                raise TimeoutError(f"worker {self._key}: no epoch after {after} within {timeout_s:.0f} s; "
                                   "is the control plane alive?")
            wait_for_change(self.store, since, self.followed_wait_s if followed else poll_pause(started, FAST_FOR_S, POLL_S))

    def _job_waits_for_nodes(self, timeout_s: float) -> bool:
        """The job, below one replica's nodes, waits for nodes (`keys.WAITING`), and not
        for longer than its limit and `timeout_s` more (a key its leader could not delete)."""
        value = read_if_present(self.store, keys.WAITING)
        if value is None:
            return False
        waiting = Waiting.from_json(value)
        return time.time() < waiting.since + waiting.limit_s + timeout_s

    def published(self, epoch: int) -> bool:
        """The controller has published `epoch` (or a later one): a read of `keys.EPOCH`,
        a mirror's while `wait_for_epoch` follows it."""
        current = read_if_present(self.store, keys.EPOCH)
        return current is not None and int(current) >= epoch

    def prepared_record(self, epoch: int) -> EpochRecord | None:
        """The next epoch's record as the controller prepared it before asking `epoch` to
        stop (`keys.epoch_prepared`: a planned leave), or None. Its plan's first iteration
        is a placeholder: the step after the one the stop came after."""
        value = read_if_present(self.store, keys.epoch_prepared(epoch))
        return None if value is None else self.parse_record(value)

    def parse_record(self, value: bytes) -> EpochRecord:
        """An epoch's record from the store's bytes (the scale harness's simulated workers
        share one parse of each: `planaria.chaos.scale.shared_records`)."""
        return EpochRecord.from_json(value)

    def rendezvous_store(self, epoch: int, host: bool = False, close_older: bool = True) -> dist.Store:
        """The epoch's process-group rendezvous, given up as soon as the control plane
        moves past the epoch: a peer that dies before it has registered would otherwise
        hold everyone in the rendezvous until the store's timeout. One per epoch: the
        world's and a planned leave's groups (`transfer.Handoff`), and the peer snapshots',
        meet in the same. `host`: this worker is the plan's rank 0, which hosts the epoch's
        store (over etcd; the epoch's first call says). Asked for a newer epoch, the stores
        of older ones are closed (`_close_before`), unless `close_older` is False: asked
        for while the epoch before it trains (its groups connected ahead:
        `prepared_groups`), whose store a late peer-snapshot connection may still use."""
        with self._lock:
            if close_older:
                self._close_before(epoch)
            if epoch in self._rendezvous_stores:
                return self._rendezvous_stores[epoch]
            base = self._bootstrap_store(epoch, host)
            # The epoch watcher follows the epoch's end while it runs (`follow_epoch`): the
            # rendezvous's looks read that mirror, and wait for its change between two.
            followed = getattr(self.store, "follow", None) is not None
            store = AbandonableStore(base, lambda: self.reconfigure_requested(epoch),
                                     f"epoch {epoch} was abandoned by the control plane during its rendezvous",
                                     changes=(self.generation, self.wait_changed) if followed else None,
                                     change_wait_s=self.abandon_wait_s, make_watch=self._make_watch(epoch))
            # c10d holds the store by its C++ half only: a Python subclass collected while a
            # process group still uses it has no methods left ("Not implemented"). Kept,
            # closed or not, for as long as this worker lives (a small object an epoch).
            self._rendezvous_stores[epoch] = store
            if isinstance(base, EpochStoreClient):
                self._open.add(epoch)
            return store

    def epoch_store_port(self, epoch: int) -> int | None:
        """The port of `epoch`'s own bootstrap store (`_bootstrap_store`), once its host
        published it; None where the epoch bootstraps on the job's store (its connections
        are the control plane's, which no release touches)."""
        if getattr(self.store, "follow", None) is None:
            return None
        hosted = self._hosted.get(epoch)
        address = hosted.address if hosted is not None else self._published_store(epoch)
        return int(address.rpartition(":")[2])

    def _make_watch(self, epoch: int):
        if self.abandon_watch is None:
            return None
        return lambda interrupt, poll_s, change_wait_s: self.abandon_watch(epoch, interrupt, poll_s, change_wait_s)

    def _bootstrap_store(self, epoch: int, host: bool) -> dist.Store:
        """Where the epoch's groups bootstrap. Over a job's store that can follow keys
        (etcd's), the epoch's own TCPStore (`planaria.runtime.worker.epoch_store`), hosted
        here when `host` and published under `keys.epoch_pg_store`. Over any other (a
        TCPStore already: the local launcher's, a test's), under the epoch's prefix of
        the job's store, as ever: that store is on one host anyway, and answers a wait
        without any load on etcd; a second TCPStore there would only add a hop."""
        if getattr(self.store, "follow", None) is None:
            return dist.PrefixStore(keys.epoch_rendezvous(epoch), self.store)
        if host:
            if self.node_address is None:
                self.node_address = advertised_host()
            hosted = self._hosted[epoch] = EpochStoreHost(self.node_address, self.connect_timeout_s)
            self.store.set(keys.epoch_pg_store(epoch), hosted.address)
            address = hosted.address
        else:
            address = lambda: self._published_store(epoch)  # noqa: E731 - at the first use, not now
        return EpochStoreClient(address, connect_timeout_s=self.connect_timeout_s, timeout=self.store.timeout)

    def _published_store(self, epoch: int) -> str:
        """"host:port" of `epoch`'s bootstrap store, once its host published it: followed
        (one read and a watch, no polling), given up when the control plane ends the epoch
        or at the store's timeout."""
        key = keys.epoch_pg_store(epoch)
        followed = follow(self.store, key)
        deadline = ReachableDeadline(self.store.timeout.total_seconds())
        try:
            while True:
                since = generation(self.store)
                if (address := read_if_present(self.store, key)) is not None:
                    return address.decode()
                if self.reconfigure_requested(epoch):
                    raise dist.DistStoreError(f"epoch {epoch} was abandoned by the control plane before its "
                                              "bootstrap store was published (its rank 0 is gone?)")
                if deadline.expired():
                    raise dist.DistStoreError(
                        f"epoch {epoch}'s bootstrap store was not published within "
                        f"{self.store.timeout.total_seconds():.0f} s; is the plan's rank 0 alive?")
                wait_for_change(self.store, since, ADDRESS_POLL_S if followed else POLL_S)
        finally:
            if followed:
                unfollow(self.store, key)

    def _close_before(self, epoch: int) -> None:
        """Close the bootstrap stores of the epochs before `epoch`: this worker has left
        them, and so has every other (the control plane moved past them), a late peer
        snapshots' connection aside, which would fail anyway. Hosted ones stop serving;
        connections close. Off the caller's thread: it is on its way into the next epoch."""
        old = sorted(e for e in self._open if e < epoch)
        if old:
            self._open.difference_update(old)
            stores = [self._rendezvous_stores[e] for e in old]
            hosted = [self._hosted.pop(e) for e in old if e in self._hosted]
            self.close_later(stores, hosted)

    def close_later(self, stores: list[AbandonableStore], hosted: list[EpochStoreHost]) -> None:
        """Close `stores` and stop serving `hosted` on a thread of their own (the scale
        harness's simulated workers hand them to one shared thread instead)."""
        threading.Thread(target=close_stores, args=(stores, hosted), daemon=True, name="close-epoch-stores").start()

    def close(self) -> None:
        """Close every epoch's bootstrap store this worker holds or hosts (it is done)."""
        with self._lock:
            stores = [self._rendezvous_stores[e] for e in self._open]
            hosted, self._hosted, self._open = list(self._hosted.values()), {}, set()
        close_stores(stores, hosted)

    def mark_ready(self, epoch: int) -> None:
        """This worker is in no epoch, waiting for one after `epoch` (`keys.ready`)."""
        self.store.set(keys.ready(self.worker), str(epoch))

    def handed_off(self, epoch: int) -> None:
        self.store.set(keys.epoch_handed_off(epoch, self.worker), "1")

    def publish_progress(self, progress: Progress) -> None:
        self.store.set(keys.PROGRESS, progress.to_json())

    def publish_status(self, epoch: int, status: WorkerStatus) -> None:
        self.store.set(keys.epoch_status(epoch, self.worker), status.to_json())

    def publish_timing(self, epoch: int, timing: EpochTiming) -> None:
        self.store.set(keys.epoch_timing(epoch, self.worker), timing.to_json())

    def report_checkpoint(self, iteration: int, epoch: int, shards: int, commit: CommitRecord) -> None:
        """This worker's files of the checkpoint of `iteration`, committed in `epoch`, are on disk."""
        self.store.set(keys.checkpoint_commit(iteration, epoch), commit.to_json())
        self.store.add(keys.checkpoint_shards(iteration, epoch), shards)

    def mark_trained(self, epoch: int, at: float | None = None) -> None:
        """This epoch committed a step: the controller may now absorb joiners (it defers
        a join until the epoch in force has made progress, so churn cannot livelock it).
        The value is when (wall clock, `at` or now): the end of a recovery, for the
        agents' metrics."""
        self.store.set(keys.epoch_trained(epoch), f"{time.time() if at is None else at:.3f}")

    def wait_until_trained(self, epoch: int, timeout_s: float) -> bool:
        """Wait until `epoch` committed a step (`mark_trained`), or the control plane moved
        past it or ended the job, or `timeout_s` passed; True for the first. Three reads
        each 50 ms."""
        deadline = time.monotonic() + timeout_s
        while True:
            if read_if_present(self.store, keys.epoch_trained(epoch)) is not None:
                return True
            current = read_if_present(self.store, keys.EPOCH)
            if (time.monotonic() >= deadline or (current is not None and int(current) > epoch)
                    or read_if_present(self.store, keys.DONE) is not None):
                return False
            time.sleep(0.05)

    def follow_epoch(self, epoch: int) -> bool:
        """Mirror `epoch`'s end (`keys.epoch_reconfigure`) while the epoch runs: the epoch
        watcher's polls and the rendezvous's `reconfigure_requested` cost no request, and
        `wait_changed` wakes at the word. True if the store can (etcd's)."""
        return follow(self.store, keys.epoch_reconfigure(epoch))

    def unfollow_epoch(self, epoch: int) -> None:
        unfollow(self.store, keys.epoch_reconfigure(epoch))

    def generation(self) -> int:
        """Give it to `wait_changed`."""
        return generation(self.store)

    def wait_changed(self, since: int, timeout_s: float) -> bool:
        """Until a followed key changed (a sleep of `timeout_s` over a store that follows none)."""
        return wait_for_change(self.store, since, timeout_s)

    def reconfigure_requested(self, epoch: int) -> bool:
        return self.store.check([keys.epoch_reconfigure(epoch)])

    def epoch_over(self, epoch: int) -> str | None:
        """Why the control plane ended `epoch` (`keys.JOIN`, `keys.FAILURE`), or None."""
        value = read_if_present(self.store, keys.epoch_reconfigure(epoch))
        return None if value is None else value.decode()


def close_stores(stores: list[AbandonableStore], hosted: list[EpochStoreHost]) -> None:
    for store in stores:
        store.close()
    for host in hosted:
        host.close()


def store_ports(url: str) -> set[int]:
    """The ports of the store's endpoints at `url` ("host:port", "tcp://host:port",
    "etcd://host:port[,host:port...]/prefix"): connections to them are the control
    plane's, which a release of an epoch's collectives leaves alone."""
    rest = url.partition("://")[2] or url
    hosts = rest.split("/", 1)[0]
    return {int(port) for _, _, port in (h.rpartition(":") for h in hosts.split(",")) if port.isdigit()}


def connect_store(url: str, timeout_s: float = 60.0, environ=os.environ) -> dist.Store:
    """The job's store at `url`: "host:port" or "tcp://host:port" is a TCPStore; any other
    scheme names a store registered under the `planaria.stores` entry point group
    ("etcd://host:port/prefix" is `planaria.elastic`'s), so the runtime needs no import
    of the control plane that provides it. Traced when `environ` asks for it
    (`PLANARIA_STORE_TRACE`: `planaria.runtime.worker.store_trace`)."""
    return traced(_store_at(url, timeout_s), environ)


def _store_at(url: str, timeout_s: float) -> dist.Store:
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "tcp", url
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"store address must be host:port, got {url!r}")
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    from importlib.metadata import entry_points

    found = {ep.name: ep for ep in entry_points(group="planaria.stores")}
    if scheme not in found:
        raise ValueError(f"no store for {scheme}:// (known: tcp, {', '.join(sorted(found)) or 'none'}); "
                         "is Planaria installed with its entry points (pip install -e .)?")
    return found[scheme].load()(url, timeout_s)
