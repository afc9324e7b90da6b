"""How a worker talks to its control plane: a narrow interface over a key-value store.

The runtime needs five things from whoever coordinates the job (DESIGN §7):
announce itself; wait for the next epoch's record (its plan, and what to do before it
starts); a rendezvous store for that epoch's process groups; publish its status when
an epoch ends; and learn, cheaply at every iteration, whether the control plane wants
the job to stop at the next iteration boundary (a node joins). `StoreCoordinator`
implements it over any `torch.distributed.Store`: a `TCPStore` that a test harness or
local launcher owns, or the etcd-backed store of `planaria.elastic`.

The records and key names here are the controller's too, and a node's agent imports
them: this module imports torch only where a worker uses it (`rendezvous_store`,
`connect_store`), so that an agent, which never computes, starts without it.

Keys (under whatever prefix the store carries):

    members/<node>.<local>          a worker's announcement: {"pid": ...}
    epoch                           the newest epoch whose record is complete
    epoch/<e>/record                EpochRecord JSON, written before `epoch` moves to e
    epoch/<e>/status/<node>.<local> WorkerStatus JSON, once the worker left epoch e
    epoch/<e>/reconfigure           present: stop after the current iteration
    epoch/<e>/pg/...                the epoch's process-group rendezvous
    epoch/<e>/timing/<node>.<local> how long the worker's recovery phases took (JSON)
    epoch/<e>/event                 the controller's account of the reconfiguration (JSON)
    checkpoint/<i>/shards           shard files of the checkpoint of iteration i on disk
    checkpoint/<i>/commit           that iteration's commit record
    done                            the job is over: "ok", or "failed: <reason>"
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from planaria.runtime.exactly_once import CommitRecord, WorkerStatus
from planaria.templates.plan import Plan, Transfer

if TYPE_CHECKING:
    import torch.distributed as dist

Worker = tuple[str, int]
POLL_S = 0.02


def worker_key(worker: Worker) -> str:
    return f"{worker[0]}.{worker[1]}"


class ReachableDeadline:
    """A deadline that counts only the time in which the store answered.

    Polling loops over the store (waiting for an epoch, for the workers' statuses) call
    `expired()` once per pass. A pass that took longer than `slack_s` means a store call
    blocked (etcd away, its client retrying); the excess moves the deadline, so that an
    outage of the control plane never reads as a worker's or a controller's silence."""

    def __init__(self, seconds: float, slack_s: float = 1.0):
        self.seconds, self.slack_s = seconds, slack_s
        self._deadline = time.monotonic() + seconds
        self._last = time.monotonic()

    def expired(self) -> bool:
        now = time.monotonic()
        stalled = now - self._last - self.slack_s
        if stalled > 0:
            self._deadline += stalled
        self._last = now
        return now > self._deadline


class JobEnded(Exception):
    """The control plane ended the job (`done`); `outcome` says how."""

    def __init__(self, outcome: str):
        super().__init__(outcome)
        self.outcome = outcome


@dataclass(frozen=True)
class EpochRecord:
    """An epoch's plan and what survivors do before it starts."""

    plan: Plan
    roll_forward: CommitRecord | None = None
    """Workers one step behind apply this committed step first (exactly-once rule)."""
    transfers: tuple[Transfer, ...] = field(default=())
    """Layer shards to copy from holders to the workers that lack them."""
    restore: str | None = None
    """A checkpoint directory every worker loads its layers from (some layer lost every
    replica); the plan then starts right after the checkpoint's iteration."""

    def to_json(self) -> str:
        return json.dumps({
            "plan": json.loads(self.plan.to_json()),
            "roll_forward": None if self.roll_forward is None else vars(self.roll_forward),
            "transfers": [[t.layer, t.tp_rank, list(t.src), list(t.dst)] for t in self.transfers],
            "restore": self.restore,
        })

    @classmethod
    def from_json(cls, text: str) -> "EpochRecord":
        data = json.loads(text)
        roll = data["roll_forward"]
        return cls(plan=Plan.from_json(json.dumps(data["plan"])),
                   roll_forward=None if roll is None else CommitRecord(**roll),
                   transfers=tuple(Transfer(layer, tp, tuple(src), tuple(dst))
                                   for layer, tp, src, dst in data["transfers"]),
                   restore=data.get("restore"))


class StoreCoordinator:
    """A worker's side of the control plane, over a `torch.distributed.Store`."""

    def __init__(self, store: dist.Store, worker: Worker):
        self.store = store
        self.worker = worker
        self._key = worker_key(worker)
        self._rendezvous_stores: dict[int, dist.Store] = {}

    def announce(self) -> None:
        self.store.set(f"members/{self._key}", json.dumps({"pid": os.getpid()}))

    def wait_for_epoch(self, after: int, timeout_s: float) -> tuple[int, EpochRecord]:
        """The first epoch newer than `after` and its record; JobEnded if the job ended
        first, TimeoutError if nothing came within `timeout_s`."""
        deadline = ReachableDeadline(timeout_s)
        while True:
            if self.store.check(["done"]):
                raise JobEnded(self.store.get("done").decode())
            if self.store.check(["epoch"]):
                epoch = int(self.store.get("epoch"))
                if epoch > after:
                    return epoch, EpochRecord.from_json(self.store.get(f"epoch/{epoch}/record").decode())
            if deadline.expired():
                raise TimeoutError(f"worker {self._key}: no epoch after {after} within {timeout_s:.0f} s; "
                                   "is the control plane alive?")
            time.sleep(POLL_S)

    def rendezvous_store(self, epoch: int) -> dist.Store:
        """The epoch's process-group rendezvous, given up as soon as the control plane
        moves past the epoch: a peer that dies before it has registered would otherwise
        hold everyone in the rendezvous until the store's timeout."""
        import torch.distributed as dist

        from planaria.runtime.abandonable_store import AbandonableStore

        store = AbandonableStore(dist.PrefixStore(f"epoch/{epoch}/pg/", self.store),
                                 lambda: self.reconfigure_requested(epoch),
                                 f"epoch {epoch} was abandoned by the control plane during its rendezvous")
        # c10d holds the store by its C++ half only: a Python subclass collected while a
        # process group still uses it has no methods left ("Not implemented").
        self._rendezvous_stores[epoch] = store
        return store

    def publish_status(self, epoch: int, status: WorkerStatus) -> None:
        self.store.set(f"epoch/{epoch}/status/{self._key}", status.to_json())

    def publish_timing(self, epoch: int, timing: dict) -> None:
        self.store.set(f"epoch/{epoch}/timing/{self._key}", json.dumps(timing))

    def report_checkpoint(self, iteration: int, shards: int, commit: CommitRecord) -> None:
        """This worker's files of the checkpoint of `iteration` are on disk."""
        self.store.set(f"checkpoint/{iteration}/commit", json.dumps(vars(commit)))
        self.store.add(f"checkpoint/{iteration}/shards", shards)

    def mark_trained(self, epoch: int) -> None:
        """This epoch committed a step: the controller may now absorb joiners (it defers
        a join until the epoch in force has made progress, so churn cannot livelock it)."""
        self.store.set(f"epoch/{epoch}/trained", "1")

    def reconfigure_requested(self, epoch: int) -> bool:
        return self.store.check([f"epoch/{epoch}/reconfigure"])


def connect_store(url: str, timeout_s: float = 60.0) -> dist.Store:
    """The job's store at `url`: "host:port" or "tcp://host:port" is a TCPStore; any other
    scheme names a store registered under the `planaria.stores` entry point group
    ("etcd://host:port/prefix" is `planaria.elastic`'s), so the runtime needs no import
    of the control plane that provides it."""
    import torch.distributed as dist

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
