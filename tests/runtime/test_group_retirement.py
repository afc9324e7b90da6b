"""An ended epoch's process groups are destroyed on a thread while the next epoch's
world connects (`planaria.runtime.parallel.groups.GroupRetirement`).

Two real processes over gloo, three epochs: each epoch's world and subgroups are held,
taken out of torch's registry, and retired; the next world must connect and reduce
correctly while the last one's destructors may still run, and once a retirement is
waited for, the old epochs' connections must be closed (no socket opened after the
store's is still open). Retired after a stop at a step boundary (`deferred`), the last
epoch's groups keep their connections until the next epoch's first step says go.
"""
from __future__ import annotations

import multiprocessing as mp
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from planaria.runtime.parallel.groups import GroupRetirement
from planaria.runtime.parallel.release import socket_inodes

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    store.set(f"ready{rank}", "1")  # both connected to the store: its sockets are settled
    store.wait(["ready0", "ready1"])
    store_only = set(socket_inodes())
    retirement = GroupRetirement()
    sums, open_after_wait = [], []
    for epoch in range(3):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"epoch/{epoch}/", store), rank=rank,
                                world_size=2, timeout=timedelta(seconds=30))
        pipeline = dist.new_group([0, 1])
        value = torch.tensor([float(rank + 1 + epoch)])
        dist.all_reduce(value, group=pipeline)
        dist.all_reduce(value)
        sums.append(value.item())
        held = GroupRetirement.hold()
        dist.destroy_process_group(pipeline)
        del pipeline
        dist.destroy_process_group()
        assert not dist.is_initialized()
        retirement.retire(held, deferred=epoch == 2)  # the next epoch connects while these groups go
        assert held == []
    time.sleep(0.5)
    open_after_wait.append(len(set(socket_inodes()) - store_only))  # the last epoch's: deferred
    retirement.go()
    retirement.wait(timeout_s=30)
    open_after_wait.append(len(set(socket_inodes()) - store_only))  # opened since, still open
    out.put((rank, sums, open_after_wait, len(GroupRetirement.hold())))


def test_the_next_world_connects_while_the_last_ones_groups_are_destroyed_and_they_close():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, out)) for rank in range(2)]
    for p in procs:
        p.start()
    results = dict((r, rest) for r, *rest in (out.get(timeout=100) for _ in procs))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for rank in range(2):
        sums, open_after_wait, registered = results[rank]
        # each epoch: (1 + e) + (2 + e), doubled by the second all-reduce over the world
        assert sums == [2 * (3 + 2 * e) for e in range(3)]
        deferred, after = open_after_wait
        assert deferred > 0, "a deferred retirement closed its groups' connections before it was told to go"
        assert after == 0, "the retired groups' connections are still open"
        assert registered == 0
