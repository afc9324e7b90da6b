"""The job's history of published epochs, as the leader reads it back from the store: what
the fencing rule of docs/recovery.md ("Fencing") is decided from.

- A step counts only as committed by the epoch that commits it in the job's history: the
  newest one whose plan starts at or before it (`committing_epoch`). Only that epoch's
  checkpoint shards complete the step's checkpoint, and only its peer snapshots are
  restored from: a worker the job went on without, writing late, or a timeline the job
  went back from, leaves files and snapshots that nobody counts.
- A worker is planned in again only once it has left the last epoch it was planned in
  (`out_of_their_epochs`): a node cut off and back shows its workers alive at once, while
  they may still be blocked in the epoch they were cut off in. A worker never planned is
  planned in only once it has announced itself (`keys.member`), which it does when its
  start-up is over: a joiner still importing, loading its data or (on a GPU) making its
  device's context and compiling would hold every other worker in the next epoch's
  rendezvous for as long (issue 45: seconds on CPU, minutes on a GPU).

Published records never change, so what is read of them is kept. The epoch in force and
its plan are the caller's, passed in (their own record is not read back). Loaded by an
agent, through the controller: no torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from planaria.runtime.contract import keys
from planaria.runtime.contract.epochs import EpochRecord
from planaria.runtime.contract.keys import worker_key
from planaria.templates.plan import Plan, Worker

if TYPE_CHECKING:
    import torch.distributed as dist


class EpochHistory:
    """The past epochs' plans over a job's store (module docstring)."""

    def __init__(self, store: dist.Store, log: Callable[[str], None] = print):
        self.store = store
        self.log = log
        self._firsts: dict[int, int] = {}
        """Each past epoch's first iteration (`committing_epoch`)."""
        self._members_of: dict[int, frozenset[Worker]] = {}
        """Each past epoch's workers (`last_planned`)."""
        self._said: dict[Worker, int] = {}
        """The epoch each worker was last said to be still in (`out_of_their_epochs`)."""
        self._starting: set[Worker] = set()
        """New workers said to be starting (alive, not announced yet)."""

    def committing_epoch(self, iteration: int, current: Plan) -> int:
        """The epoch that commits (or committed) step `iteration` in the job's history, the
        plan in force being `current`: the newest one whose plan starts at or before it.
        Its workers, and only they, write that step's checkpoint."""
        epoch = current.epoch
        while epoch > 0 and (current.first_iteration if epoch == current.epoch
                             else self.first_iteration(epoch)) > iteration:
            epoch -= 1
        return epoch

    def first_iteration(self, epoch: int) -> int:
        """The first iteration of published epoch `epoch`'s plan."""
        if epoch not in self._firsts:  # published records never change
            key = keys.epoch_record(epoch)
            if not self.store.check([key]):  # (never: records are not deleted) the walk stops here
                return -1
            self._firsts[epoch] = EpochRecord.from_json(self.store.get(key)).plan.first_iteration
        return self._firsts[epoch]

    def out_of_their_epochs(self, workers: set[Worker], epoch: int) -> set[Worker]:
        """The workers of `workers` that can be planned in, the epoch in force being `epoch`:
        new ones that have announced themselves (their start-up is over), and those that
        have left the last epoch they were planned in (`keys.ready`). A node cut off and
        back shows its workers alive at once, but a worker still blocked in the epoch it
        was cut off in would never reach the next one's rendezvous, and the whole job
        would wait for it there; it is planned in once it has left (said once). (The
        leader follows both prefixes: these looks cost etcd no request.)"""
        ready = set()
        for worker in workers:
            last = self.last_planned(worker, epoch)
            if last is None:
                if self.store.check([keys.member(worker)]):
                    ready.add(worker)
                    self._starting.discard(worker)
                elif worker not in self._starting:
                    self._starting.add(worker)
                    self.log(f"controller: {worker_key(worker)} is starting; it is planned in once it has "
                             "announced itself (its start-up over), the job training meanwhile")
                continue
            key = keys.ready(worker)
            if self.store.check([key]) and int(self.store.get(key)) >= last:
                ready.add(worker)
            elif self._said.get(worker) != last:
                self._said[worker] = last
                self.log(f"controller: {worker_key(worker)} is alive but still in epoch {last} (cut off and "
                         "back?); it is planned in once it has left it")
        return ready

    def last_planned(self, worker: Worker, epoch: int, lookback: int = 50) -> int | None:
        """The newest epoch before `epoch` whose plan had `worker`, or None (within `lookback`)."""
        for past in range(epoch - 1, max(-1, epoch - 1 - lookback), -1):
            if past not in self._members_of:  # published records never change
                key = keys.epoch_record(past)
                if not self.store.check([key]):
                    return None
                self._members_of[past] = frozenset(EpochRecord.from_json(self.store.get(key)).plan.rank_of_worker())
            if worker in self._members_of[past]:
                return past
        return None
