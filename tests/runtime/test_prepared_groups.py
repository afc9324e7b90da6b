"""An epoch's groups connected while the epoch before it trains (`prepared_groups`), in
three real gloo processes: connected on a thread while the old world's all-reduces run,
then handed to torch at the switch, where the epoch's groups (`EpochGroups.build`) are
the connected ones: torch's registry knows them (as its pipelining needs), and their
collectives sum what they should."""
from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from planaria.runtime.parallel.groups import EpochGroups, creation_order
from planaria.runtime.parallel.prepared_groups import GIVEN_UP, PREPARED_BACKEND, PreparedGroups
from planaria.runtime.state.peer_snapshots import PeerSnapshots
from planaria.templates.plan import PipelinePlan, Plan, StagePlan

TIMEOUT = timedelta(seconds=60)


def _plan() -> Plan:
    """Three ranks: a pipeline of two stages (rank 0: layers 0-1, rank 1: layers 2-3) and
    one of a single stage (rank 2: every layer)."""
    two = PipelinePlan("two", (StagePlan("n0", (0,), ((0, 2),)), StagePlan("n1", (1,), ((2, 4),))), 2, 0)
    one = PipelinePlan("one", (StagePlan("n2", (2,), ((0, 4),)),), 2, 2)
    return Plan(epoch=1, first_iteration=0, num_layers=4, tp=1, schedule="1f1b", virtual_stages=1,
                global_batch=4, micro_batch=1, pipelines=(two, one))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out) -> None:
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=dist.PrefixStore("epoch0", store), rank=rank, world_size=3,
                            timeout=TIMEOUT)
    plan = _plan()
    snapshots = PeerSnapshots(1, 1, timeout_s=60, connect_timeout_s=60)
    prepared = PreparedGroups(1, plan, rank, lambda: dist.PrefixStore("epoch1", store), "gloo",
                              torch.device("cpu"), TIMEOUT, snapshot_group=snapshots.group_maker(plan)).start()
    steps = 0
    while not prepared.done.is_set() or steps < 20:  # the old epoch trains meanwhile
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == 3
        steps += 1
    assert prepared.connected, prepared.error
    dist.destroy_process_group()
    dist.init_process_group(prepared.install(), store=dist.PrefixStore("unused", store), rank=rank, world_size=3,
                            timeout=TIMEOUT)
    groups = EpochGroups.build(plan, rank, timeout=TIMEOUT, connect_timeout=TIMEOUT)
    sums = {}
    for bucket in groups.buckets:
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value, group=bucket.group)
        sums[str(bucket.ranks)] = value.item()
    world = torch.ones(1)
    dist.all_reduce(world)
    # The peer snapshots' group, connected with them: the epoch's snapshots use it at once.
    snapshots.begin_epoch(SimpleNamespace(plan=plan, rank=rank), 1, connected=prepared.snapshots)
    busy = snapshots.busy()
    mine = torch.tensor([float(rank + 1)])
    prepared.snapshots.group.allreduce([mine]).wait()
    out.put({"rank": rank, "steps": steps, "backend": dist.get_backend(), "world": world.item(), "sums": sums,
             "pipeline_rank": dist.get_rank(groups.pipeline), "pipeline_size": dist.get_world_size(groups.pipeline),
             "snapshots_busy": busy, "snapshots_sum": mine.item(), "snapshot_sockets": len(prepared.snapshots.sockets)})
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_groups_connected_while_the_old_world_trains_are_the_next_epochs_groups():
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(3)]
    for proc in procs:
        proc.start()
    try:
        results = {r["rank"]: r for r in (out.get(timeout=90) for _ in procs)}
    finally:
        for proc in procs:
            proc.join(timeout=15)
            proc.kill()
    assert all(r["steps"] >= 20 and r["backend"] == PREPARED_BACKEND and r["world"] == 3
               for r in results.values()), results
    # Layers 0-1 live on ranks 0 and 2, layers 2-3 on ranks 1 and 2: two buckets.
    assert results[0]["sums"] == {"(0, 2)": 4.0} and results[1]["sums"] == {"(1, 2)": 5.0}
    assert results[2]["sums"] == {"(0, 2)": 4.0, "(1, 2)": 5.0}
    assert [(results[r]["pipeline_rank"], results[r]["pipeline_size"]) for r in range(3)] == [(0, 2), (1, 2), (0, 1)]
    # Every rank's snapshot group spans the world, its connections known (to be shut down
    # should an exchange outlive a failed epoch), and the epoch's first step can take a round.
    assert all(r["snapshots_sum"] == 6.0 and r["snapshot_sockets"] >= 2 and not r["snapshots_busy"]
               for r in results.values()), results


def test_torch_asking_for_a_group_that_was_not_prepared_is_a_clear_error():
    plan = _plan()
    prepared = PreparedGroups(1, plan, 2, lambda: None, "gloo", torch.device("cpu"), TIMEOUT)  # never connected
    prepared.install()
    create = dist.Backend._plugins[PREPARED_BACKEND.upper()].creator_fn
    with pytest.raises(RuntimeError, match="more process groups than were prepared"):
        create(None, 0, 3, TIMEOUT)


def _held_short_of_barrier(prepared: PreparedGroups, groups: int):
    """`prepared`'s connection held once its `groups` backends are connected, short of its
    barrier: (held, release) events."""
    held, release = threading.Event(), threading.Event()
    add = prepared._add

    def holding(backend) -> None:
        add(backend)
        if len(prepared._made) == groups:
            held.set()
            release.wait(60)
    prepared._add = holding
    return held, release


@pytest.mark.timeout(120)
def test_a_connection_short_of_its_barrier_is_given_up_and_its_peers_in_the_barrier_fail_at_once():
    """Three ranks on threads of one process: ranks 0 and 1 connect every group and wait in
    the barrier; rank 2 has connected its groups too but not reached the barrier. Rank 0
    cannot give up (the barrier is every rank's), rank 2 can: its connections dropped, the
    others' barrier fails at once, not at the connect timeout."""
    plan, store, timeout = _plan(), dist.HashStore(), timedelta(seconds=90)
    ranks = [PreparedGroups(1, plan, r, lambda: store, "gloo", torch.device("cpu"), timeout) for r in range(3)]
    held, release = _held_short_of_barrier(ranks[2], 1 + sum(2 in g for g in creation_order(plan, ())))
    for prepared in ranks:
        prepared.start()
    try:
        assert held.wait(30)
        deadline = time.monotonic() + 30
        while not (ranks[0]._gate.in_barrier and ranks[1]._gate.in_barrier):
            assert time.monotonic() < deadline, "ranks 0 and 1 did not reach the barrier"
            time.sleep(0.01)
        assert not ranks[0].give_up_short_of_barrier()
        given_up = time.monotonic()
        assert ranks[2].give_up_short_of_barrier()
        assert ranks[0].done.wait(20) and ranks[1].done.wait(20)
        assert time.monotonic() - given_up < 20  # (the connect timeout is 90 s)
        assert not ranks[0].connected and not ranks[1].connected, (ranks[0].error, ranks[1].error)
    finally:
        release.set()
    assert ranks[2].done.wait(20) and ranks[2].error == GIVEN_UP


@pytest.mark.timeout(60)
def test_a_connection_waiting_for_an_absent_peer_is_given_up_at_once():
    plan, store = _plan(), dist.HashStore()
    prepared = PreparedGroups(1, plan, 0, lambda: store, "gloo", torch.device("cpu"), timedelta(seconds=5)).start()
    time.sleep(0.3)
    assert not prepared.done.is_set()  # (waiting for ranks 1 and 2, which never come)
    assert prepared.give_up_short_of_barrier() and prepared.give_up_short_of_barrier()
    assert prepared.done.wait(30) and not prepared.connected
