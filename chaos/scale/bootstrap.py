"""The requests an epoch's process groups make to their bootstrap store, replayed.

A simulated worker builds no process group, but its store sees what a real one's would:
`replay(store, plan, rank, backend)` makes the same operations on the epoch's rendezvous
store (`StoreCoordinator.rendezvous_store`), for the world group and every group
`planaria.runtime.parallel.groups.EpochGroups.build` creates (`creation_order`).

- gloo (torch's ProcessGroupGloo: a full mesh): each rank of a group sets one key with
  its address, then waits for and reads every rank's key, its own included. The keys and
  sizes below are recorded from torch 2.13's gloo; the harness's test compares this
  replay with a real gloo job's store operations, key by key.
- nccl (ProcessGroupNCCL): a communicator's rank 0 sets its unique id under the group's
  store, the others wait for and read it: one key per group, read by its other ranks
  (torch's `broadcastUniqueNCCLID`). Lazy initialisation: at the group's first
  collective, which every group of an epoch has in its first step.
"""
from __future__ import annotations

from planaria.runtime.parallel.groups import creation_order
from planaria.templates.plan import Plan

GLOO_WORLD = "0//cpu//0/"
"""The world group's keys: this, then the rank."""
GLOO_ADDRESS_BYTES = (186, 170)
"""A rank's address as gloo sets it: in the world group, in a group made by `new_group`."""
NCCL_UNIQUE_ID_BYTES = 128


def gloo_group(index: int) -> str:
    """The key prefix of the `index`-th group `dist.new_group` made (1-based)."""
    return f"0//{index}//cpu//0/"


def gloo_direct(prefix: str) -> str:
    """The key prefix of a ProcessGroupGloo made directly on `PrefixStore(prefix, store)`
    (a planned leave's handoff group, `transfer.Handoff.group`)."""
    return f"{prefix}/0/"


def mesh(store, prefix: str, rank: int, size: int, nbytes: int) -> None:
    """A gloo full mesh's rendezvous, as rank `rank` of `size`."""
    store.set(f"{prefix}{rank}", b"a" * nbytes)
    for peer in range(size):
        key = f"{prefix}{peer}"
        store.wait([key])
        store.get(key)


def unique_id(store, key: str, rank: int) -> None:
    """An NCCL communicator's rendezvous: rank 0 publishes the id, the others read it."""
    if rank == 0:
        store.set(key, b"n" * NCCL_UNIQUE_ID_BYTES)
    else:
        store.wait([key])
        store.get(key)


def replay(store, plan: Plan, rank: int, backend: str, tied_layers: tuple[int, ...] = ()) -> None:
    """The world group's rendezvous and every group of the epoch, as `rank` of `plan`."""
    groups = creation_order(plan, tied_layers)
    if backend == "gloo":
        mesh(store, GLOO_WORLD, rank, plan.world_size, GLOO_ADDRESS_BYTES[0])
        for index, ranks in enumerate(groups, start=1):
            if rank in ranks:
                mesh(store, gloo_group(index), ranks.index(rank), len(ranks), GLOO_ADDRESS_BYTES[1])
        return
    unique_id(store, "world/0", rank)
    for index, ranks in enumerate(groups, start=1):
        if rank in ranks:
            unique_id(store, f"{index}/0", ranks.index(rank))
