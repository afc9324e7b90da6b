"""The job's checkpoints as the leader keeps them, and where a layer that lost every
replica comes back from (docs/recovery.md, "Checkpoints", "Restore" and "Fencing").

- `CheckpointPolicy`: where the periodic checkpoints go and how often.
- `JobCheckpoints`: which checkpoints are complete (the leader writes a step's manifest
  once every shard file of the epoch that committed the step is on disk), pruning to the
  newest `keep`, and forgetting those of steps the job goes back before.
- `JobCheckpoints.restore`: the restore, when some shard has no holder left: the newest
  step whose every shard some worker keeps in its peer snapshots, or else the newest
  complete checkpoint, whichever is newer (replicas first, peers' memory second, disk last).

Which epoch committed a step is the caller's (`planaria.elastic.epoch_history`): passed in
as `committing_epoch`. The workers write the shard files; nothing here reads or writes
layer state. Loaded by an agent, through the controller: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from planaria.runtime.contract import keys
from planaria.runtime.contract.checkpoint_layout import (complete_checkpoints, epoch_dir, missing_shards, prune,
                                                         step_dir, write_manifest)
from planaria.runtime.contract.exactly_once import CommitRecord, SnapshotHeld, WorkerStatus
from planaria.templates.plan import Plan, Worker, missing_from

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where the job's periodic checkpoints go and how often (the `checkpoint` config)."""

    directory: Path
    every: int
    keep: int = 2


@dataclass(frozen=True)
class Restore:
    """Where the layers of a step before the one lost come back from: peer snapshots or a
    checkpoint (`JobCheckpoints.restore`)."""

    step: int
    """The step restored; the next plan begins after it."""
    snapshot: SnapshotHeld | None = None
    """The peer snapshots of `step` (None: a checkpoint)."""
    keepers: dict[tuple[int, int], set[Worker]] = field(default_factory=dict)
    """Shard -> the workers that keep it in their snapshots of `step` (the transfers' sources)."""
    checkpoint: Path | None = None
    """The checkpoint of `step` (None: peer snapshots)."""


class JobCheckpoints:
    """A job's periodic checkpoints, from the leader's side (module docstring)."""

    def __init__(self, store: dist.Store, policy: CheckpointPolicy | None, total_steps: int,
                 log: Callable[[str], None] = print):
        self.store = store
        self.policy = policy
        """None, or `every` 0: the job writes no checkpoint."""
        self.total_steps = total_steps
        self.log = log
        self.completed: list[int] = []
        """The steps whose checkpoints are complete, oldest first (pruned ones included)."""

    def on_disk(self) -> list[tuple[int, Path]]:
        """The complete checkpoints in the directory, oldest first: (step, its directory)."""
        if self.policy is None or not self.policy.every:
            return []
        return complete_checkpoints(self.policy.directory)

    def complete(self, plan: Plan, committing_epoch: Callable[[int], int]) -> None:
        """Write the manifest of each checkpoint whose shard files are all on disk; `plan`
        is the plan in force.

        Checkpoints complete in order while an epoch trains. One that a failure left
        incomplete (a worker died before writing its shards) is passed over once the
        epoch in force began after it: no worker will write it any more, and waiting
        for it would keep every later checkpoint from counting.

        Only the shards of the epoch that committed the step count (`committing_epoch`):
        reports and files of any other epoch's workers (one cut off and replaced, writing
        late; one of a timeline the job went back from) are never counted nor named."""
        policy = self.policy
        if policy is None or not policy.every:
            return
        total = plan.num_layers * plan.tp
        newest = self.completed[-1] if self.completed else -1
        for k in range(newest + policy.every, self.total_steps, policy.every):
            epoch = committing_epoch(k)
            key = keys.checkpoint_shards(k, epoch)
            reported = self.store.check([key]) and self.store.add(key, 0) >= total
            if reported and not step_dir(policy.directory, k).is_dir():  # completed and pruned already
                self.completed.append(k)
                continue
            # The files themselves decide, not the count alone: a report retried after its
            # reply was lost counts twice, and a manifest must never name a missing shard.
            if not reported or missing_shards(epoch_dir(policy.directory, k, epoch), plan.num_layers, plan.tp):
                if k < plan.first_iteration:
                    continue  # abandoned (or its last shards still being written: asked again)
                break
            commit = CommitRecord.from_json(self.store.get(keys.checkpoint_commit(k, epoch)))
            write_manifest(policy.directory, commit, plan.num_layers, plan.tp, epoch=epoch)
            self.completed.append(k)
            prune(policy.directory, policy.keep)
            self.log(f"controller: checkpoint of iteration {k} complete")

    def forget_after(self, iteration: int) -> None:
        """The job goes back to `iteration`: checkpoints of later steps are written again
        by the epochs that commit those steps again (under their own keys and directories:
        nothing of the earlier ones is counted)."""
        if self.policy is not None and self.policy.every:
            prune(self.policy.directory, self.policy.keep, after=iteration)
        self.completed = [k for k in self.completed if k <= iteration]

    def newest_step(self, statuses: dict[Worker, WorkerStatus], first: int, plan: Plan,
                    committing_epoch: Callable[[int], int]) -> int | None:
        """The step `restore` would go back to, without going back (nothing forgotten,
        nothing said); None when neither a whole peer snapshot nor a checkpoint is there."""
        found, on_disk = self._newest(statuses, first, plan, committing_epoch)
        steps = ([found[0].step] if found is not None else []) + [i for i, _ in on_disk[-1:]]
        return max(steps, default=None)

    def _newest(self, statuses, first: int, plan: Plan, committing_epoch):
        """(the newest whole peer snapshot before `first` or None, the complete checkpoints before it)."""
        return (newest_whole_snapshot(statuses, first, plan, committing_epoch),
                [(i, path) for i, path in self.on_disk() if i < first])

    def restore(self, statuses: dict[Worker, WorkerStatus], first: int, plan: Plan, missing,
                committing_epoch: Callable[[int], int]) -> Restore | None:
        """Where shards `missing` of `plan`, which starts at `first`, come back from: the
        newest step before `first` whose every shard some worker of `plan` keeps in its
        peer snapshots, or the newest complete checkpoint before `first` if it is newer.
        The job forgets the checkpoints after the step it goes back to. None: there is
        neither."""
        found, on_disk = self._newest(statuses, first, plan, committing_epoch)
        if found is not None and (not on_disk or found[0].step >= on_disk[-1][0]):
            snapshot, keepers = found
            self.log(f"controller: layer shards {missing} lost every replica; going back to the peer "
                     f"snapshots of iteration {snapshot.step} ({first - 1 - snapshot.step} step(s) trained again)")
            self.forget_after(snapshot.step)
            return Restore(snapshot.step, snapshot=snapshot, keepers=keepers)
        if not on_disk:
            return None
        iteration, path = on_disk[-1]
        self.log(f"controller: layer shards {missing} lost every replica and peer snapshot; going back "
                 f"to the checkpoint of iteration {iteration} ({first - 1 - iteration} step(s) of work lost)")
        self.forget_after(iteration)
        return Restore(iteration, checkpoint=path)


def newest_whole_snapshot(statuses: dict[Worker, WorkerStatus], first: int, plan: Plan,
                          committing_epoch: Callable[[int], int]):
    """(the step's `SnapshotHeld`, shard -> the workers that keep it) of the newest
    step before `first` whose every shard some worker of `plan` keeps, or None.

    Only snapshots of the job's own history count: of a step as committed by the
    epoch that committed it (`committing_epoch`). One kept by a worker from a
    timeline the job went back from (it was cut off meanwhile) is never used."""
    kept: dict[tuple[int, int], dict[tuple[int, int], set[Worker]]] = {}
    commits: dict[tuple[int, int], CommitRecord] = {}
    for worker, status in statuses.items():
        for held in status.snapshots:
            if held.step < first and held.epoch == committing_epoch(held.step):
                key = (held.step, held.epoch)
                commits[key] = held.commit
                for shard in held.shards:
                    kept.setdefault(key, {}).setdefault(tuple(shard), set()).add(worker)
    for key in sorted(kept, reverse=True):
        if not missing_from(kept[key], plan):
            return SnapshotHeld(commit=commits[key], epoch=key[1]), kept[key]
    return None
