"""The process groups of one epoch, built from a Plan and passed explicitly.

No process-wide registry: an `EpochGroups` is made for one plan and destroyed when
the plan changes. Every rank creates every group of the plan, in the same order
(`dist.new_group` is collective over the whole world), and keeps the ones it is in.

Groups of a rank:
- `pipeline`: the ranks of its pipeline with the same tp rank; activations and
  their gradients travel along it (one per pipeline "lane").
- `tensor_parallel`: the workers of its stage (no group at tp = 1).
- `buckets`: for gradient sync, one group per distinct replica group this rank is in,
  with the layers whose replica group it is. Layers that share a replica group share
  one bucket and one all-reduce.
- `tied`: with tied embeddings, the group of every rank holding the embedding or
  the head with this rank's tp rank (the union of the two layers' replica groups): the
  tied weight's gradient is summed over it (`TiedGroup`).
- `world`: the whole epoch, for the commit all-reduce.

`GroupRetirement` destroys a past epoch's groups off the path of the next one.
"""
from __future__ import annotations

import gc
import threading
from dataclasses import dataclass, field

import torch.distributed as dist

from planaria.runtime.models.tensor_parallel import TensorParallel
from planaria.runtime.parallel.release import group_options, registered_groups
from planaria.templates.plan import Plan


@dataclass
class GradientBucket:
    """Layers (of one tp rank) whose replicas live on the same ranks; synced together."""

    ranks: tuple[int, ...]
    layers: list[int]
    group: dist.ProcessGroup | None  # None when the layer has a single replica


@dataclass
class TiedGroup:
    """The ranks holding a copy of a tied weight's shard (one tp rank): those with the
    embedding, the head, or both. Their summed local gradients are the weight's gradient."""

    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None  # None when this rank holds every copy


@dataclass
class EpochGroups:
    rank: int
    pipeline: dist.ProcessGroup
    tensor_parallel: TensorParallel
    buckets: list[GradientBucket]
    world: dist.ProcessGroup
    tied: TiedGroup | None = None
    """Set on the ranks holding a copy of the tied weight (`build(tied_layers=...)`)."""
    _owned: list = field(default_factory=list, repr=False)

    @classmethod
    def build(cls, plan: Plan, rank: int, world: dist.ProcessGroup | None = None,
              timeout=None, connect_timeout=None, tied_layers: tuple[int, ...] = ()) -> "EpochGroups":
        """`connect_timeout`: the groups connect under it (a peer that died since the
        rendezvous fails the epoch this soon), then take `timeout` for their operations.
        `tied_layers`: the layers holding copies of one tied weight (the embedding and
        the head with `model.tie_embeddings`), given alike on every rank."""
        if dist.get_world_size(world) != plan.world_size:
            raise ValueError(
                f"the plan of epoch {plan.epoch} has {plan.world_size} ranks but the process "
                f"group has {dist.get_world_size(world)}"
            )
        owned: list[dist.ProcessGroup] = []
        options = group_options(dist.get_backend(world))

        def new_group(ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
            group = dist.new_group(list(ranks), timeout=connect_timeout or timeout, pg_options=options)
            if rank in ranks:
                owned.append(group)
                if connect_timeout is not None and timeout is not None:
                    set_operation_timeout(group, timeout)
                return group
            return None

        info = plan.rank_info(rank)
        pipeline = _mine(rank, [(r, new_group(r)) for r in plan.pipeline_groups()])
        # At tp = 1 each tp group is one rank, which needs no group (`TensorParallel` takes
        # None); making one still costs a store barrier over the whole world, tens of ms
        # over etcd with several ranks, at the start of every epoch.
        tp_group = None
        if plan.tp > 1:
            tp_group = _mine(rank, [(r, new_group(r)) for r in plan.tensor_parallel_groups()])
        tp = TensorParallel(group=tp_group, rank=info.tp_rank, size=plan.tp)
        buckets = _build_buckets(plan, rank, new_group)
        tied = _build_tied_group(plan, rank, new_group, tied_layers) if tied_layers else None
        return cls(rank=rank, pipeline=pipeline, tensor_parallel=tp, buckets=buckets,
                   world=world or dist.group.WORLD, tied=tied, _owned=owned)

    def destroy(self) -> None:
        for group in self._owned:
            dist.destroy_process_group(group)
        self._owned.clear()


def creation_order(plan: Plan, tied_layers: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    """The ranks of every group `EpochGroups.build` creates, in the order it creates them
    (every rank creates each one: `dist.new_group` is collective over the world). What
    the epoch's bootstrap store sees follows from it (the scale harness replays it)."""
    made: list[tuple[int, ...]] = []

    def record(ranks: tuple[int, ...]) -> None:
        made.append(tuple(ranks))

    for ranks in plan.pipeline_groups():
        record(ranks)
    if plan.tp > 1:
        for ranks in plan.tensor_parallel_groups():
            record(ranks)
    _build_buckets(plan, -1, record)
    if tied_layers:
        _build_tied_group(plan, -1, record, tied_layers)
    return made


def set_operation_timeout(group: dist.ProcessGroup | None, timeout) -> None:
    """The timeout of a connected group's operations. A group connects (gloo: a full mesh
    of sockets) under the timeout it was created with; on a peer that died after the
    rendezvous the listening side waits that long, so groups are created under a short
    connect timeout and given the operations' one afterwards. torch has no public setter
    for it; `_set_pg_timeout` is what `init_process_group` itself relies on."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def _mine(rank: int, groups: list) -> dist.ProcessGroup:
    return next(group for ranks, group in groups if rank in ranks)


def _build_buckets(plan: Plan, rank: int, new_group) -> list[GradientBucket]:
    """One bucket per distinct replica group; every rank walks them in the same sorted order.

    The sorted order is a single global order of all-reduces, so two ranks that share
    several buckets always meet in the same one first: no cycle of waits is possible.
    """
    layers_by_ranks: dict[tuple[int, ...], list[int]] = {}
    for (layer, _tp_rank), ranks in plan.replica_groups().items():
        layers_by_ranks.setdefault(ranks, []).append(layer)
    buckets = []
    for ranks in sorted(layers_by_ranks):
        group = new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            buckets.append(GradientBucket(ranks=ranks, layers=sorted(layers_by_ranks[ranks]),
                                          group=group))
    return buckets


def _tied_ranks(plan: Plan, tied_layers: tuple[int, ...], tp_rank: int) -> tuple[int, ...]:
    """Sorted ranks holding any of `tied_layers` with tp rank `tp_rank`."""
    groups = plan.replica_groups()
    return tuple(sorted({r for layer in tied_layers for r in groups[(layer, tp_rank)]}))


def _build_tied_group(plan: Plan, rank: int, new_group, tied_layers: tuple[int, ...]) -> TiedGroup | None:
    """One group per tp rank, created in tp order by every rank. A rank is in one at most
    (it has one tp rank), and syncs it after all its buckets: every rank follows the
    same global order (buckets, then tied groups), so no cycle of waits is possible."""
    mine = None
    for tp_rank in range(plan.tp):
        ranks = _tied_ranks(plan, tied_layers, tp_rank)
        group = new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = TiedGroup(ranks=ranks, group=group)
    return mine


def forget_failed_world() -> None:
    """After an `init_process_group` that failed (a peer never came), make this process's
    next world group carry the same name as its peers'.

    torch names the default group from a per-process counter that it advances before
    connecting and resets only in `destroy_process_group`, which refuses when no world
    is initialized. So a worker whose epoch failed in the rendezvous would name its next
    world "1" while the survivors, who destroyed theirs, name it "0": the two sides wait
    for different keys until the connect timeout, epoch after epoch. Resetting the
    counter (a private field; checked, so a torch without it changes nothing) is what
    `destroy_process_group` would have done.
    """
    if dist.is_initialized():
        return
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


class GroupRetirement:
    """Runs the destructors of a past epoch's process groups on a thread of their own.

    Taking a group out of torch's registry (`destroy_process_group`) is immediate; what
    takes time is the group's destructor, once the last reference goes: about 10 ms for
    each gloo group (it closes the group's connections and joins its threads; an epoch's
    five groups took 70-90 ms in three processes on two cores), during which the worker
    could neither read the next epoch's record nor connect its world. Holding a
    reference to every group while the epoch is torn down leaves torch only the
    registry's part; the references then go on a thread, whose destructors run without
    the interpreter's lock (torch's groups release it as they are destroyed).

    The destructors start as soon as the epoch's groups are out of the registry, so a
    peer blocked on this worker after a failure still sees its connections close within
    milliseconds (`ElasticWorker._leave_epoch`). For NCCL groups it changes nothing:
    `destroy_process_group` shuts their communicators down itself."""

    DEFERRED_AT_MOST_S = 30.0
    """How long a deferred retirement waits for `go` (the next epoch's first step)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._go: threading.Event | None = None

    @staticmethod
    def hold() -> list[dist.ProcessGroup]:
        """References to every group of the process, taken before the epoch's teardown."""
        return registered_groups() or []

    def retire(self, held: list[dist.ProcessGroup], collect: bool = False, deferred: bool = False) -> None:
        """Drop `held` (from `hold`) on a thread, after the groups it held are destroyed.
        `collect`: that thread also runs the cyclic collector, which frees what the epoch's
        objects (stages, schedules) still held of its groups: off the path into the next
        epoch (up to 27 ms of a join's switch, measured with four workers on two cores),
        which the caller then does not collect itself. `deferred`: the destructors and the
        collection wait until `go` (at most `DEFERRED_AT_MOST_S`): after a stop at a step
        boundary nobody waits on the old groups, and their CPU (some 10 ms a gloo group,
        and the collection's) went to the next epoch's entry, every worker's at once."""
        self.wait()
        groups, held[:] = list(held), []
        go = self._go = threading.Event()
        if not deferred:
            go.set()

        def drop() -> None:
            go.wait(self.DEFERRED_AT_MOST_S)
            groups.clear()
            if collect:
                gc.collect()

        self._thread = threading.Thread(target=drop, name="planaria-retire-groups", daemon=True)
        self._thread.start()

    def go(self) -> None:
        """A deferred retirement goes now (the next epoch committed its first step)."""
        if self._go is not None:
            self._go.set()

    def wait(self, timeout_s: float | None = None) -> None:
        """The last retirement's destructors have run (or `timeout_s` passed); a deferred
        one goes at once."""
        self.go()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self._thread = None
