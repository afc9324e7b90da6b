"""A simulated worker's watches as tasks of its relay's loop (chaos/scale/loop_watches.py),
against a real etcd, a real node relay and a real epoch's TCPStore: they do what the
runtime's threads do (an epoch's end seen and its collectives released; a rendezvous wait
given up once the epoch is abandoned), they start no thread for it, and a harness's
epochs start none per worker. (Its relay's pending answers to a closed test's watches
are dropped with the loop: asyncio says so, harmlessly.)"""
from __future__ import annotations

import sys
import threading
import time

import pytest
import torch.distributed as dist

from planaria.chaos.scale.cutoff import Killed
from planaria.chaos.scale.data_plane import Released, StepBarrier, RankRelease
from planaria.chaos.scale.loop_watches import LoopAbandonWatch, LoopEpochWatcher, LoopStore
from planaria.chaos.scale.scale_run import ScaleHarness
from planaria.chaos.scale.node_host import LOOP_CALLS
from planaria.chaos.scale.sim_relay import InProcessRelayStore
from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.elastic.etcd_kv import EtcdKeyValue
from planaria.elastic.etcd_server import EmbeddedEtcd
from planaria.elastic.node_relay import NodeRelay
from planaria.runtime.contract import keys
from planaria.runtime.worker.coordination import StoreCoordinator
from tests.launch import TINY

pytestmark = pytest.mark.timeout(120)
PER_EPOCH_THREADS = ("epoch-watcher", "rendezvous-abandon-watch", "close-epoch-stores")
"""The names of the threads a real worker starts each epoch (`EpochWatcher`,
`_AbandonWatch`, `StoreCoordinator.close_later`)."""


@pytest.fixture(scope="module")
def etcd():
    with EmbeddedEtcd() as server:
        yield server


@pytest.fixture
def worker(etcd, request):
    """A coordinator over a worker's store through a relay in this process, and the job's store."""
    client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint))
    job = EtcdKeyValue(client, f"/planaria/{request.node.name}/")
    relay = NodeRelay(job).start()
    killed = threading.Event()
    store = InProcessRelayStore(relay, "node0.0", killed)
    coordinator = StoreCoordinator(store, ("node0", 0), node_address="127.0.0.1")
    yield coordinator, LoopStore(store), job, killed
    coordinator.close()
    store.close()
    relay.close()
    client.close()


@pytest.fixture
def started(monkeypatch) -> list[str]:
    """The names of the threads started from now on."""
    names: list[str] = []
    start = threading.Thread.start

    def recording(thread: threading.Thread) -> None:
        # gRPC's own threads of a stream being opened (a lease's or a watch's keep-alive
        # stream, reopened by the control plane) are marked: they go with that stream,
        # whose own thread is counted by its name.
        names.append(("grpc:" if "/grpc/" in sys._getframe(1).f_code.co_filename else "") + thread.name)
        start(thread)
    monkeypatch.setattr(threading.Thread, "start", recording)
    return names


def test_the_epoch_watcher_releases_the_collectives_at_a_failure_without_a_thread(worker, started):
    coordinator, store, job, _ = worker
    barrier = StepBarrier(2)
    watcher = LoopEpochWatcher(coordinator, store, 3, RankRelease(barrier, 0), log=lambda line: None)
    watcher.start()
    time.sleep(0.3)
    assert not watcher.requested.is_set()
    threading.Timer(0.3, job.set, args=(keys.epoch_reconfigure(3), keys.FAILURE)).start()
    began = time.monotonic()
    with pytest.raises(Released):  # the rank's step, blocked on a peer that never comes
        barrier.step(0, 0, stop=False)
    assert time.monotonic() - began < 2.0 and watcher.requested.is_set()
    assert not [name for name in started if any(name.startswith(kind) for kind in PER_EPOCH_THREADS)], started


def test_a_rendezvous_wait_is_given_up_when_the_epoch_is_abandoned(worker, started):
    coordinator, store, job, _ = worker
    coordinator.abandon_watch = lambda epoch, interrupt, poll_s, wait_s: LoopAbandonWatch(
        store, epoch, interrupt, poll_s, wait_s)
    watcher = LoopEpochWatcher(coordinator, store, 5, release=None, log=lambda line: None)
    watcher.start()  # (it follows the epoch's end: the abandon watch's asks read the mirror)
    rendezvous = coordinator.rendezvous_store(5, host=True)
    rendezvous.set("here", b"1")
    assert rendezvous.get("here") == b"1"
    threading.Timer(0.5, job.set, args=(keys.epoch_reconfigure(5), keys.FAILURE)).start()
    began = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="abandoned by the control plane"):
        rendezvous.wait(["a peer that never comes"])
    assert time.monotonic() - began < 3.0
    assert not [name for name in started if any(name.startswith(kind) for kind in PER_EPOCH_THREADS)], started


def test_a_killed_workers_watch_ends(worker):
    coordinator, store, job, killed = worker
    watcher = LoopEpochWatcher(coordinator, store, 7, release=None, log=lambda line: None)
    watcher.start()
    killed.set()
    with pytest.raises(Killed):
        coordinator.epoch_over(7)
    # Its next request raises Killed on the loop too: the task ends, nothing is left asking.
    job.set(keys.epoch_reconfigure(7), keys.JOIN)
    time.sleep(0.5)
    assert not watcher.requested.is_set()


@pytest.mark.timeout(300)
def test_a_simulated_reconfiguration_starts_no_thread_per_worker(tmp_path, started):
    with ScaleHarness(nodes=3, gpus_per_node=4, config=str(TINY), step_s=0.2, backend="gloo",
                      overrides=["fault_tolerance.f=1", "checkpoint.memory_every=0"], log_dir=tmp_path,
                      log=lambda line: None) as harness:
        harness.start(timeout_s=120)
        before = len(started)
        victim = next(i for i in reversed(harness.live()) if i != harness.leader())
        killed = harness.reconfigure(lambda: harness.kill_node(victim), "node killed", timeout_s=120)
        assert killed.nodes == 2 and killed.workers == 8
        during = started[before:]
    assert not [name for name in during if any(name.startswith(kind) for kind in PER_EPOCH_THREADS)], during
    # What a reconfiguration may start: the loop's pool of a few threads (closing the old
    # epoch's stores), the harness's own, one of the control plane per node at most (a
    # lease stream reopened), not one per worker. (The peer snapshots' group, off here as
    # at scale, connects on a thread of its own, as a real worker's does.)
    others = [name for name in during if not name.startswith(("asyncio_", LOOP_CALLS, "grpc:"))]
    assert len(others) <= 3, during
