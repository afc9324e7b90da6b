"""The requests an epoch's process groups make to their bootstrap store, replayed.

A simulated worker builds no process group, but its store sees what a real one's would:
`replay(store, plan, rank, backend)` makes the same operations on the epoch's rendezvous
store (`StoreCoordinator.rendezvous_store`), for the world group and every group
`planaria.runtime.parallel.groups.EpochGroups.build` creates (`creation_order`).

- gloo (torch's ProcessGroupGloo: a full mesh): each rank of a group sets one key with
  its address, then waits for and reads every rank's key, its own included. The keys and
  sizes below are recorded from torch 2.13's gloo; tests/chaos/test_scale_traffic.py
  compares this replay with a real gloo job's store operations, key by key.
- nccl (ProcessGroupNCCL): a communicator's rank 0 sets its unique id under the group's
  store, the others wait for and read it: one key per group, read by its other ranks
  (torch's `broadcastUniqueNCCLID`). Lazy initialisation: at the group's first
  collective, which every group of an epoch has in its first step.
"""
from __future__ import annotations

from datetime import timedelta

from planaria.runtime.parallel.groups import creation_order
from planaria.runtime.parallel.prepared_groups import PREFIX as PREPARED, SNAPSHOTS as PREPARED_SNAPSHOTS
from planaria.templates.plan import Plan

GLOO_WORLD = "0//cpu//0/"
"""The world group's keys: this, then the rank."""
GLOO_ADDRESS_BASE_BYTES, GLOO_ADDRESS_RANK_BYTES = 154, 8
"""A rank's value in a gloo group of n ranks is 154 + 8n bytes (as recorded from torch
2.13: 162 bytes for one rank, 170 for two, 178, 194 and 218 for three, five and eight)."""
NCCL_UNIQUE_ID_BYTES = 128
PEER_SNAPSHOTS = "peer-snapshots/"
"""The prefix of an epoch's peer-snapshot group (`PeerSnapshots.begin_epoch`)."""
HANDOFF = "handoff/"
"""The prefix of a planned leave's handoff group (`transfer.Handoff.group`)."""


def gloo_address_bytes(size: int) -> int:
    """The size of a rank's value in a gloo group of `size` ranks."""
    return GLOO_ADDRESS_BASE_BYTES + GLOO_ADDRESS_RANK_BYTES * size


def gloo_group(index: int) -> str:
    """The key prefix of the `index`-th group `dist.new_group` made (1-based)."""
    return f"0//{index}//cpu//0/"


def gloo_direct(prefix: str) -> str:
    """The key prefix, on `store`, of a ProcessGroupGloo made directly on
    `PrefixStore(prefix, store)` (a planned leave's handoff group, an epoch's peer
    snapshot group): c10d's PrefixStore joins with a "/", and gloo's own keys are
    "0/<rank>"."""
    return f"{prefix}/0/"


def mesh(store, prefix: str, rank: int, size: int, timeout: timedelta | None = None) -> None:
    """A gloo full mesh's rendezvous, as rank `rank` of `size` (`timeout`: its waits',
    as the group's own connect timeout bounds a real one's; None: the store's)."""
    store.set(f"{prefix}{rank}", b"a" * gloo_address_bytes(size))
    for peer in range(size):
        key = f"{prefix}{peer}"
        _wait(store, key, timeout)
        store.get(key)


def _wait(store, key: str, timeout: timedelta | None) -> None:
    if timeout is None:
        store.wait([key])
    else:
        store.wait([key], timeout)


def unique_id(store, key: str, rank: int, timeout: timedelta | None = None) -> None:
    """An NCCL communicator's rendezvous: rank 0 publishes the id, the others read it."""
    if rank == 0:
        store.set(key, b"n" * NCCL_UNIQUE_ID_BYTES)
    else:
        _wait(store, key, timeout)
        store.get(key)


def replay_prepared(store, plan: Plan, rank: int, backend: str, tied_layers: tuple[int, ...] = (),
                    groups: list[tuple[int, ...]] | None = None, timeout: timedelta | None = None,
                    snapshots: bool = False) -> None:
    """The groups of a join's next epoch connected ahead (`PreparedGroups`), as `rank`:
    the world and every group of the rank, each made directly on `PrefixStore(<prefix>,
    PrefixStore("prepared", store))` (c10d joins prefixes with "/"; gloo's own keys are
    "0/<rank>", an NCCL communicator's unique id "0"), then, with `snapshots`, the peer
    snapshots' gloo group over the world. The barrier that ends it is a collective: no
    store operation."""
    groups = creation_order(plan, tied_layers) if groups is None else groups
    mine = [("world", rank, plan.world_size)] + [
        (str(index), ranks.index(rank), len(ranks)) for index, ranks in enumerate(groups, start=1) if rank in ranks]
    for name, group_rank, size in mine:
        if backend == "gloo":
            mesh(store, f"{PREPARED}/{name}/0/", group_rank, size, timeout)
        else:
            unique_id(store, f"{PREPARED}/{name}/0", group_rank, timeout)
    if snapshots:
        mesh(store, f"{PREPARED}/{PREPARED_SNAPSHOTS}/0/", rank, plan.world_size, timeout)


def replay(store, plan: Plan, rank: int, backend: str, tied_layers: tuple[int, ...] = (),
           groups: list[tuple[int, ...]] | None = None, timeout: timedelta | None = None) -> None:
    """The world group's rendezvous and every group of the epoch, as `rank` of `plan`
    (`groups`: the plan's `creation_order`, when the caller has it already)."""
    groups = creation_order(plan, tied_layers) if groups is None else groups
    if backend == "gloo":
        mesh(store, GLOO_WORLD, rank, plan.world_size, timeout)
        for index, ranks in enumerate(groups, start=1):
            if rank in ranks:
                mesh(store, gloo_group(index), ranks.index(rank), len(ranks), timeout)
        return
    unique_id(store, "world/0", rank, timeout)
    for index, ranks in enumerate(groups, start=1):
        if rank in ranks:
            unique_id(store, f"{index}/0", ranks.index(rank), timeout)
