"""What an agent's look reads, against a real etcd: the kill requests its node's workers
get (one followed prefix per node, under either name a worker has), what the leader
derives from thousands of keys (parsed once per change, not per look; each status
parsed once), and a
registration whose lease lapsed before it was made."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from planaria.elastic.controller import ParsedStatuses
from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.elastic.etcd_kv import EtcdKeyValue
from planaria.elastic.worker_supervisor import WorkerSupervisor
from planaria.runtime.config.sections import CommConfig
from planaria.runtime.contract import keys
from planaria.runtime.contract.exactly_once import INCOMPLETE, SYNCED, CommitRecord, WorkerStatus

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store(etcd):
    client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint))
    kv = EtcdKeyValue(client, f"/planaria/looks-{uuid.uuid4().hex[:8]}")
    yield kv
    kv.close()
    client.close()


def eventually(done, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_node_serves_its_own_workers_kill_requests_under_either_name(store, tmp_path):
    supervisor = WorkerSupervisor(
        node="n1", nproc=2, store=store, lease=lambda: None, store_url="", etcd_env={}, run_id="looks",
        config="", overrides=[], comm=CommConfig(), max_restarts=0, shutdown_timeout_s=0.0, log_dir=tmp_path,
        output=None, log=lambda line: None)
    store.follow(keys.kill_requests_of("n1"), prefix=True)  # as the agent does (`_follow_job`)
    first, asked, restarted = ("n1", 0), ("n1", 1), ("n1~1", 0)
    supervisor.workers = {w: sleeper() for w in (first, asked, restarted)}
    try:
        supervisor.serve_kill_requests()
        assert all(p.poll() is None for p in supervisor.workers.values()), "killed with no request"
        # Another node whose name starts with this one's: its request is under the same
        # followed prefix, and kills nothing here.
        store.set(keys.kill_request(("n10", 0)), "1")
        store.set(keys.kill_request(asked), "1")
        store.set(keys.kill_request(restarted), "1")
        eventually(lambda: len(store.items_under(keys.kill_requests_of("n1"))) == 3, "the mirror never caught up")
        supervisor.serve_kill_requests()
        for worker in (asked, restarted):
            assert supervisor.workers[worker].wait(timeout=10) == -9, worker
        assert supervisor.workers[first].poll() is None, "a worker nobody asked for was killed"
    finally:
        for process in supervisor.workers.values():
            process.kill()
            process.wait()


def test_what_is_derived_from_a_followed_prefix_is_computed_once_per_change(store):
    for local in range(64):
        store.set(f"alive/n{local // 8}.{local % 8}", "1")
    store.follow(keys.ALIVE, prefix=True)
    calls = []

    def parse(found):
        calls.append(len(found))
        return frozenset(keys.parse_worker_key(key[len(keys.ALIVE):]) for key in found)

    first = store.derived(keys.ALIVE, parse)
    assert len(first) == 64
    for _ in range(100):  # a hundred looks while nothing changes
        assert store.derived(keys.ALIVE, parse) is first
    assert calls == [64]
    store.delete_key("alive/n7.7")
    eventually(lambda: ("n7", 7) not in store.derived(keys.ALIVE, parse), "the change was never seen")
    assert calls[-1] == 63 and len(calls) <= 3
    # Not followed: computed at every call, from etcd.
    store.set("other/x", "1")
    assert store.derived("other/", len) == 1 and store.derived("other/", len) == 1


def test_a_registration_whose_lease_lapsed_before_it_is_made_under_a_new_one(etcd):
    """An agent whose host stalled past the TTL between the lease's grant and its node's
    registration registers under a new lease, rather than die of `LeaseExpired`."""
    from planaria.elastic.node_membership import Membership

    client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint))
    try:
        prefix = f"/planaria/looks-{uuid.uuid4().hex[:8]}/"
        membership = Membership(client, prefix, node="n1", nproc=8, run_id="looks", ttl_s=5, log=lambda line: None)
        lapsed = client._client.lease(5)
        client._client.revoke_lease(lapsed.id)
        key = prefix + keys.node_registration("n1")
        created, lease = membership._create(key, b"mine", lapsed)
        assert created and lease.id != lapsed.id
        assert client.get(key)[0] == b"mine" and client.refresh(lease)
        client._client.revoke_lease(lease.id)
        assert client.get(key)[0] is None, "the registration is not bound to the new lease"
    finally:
        client.close()


def test_lease_renewals_share_one_stream(etcd):
    """An agent renews its lease every third of its TTL: on one kept-open stream, not a
    new call (and a thread gRPC starts to feed it) each time."""
    client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint))
    try:
        lease = client._client.lease(5)
        client.refresh(lease)
        before = {t.ident for t in threading.enumerate()}
        for _ in range(20):
            assert client.refresh(lease)
        started = {t.ident for t in threading.enumerate()} - before
        assert not started, f"renewals started threads: {started}"
        client._client.revoke_lease(lease.id)
        assert client.refresh(lease) is False  # a lease that is gone: TTL 0, not an error
    finally:
        client.close()


def test_the_leader_parses_each_status_once_however_many_looks_see_it(monkeypatch):
    # 512 statuses coming one by one: a look after each parses the newcomer only (a full
    # parse per look was 131,000 parses here, and minutes of the leader's CPU at 2,048).
    parses = []
    real = WorkerStatus.from_json.__func__

    def counted(cls, value):
        parses.append(value)
        return real(cls, value)
    monkeypatch.setattr(WorkerStatus, "from_json", classmethod(counted))
    parse, found = ParsedStatuses(), {}
    for n in range(512):
        worker = (f"node{n // 8}", n % 8)
        status = WorkerStatus(worker=worker, last_stepped=n, state=SYNCED, commit=CommitRecord(n, 1.0, 2.0))
        found[keys.epoch_status(3, worker)] = status.to_json().encode()
        statuses = parse(dict(found))
    assert len(parses) == 512
    assert statuses == {status.worker: status for status in map(WorkerStatus.from_json, found.values())}
    # A status rewritten (the same worker, a new value) is parsed again; one gone is gone.
    worker = ("node0", 0)
    found[keys.epoch_status(3, worker)] = WorkerStatus(worker=worker, last_stepped=7, state=INCOMPLETE).to_json().encode()
    del found[keys.epoch_status(3, ("node1", 0))]
    statuses = parse(dict(found))
    assert statuses[worker].last_stepped == 7 and ("node1", 0) not in statuses and len(statuses) == 511


def _supervisor(store, tmp_path, lines: list, **comm) -> WorkerSupervisor:
    return WorkerSupervisor(
        node="n1", nproc=1, store=store, lease=lambda: None, store_url="", etcd_env={}, run_id="looks",
        config="", overrides=[], comm=CommConfig(**comm), max_restarts=0, shutdown_timeout_s=0.0,
        log_dir=tmp_path, output=None, log=lines.append)


def _look_until_killed(supervisor, process, limit_s: float) -> float:
    """The agent's looks (every 0.1 s, its default) until the worker is dead; how long."""
    started = time.monotonic()
    while process.poll() is None:
        assert time.monotonic() - started < limit_s, "never killed"
        supervisor.kill_frozen()
        time.sleep(0.1)
    return time.monotonic() - started


def test_a_stopped_worker_is_killed_within_a_second_and_its_node_starts_again(store, tmp_path):
    """SIGSTOP: its state says so at once, long before its heartbeat (5 s) would; killed
    for hanging, it does not count against --max-restarts, up to MAX_HANG_RESTARTS."""
    lines: list[str] = []
    supervisor = _supervisor(store, tmp_path, lines)
    process = supervisor.workers[("n1", 0)] = sleeper()
    try:
        for _ in range(10):  # a running worker is left alone
            supervisor.kill_frozen()
            time.sleep(0.05)
        assert process.poll() is None and not supervisor.hung
        os.kill(process.pid, signal.SIGSTOP)
        took = _look_until_killed(supervisor, process, limit_s=3.0)
        assert 0.4 <= took <= 1.5, took
        assert supervisor.hung == {("n1", 0)}
        assert any("worker n1.0 stopped for" in line for line in lines), lines
        assert supervisor.reset_asked() and supervisor.max_restarts == 1  # not the user's
    finally:
        process.kill()
        process.wait()


def test_a_worker_whose_heartbeat_stopped_is_killed_as_hung(store, tmp_path):
    """Stopped-state detection off: the heartbeat file's silence is what it is seen by."""
    lines: list[str] = []
    supervisor = _supervisor(store, tmp_path, lines, stopped_timeout_s=0.0, heartbeat_timeout_s=1.0)
    worker = ("n1", 0)
    process = supervisor.workers[worker] = sleeper()
    try:
        beat = supervisor._heartbeat_file(worker)
        beat.parent.mkdir(parents=True, exist_ok=True)
        beat.touch()
        os.kill(process.pid, signal.SIGSTOP)
        took = _look_until_killed(supervisor, process, limit_s=5.0)
        assert took >= 0.9, took
        assert any("worker n1.0 froze (no heartbeat for" in line for line in lines), lines
        assert supervisor.hung == {worker}
    finally:
        process.kill()
        process.wait()
