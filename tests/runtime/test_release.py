"""Releasing a collective blocked on a silent peer (`planaria.runtime.parallel.release`).

Real gloo groups in real processes: one peer stays alive with its sockets open and never
enters the collective, as a frozen or cut-off peer does; the other's all-reduce must fail
within a second of the release, not at its (two-minute) timeout, and the control plane's
store connection must still work afterwards. The NCCL path's choices are checked here
on CPU where they can be (the environment, the options, the factory); the aborts
themselves are in tests/gpu/.
"""
from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from planaria.runtime.contract import env
from planaria.runtime.parallel.release import (CommunicatorAbort, SocketRelease, abort_concurrently, epoch_release,
                                               group_options)
from planaria.runtime.worker.coordination import store_ports


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _silent_peer(port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timedelta(seconds=120))
    dist.all_reduce(torch.ones(4))
    store.set("silent", "1")
    time.sleep(120)  # alive, sockets open, never in the next collective


def _released_rank(port: int, release_after_s: float, out) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=60))
    release = SocketRelease(keep_ports={port})  # before the epoch's group, as a worker makes it
    dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=120))
    dist.all_reduce(torch.ones(4))
    store.wait(["silent"])
    released = {}

    def release_later() -> None:
        time.sleep(release_after_s)
        released["at"] = time.monotonic()
        released["what"] = release.release()

    threading.Thread(target=release_later, daemon=True).start()
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        outcome = "completed"
    except RuntimeError as err:
        outcome = str(err).splitlines()[0]
    failed = time.monotonic()
    store.set("still", "usable")  # the control plane's connection survived the release
    out.put({"outcome": outcome, "waited_s": failed - start, "after_release_s": failed - released["at"],
             "what": released["what"], "store": store.get("still").decode()})
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_collective_blocked_on_a_silent_peer_fails_within_a_second_of_the_release():
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), _free_port()
    released = ctx.Process(target=_released_rank, args=(port, 2.0, out))
    silent = ctx.Process(target=_silent_peer, args=(port,))
    released.start()
    silent.start()
    try:
        result = out.get(timeout=75)
        released.join(timeout=15)
    finally:
        for proc in (released, silent):
            proc.kill()
            proc.join()
    assert result["outcome"] != "completed"
    assert result["after_release_s"] < 1.0, result
    assert 1.5 < result["waited_s"] < 5.0, result  # it did wait for the silent peer until then
    assert result["what"].endswith("connection(s) shut down") and not result["what"].startswith("0 "), result
    assert result["store"] == "usable"
    assert released.exitcode == 0 or released.exitcode == -9  # exited by itself, or killed after reporting


def test_a_release_before_any_group_shuts_nothing_and_may_be_repeated():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        release = SocketRelease()
        with socket.create_connection(("127.0.0.1", port)) as kept:  # new, but to the store's port
            release.keep_ports = frozenset({port})
            assert release.release() == "0 connection(s) shut down"
            assert release.release() == "0 connection(s) shut down" and release.released
            kept.sendall(b"x")  # still open
            conn, _ = server.accept()
            with conn:
                assert conn.recv(1) == b"x"


def test_a_connection_opened_during_the_epoch_is_shut_down_and_its_reader_woken():
    with socket.create_server(("127.0.0.1", 0)) as server:
        release = SocketRelease()
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        got = {}
        reader = threading.Thread(target=lambda: got.setdefault("bytes", client.recv(1)))
        reader.start()
        time.sleep(0.2)
        assert release.release() == "2 connection(s) shut down"  # both ends live in this process
        reader.join(timeout=5)
        assert not reader.is_alive() and got["bytes"] == b""  # woken, as by a peer's close
        client.close()
        conn.close()


def test_the_store_ports_are_read_from_every_kind_of_store_address():
    assert store_ports("127.0.0.1:29500") == {29500}
    assert store_ports("tcp://node1:1234") == {1234}
    assert store_ports("etcd://10.0.0.1:2379,10.0.0.2:2380/planaria/run") == {2379, 2380}


def test_each_backend_gets_its_release_and_an_unknown_one_is_refused():
    assert isinstance(epoch_release("gloo", {1}), SocketRelease)
    nccl = epoch_release("nccl")
    assert isinstance(nccl, CommunicatorAbort)
    assert nccl.release() == "no communicator yet" and nccl.released  # no group in this process
    with pytest.raises(ValueError, match="use gloo or nccl"):
        epoch_release("mpi")


def _abort_every_group_of_a_gloo_world(port: int, found) -> None:
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    for _ in range(3):  # an epoch's groups beside the world
        dist.new_group([0])
    found.put(CommunicatorAbort().release())
    dist.destroy_process_group()  # the registry is the main thread's to tear down, as after a failure
    found.put("destroyed")


def test_the_nccl_release_aborts_every_group_of_the_process_and_leaves_the_teardown_to_the_worker():
    """On gloo `abort()` does nothing, but the release's reading of torch's registry and
    the teardown after it are the same as on NCCL (tests/gpu runs the real aborts)."""
    ctx = mp.get_context("spawn")
    found = ctx.Queue()
    proc = ctx.Process(target=_abort_every_group_of_a_gloo_world, args=(_free_port(), found))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert [found.get(timeout=5), found.get(timeout=5)] == ["4 communicator(s) aborted", "destroyed"]


class _SlowAbort:
    """A group whose abort takes as long as an NCCL communicator's (about a second)."""

    def __init__(self, seconds: float, fails: bool = False):
        self.seconds, self.fails, self.aborted = seconds, fails, False

    def abort(self) -> None:
        time.sleep(self.seconds)
        if self.fails:
            raise RuntimeError("Process group cannot be None")
        self.aborted = True


def test_groups_are_aborted_side_by_side_and_one_that_fails_does_not_stop_the_others():
    groups = [_SlowAbort(0.5) for _ in range(4)] + [_SlowAbort(0.5, fails=True)]
    started = time.monotonic()
    assert abort_concurrently(groups) == 4
    assert time.monotonic() - started < 1.5  # one by one: 2.5 s
    assert all(g.aborted for g in groups[:4])


def test_group_options_are_torchs_defaults_for_gloo_and_non_blocking_communicators_for_nccl():
    assert group_options("gloo") is None
    if dist.is_nccl_available():
        assert group_options("nccl").config.blocking == 0
    else:
        with pytest.raises(RuntimeError, match="this torch has no NCCL"):
            group_options("nccl")


def test_the_nccl_environment_keeps_a_survivor_alive_and_keeps_what_the_user_set():
    environ: dict[str, str] = {}
    assert env.nccl_recovery(environ, timeout_s=300) == []
    assert environ == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0",
                       "TORCH_NCCL_NONBLOCKING_TIMEOUT": "300"}
    users = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "60"}
    warnings = env.nccl_recovery(users, timeout_s=300)
    assert users["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and users["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "60"
    assert len(warnings) == 1 and "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in warnings[0]


def _watched_epoch(stuck_s: float):
    """An epoch watcher over a real store whose epoch 0 the control plane declared failed,
    with an exit that is recorded instead of taken."""
    from planaria.runtime.contract import keys
    from planaria.runtime.worker.coordination import StoreCoordinator
    from planaria.runtime.worker.epoch_watcher import EpochWatcher

    store = dist.HashStore()
    store.set(keys.epoch_reconfigure(0), keys.FAILURE)
    exits = []
    watcher = EpochWatcher(StoreCoordinator(store, ("node0", 0)), 0, SocketRelease(), lambda m: None,
                            period_s=0.01, stuck_s=stuck_s, exit=exits.append)
    return watcher, exits


def test_a_worker_still_blocked_after_the_release_exits_to_be_started_again():
    from planaria.runtime.contract.exits import EXIT_STUCK_AFTER_RELEASE

    watcher, exits = _watched_epoch(stuck_s=0.2)
    watcher.start()
    watcher.join(timeout=10)  # the main thread never leaves its epoch
    assert exits == [EXIT_STUCK_AFTER_RELEASE]


def test_a_worker_that_leaves_its_epoch_or_builds_layers_after_the_release_is_left_alone():
    watcher, exits = _watched_epoch(stuck_s=0.3)
    with watcher.local_work():  # building layers: waits on no peer, for as long as it takes
        watcher.start()
        time.sleep(1.0)
        watcher.done.set()  # then out of the epoch
    watcher.join(timeout=10)
    assert exits == [] and not watcher.is_alive()


def test_an_epoch_given_up_before_it_began_is_seen_at_once_not_a_period_later():
    """A planned leave's prepared epoch can be declared failed before a worker enters it
    (a worker it needed failed during the stop): the watcher asks as it starts, so the
    worker never trains in it, whatever its period."""
    from types import SimpleNamespace

    from planaria.runtime.contract import keys
    from planaria.runtime.worker.coordination import StoreCoordinator
    from planaria.runtime.worker.epoch_watcher import EpochWatcher

    store = dist.HashStore()
    store.set(keys.epoch_reconfigure(1), keys.FAILURE)
    released = []
    release = SimpleNamespace(release=lambda: released.append(1) or "released")
    watcher = EpochWatcher(StoreCoordinator(store, ("node0", 0)), 1, release, lambda m: None,
                            period_s=60, stuck_s=0)
    watcher.start()
    assert watcher.requested.wait(5) and released == [1]
    watcher.done.set()
    watcher.join(timeout=5)


def test_a_joins_connection_that_cannot_start_does_not_end_the_watch():
    """At a join's word the watcher starts the connection ahead; an error there (the
    prepared record unreadable, say) is said and the epoch stops without it, as when no
    record was prepared, instead of ending the watcher's thread silently."""
    from types import SimpleNamespace

    from planaria.runtime.contract import keys
    from planaria.runtime.worker.coordination import StoreCoordinator
    from planaria.runtime.worker.epoch_watcher import EpochWatcher

    store = dist.HashStore()
    store.set(keys.epoch_reconfigure(2), keys.JOIN)
    said: list[str] = []

    def connect_ahead():
        raise ConnectionError("the node's relay at 127.0.0.1:1 did not answer")

    watcher = EpochWatcher(StoreCoordinator(store, ("node0", 0)), 2, SimpleNamespace(release=lambda: "released"),
                           said.append, period_s=0.05, stuck_s=0, connect_ahead=connect_ahead)
    watcher.start()
    assert watcher.requested.wait(5)
    watcher.join(timeout=5)
    assert not watcher.is_alive()
    assert any("could not connect the next epoch's groups ahead" in line for line in said), said
