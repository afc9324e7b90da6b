"""A simulated worker's peer snapshots, as far as its status reports them.

A real worker's status lists the peer snapshots it keeps (`WorkerStatus.snapshots`,
`planaria.runtime.state.peer_snapshots`): what the controller plans a restore from, and
most of a status's bytes. `SimulatedSnapshots` keeps the same rounds with no data: every
`checkpoint.memory_every` steps a round of the step with the worker's own shards,
joined by the shards placed on it (`snapshot_placement`) once it is whole, which the
next step's commit tells (the exchange of one step's round ends within a step here);
the newest whole round and anything newer are kept. So a status after a failure lists
the round before the last step, whole, and the last one, its own shards only; after a
stop or the job's end, the round before the last step (none is taken at a step an epoch
ends after).
"""
from __future__ import annotations

from dataclasses import replace

from planaria.runtime.contract.exactly_once import CommitRecord, SnapshotHeld
from planaria.templates.plan import Plan, Worker
from planaria.templates.snapshots import Shard, snapshot_placement


class SimulatedSnapshots:
    """One worker's rounds (module docstring)."""

    def __init__(self, worker: Worker, every: int, copies: int):
        self.worker, self.every, self.copies = worker, every, copies
        self.rounds: dict[int, SnapshotHeld] = {}
        self._epoch, self._first = -1, 0
        self._own: tuple[Shard, ...] = ()
        self._incoming: tuple[Shard, ...] = ()

    def begin_epoch(self, plan: Plan, rank: int) -> None:
        """As `PeerSnapshots.begin_epoch`: rounds of steps the plan runs again dropped;
        what this worker keeps of its own, and receives, in this plan."""
        self.rounds = {step: held for step, held in self.rounds.items() if step < plan.first_iteration}
        self._epoch, self._first = plan.epoch, plan.first_iteration
        tp_rank = plan.rank_info(rank).tp_rank
        self._own = tuple((layer, tp_rank) for layer in plan.layers_of(rank))
        exchanged = self.every > 0 and len(plan.nodes()) >= 2
        placement = snapshot_placement(plan, self.copies) if exchanged else {}
        self._incoming = tuple(shard for shard, holders in placement.items() if self.worker in holders)

    def after_step(self, commit: CommitRecord, ends_epoch: bool) -> None:
        """After the commit of `commit.iteration` (`ends_epoch`: the job's last step, or the
        one the workers agreed to stop after, where no round is taken)."""
        step = commit.iteration
        earlier = [s for s, held in self.rounds.items() if held.epoch == self._epoch and self._first <= s < step]
        if earlier:
            newest = max(earlier)
            for s in earlier:
                self.rounds[s] = replace(self.rounds[s], shards=tuple(sorted({*self._own, *self._incoming})))
            self.rounds = {s: held for s, held in self.rounds.items() if s >= newest}
        if self.every > 0 and (step + 1) % self.every == 0 and not ends_epoch:
            self.rounds[step] = SnapshotHeld(commit=commit, epoch=self._epoch, shards=tuple(sorted(self._own)))

    def held(self) -> tuple[SnapshotHeld, ...]:
        return tuple(held for _, held in sorted(self.rounds.items()))
