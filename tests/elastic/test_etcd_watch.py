"""`Mirror` (elastic/etcd_watch.py) against a real etcd: one member for events, the race
between the first read and the watch, compaction, closing and the cost of a quiet watch,
and the one stream a client's mirrors share (elastic/etcd_watch_stream.py); three
members for a member killed, frozen (SIGSTOP) or left without a quorum under the
watch's stream while writes go on through another client."""
from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import pytest

from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.elastic.etcd_server import EmbeddedEtcdCluster
from planaria.elastic.etcd_watch import Change, Mirror

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(scope="module")
def cluster():
    with EmbeddedEtcdCluster(3) as members:
        yield members


def client(endpoint: str, **settings) -> EtcdClient:
    return EtcdClient(EtcdSettings(endpoint=endpoint, **settings))


def recorded(mirror: Mirror) -> list[Change]:
    """Every change the mirror applies from now on, in the order its callback hears them."""
    changes: list[Change] = []
    mirror.on_change(changes.extend)
    return changes


def converges(mirror: Mirror, reader: EtcdClient, timeout_s: float = 10.0) -> dict[str, bytes]:
    """Wait until the mirror's view is what etcd holds; return that."""
    expected = reader.items_with_prefix(mirror.key)
    assert mirror.wait_until(lambda view: dict(view) == expected, timeout_s), \
        f"view {mirror.items()} is not etcd's {expected}"
    return expected


def held_on_key(mirror: Mirror) -> tuple[threading.Event, threading.Event]:
    """A callback that holds the mirror's thread at the first change of key "hold":
    (set once it holds, set to let it go; it gives up after 20 s)."""
    held, release = threading.Event(), threading.Event()

    def hold(changes):
        if any(ch.name == "hold" for ch in changes) and not held.is_set():
            held.set()
            release.wait(20)
    mirror.on_change(hold)
    return held, release


def server_counts(endpoint: str) -> dict[str, float]:
    """etcd's own count of Range calls handled, of messages received on Watch streams and
    of Watch streams opened."""
    with _DIRECT.open(f"http://{endpoint}/metrics", timeout=5) as r:
        text = r.read().decode()
    found = {"range": 0.0, "watch_messages": 0.0, "watch_streams": 0.0}
    for line in text.splitlines():
        if line.startswith("grpc_server_handled_total{") and 'grpc_method="Range"' in line:
            found["range"] += float(line.rsplit(" ", 1)[1])
        if line.startswith("grpc_server_msg_received_total{") and 'grpc_method="Watch"' in line:
            found["watch_messages"] += float(line.rsplit(" ", 1)[1])
        if line.startswith("grpc_server_started_total{") and 'grpc_method="Watch"' in line:
            found["watch_streams"] += float(line.rsplit(" ", 1)[1])
    return found


def watch_threads() -> set[threading.Thread]:
    """Mirror threads, and gRPC's threads that feed a stream its requests."""
    return {t for t in threading.enumerate()
            if t.name.startswith("planaria-watch") or "consume_request_iterator" in t.name}


_OTHERS: set[threading.Thread] = set()
"""Watch threads of other tests' objects (a controller of another test follows keys)."""


@pytest.fixture(autouse=True)
def _others_watch_threads():
    _OTHERS.clear()
    _OTHERS.update(watch_threads())
    yield


def no_watch_threads_within(timeout_s: float) -> bool:
    """No mirror thread of this test is left, nor gRPC's thread that feeds its stream."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not watch_threads() - _OTHERS:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def written_in_order(changes: list[Change], written: dict[str, list[bytes]]) -> None:
    """Each key's values arrived exactly as written (a put retried after a lost reply may
    repeat one), and revisions only grow."""
    revisions = [c.revision for c in changes]
    assert revisions == sorted(revisions), "changes arrived out of revision order"
    for name, values in written.items():
        seen = [c.value for c in changes if c.name == name]
        deduplicated = [v for i, v in enumerate(seen) if i == 0 or v != seen[i - 1]]
        assert deduplicated == values, f"{name}: saw {deduplicated}, wrote {values}"


def writer(client_: EtcdClient, prefix: str, count: int, keys: int = 5, pause_s: float = 0.0):
    """A thread that puts value i on key k{i % keys}, i < count; and what it wrote, by key."""
    written: dict[str, list[bytes]] = {}
    for i in range(count):
        written.setdefault(f"k{i % keys}", []).append(str(i).encode())

    def run():
        for i in range(count):
            client_.put(f"{prefix}k{i % keys}", str(i).encode())
            time.sleep(pause_s)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, written


# -- one member ---------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_events_of_a_key_and_a_prefix_arrive_and_the_view_is_etcds(etcd):
    c = client(etcd.endpoint)
    c.put("/w1/p/gone", b"0")
    c.put("/w1/p/kept", b"0")
    prefix, key = Mirror(c, "/w1/p/", prefix=True), Mirror(c, "/w1/key")
    assert prefix.items() == {"gone": b"0", "kept": b"0"} and key.value() is None  # from the first read
    changes = recorded(prefix)
    assert prefix.wait_watching(5) and key.wait_watching(5)

    c.put("/w1/p/new", b"1")          # put
    c.put("/w1/p/kept", b"2")         # overwrite
    c.delete("/w1/p/gone")            # delete
    c.put("/w1/pother", b"x")         # outside the prefix
    c.put("/w1/key", b"a")
    assert key.wait_for_value(timeout_s=5) == b"a"
    c.put("/w1/key", b"b")
    assert key.wait_until(lambda view: view.get("") == b"b", 5)
    c.delete("/w1/key")
    assert key.wait_until(lambda view: "" not in view, 5)

    assert converges(prefix, c) == {"kept": b"2", "new": b"1"}
    assert [(ch.name, ch.value) for ch in changes] == [("new", b"1"), ("kept", b"2"), ("gone", None)]
    assert prefix.wait_for_count(2, 0) and not prefix.wait_for_count(3, 0.1)
    # The four writes after its last event are not its keys': its revision is that event's.
    assert prefix.revision == c.read_range("/w1/p/")[1] - 4
    prefix.close()
    key.close()
    assert no_watch_threads_within(2.0), [t.name for t in threading.enumerate()]


@pytest.mark.timeout(30)
def test_nothing_is_missed_between_the_first_read_and_the_watch(etcd):
    c, other = client(etcd.endpoint), client(etcd.endpoint)
    thread, written = writer(other, "/w2/", 600, keys=7)
    mirrors = []
    while thread.is_alive() and len(mirrors) < 8:  # each one starts while writes go on
        changes: list[Change] = []
        mirrors.append((Mirror(c, "/w2/", prefix=True, on_change=changes.extend), changes))
        time.sleep(0.05)
    thread.join()
    assert len(mirrors) >= 3, "the writer ended too soon to race the mirrors' start"
    for mirror, changes in mirrors:
        assert converges(mirror, c) == {k: v[-1] for k, v in written.items()}
        # What the first read found (the callback hears it first), then every write after
        # it, in order: no write between the read and the watch is missing.
        for name, values in written.items():
            seen = [ch.value for ch in changes if ch.name == name]
            assert seen and seen == values[values.index(seen[0]):], f"{name}: a write is missing"
        revisions = [ch.revision for ch in changes]
        assert revisions == sorted(revisions)
        mirror.close()


@pytest.mark.timeout(30)
def test_a_compacted_revision_is_read_again_deletions_included(etcd):
    """The mirror's thread is held (in a callback) while its only member is SIGKILLed and
    started again, and the keys change and the history is compacted: its watch cannot
    resume, so it reads the prefix again and tells the difference."""
    import pyetcd

    c = client(etcd.endpoint)
    for name in ("a", "b", "c"):
        c.put(f"/w4/{name}", b"0")
    lines: list[str] = []
    mirror = Mirror(c, "/w4/", prefix=True, say=lines.append)
    held, release = held_on_key(mirror)
    changes = recorded(mirror)
    assert mirror.wait_watching(5)
    c.put("/w4/hold", b"1")
    assert held.wait(5)

    etcd.kill()
    etcd.start()
    c.delete("/w4/a")
    c.put("/w4/b", b"1")
    c.put("/w4/d", b"1")
    c.delete("/w4/hold")
    host, port = etcd.endpoint.split(":")
    raw = pyetcd.client(host=host, port=int(port))
    raw.compact(c.read_range("/w4/")[1], physical=True)
    raw.close()
    release.set()

    assert converges(mirror, c) == {"b": b"1", "c": b"0", "d": b"1"}
    assert mirror.ranges == 2 and mirror.watch_creates >= 2
    after_hold = {(ch.name, ch.value) for ch in changes[1:]}  # the difference the re-read found
    assert after_hold == {("a", None), ("b", b"1"), ("d", b"1"), ("hold", None)}
    assert [ln for ln in lines if "broke" in ln] and [ln for ln in lines if "is back" in ln], lines
    mirror.close()


@pytest.mark.timeout(30)
def test_a_quiet_watch_makes_no_request(etcd):
    c = client(etcd.endpoint)
    c.put("/w5/k", b"v")
    prefix, key = Mirror(c, "/w5/", prefix=True), Mirror(c, "/w5/k")
    assert prefix.wait_watching(5) and key.wait_watching(5)
    ours = (prefix.ranges, prefix.watch_creates, key.ranges, key.watch_creates)
    before = server_counts(etcd.endpoint)
    quiet_until = time.monotonic() + 3.0
    while time.monotonic() < quiet_until:  # readers of the view ask etcd nothing
        assert prefix.value("k") == b"v" and key.value() == b"v" and len(prefix) == 1
        assert not key.wait_until(lambda view: view.get("") != b"v", 0.2)
    after = server_counts(etcd.endpoint)
    assert before["range"] >= 2 and before["watch_messages"] >= 2  # the counts are there to see
    assert ours == (1, 1, 1, 1) == (prefix.ranges, prefix.watch_creates, key.ranges, key.watch_creates)
    # The server agrees: no Range (the /metrics reads are HTTP, not gRPC), no message on a stream.
    assert after == before, (before, after)
    prefix.close()
    key.close()


@pytest.mark.timeout(30)
def test_closing_or_aborting_a_watch_that_waits_for_etcd(etcd):
    c = client(etcd.endpoint)
    lines: list[str] = []
    abort = threading.Event()
    closing = Mirror(c, "/w6/", prefix=True, say=lines.append)
    aborting = Mirror(c, "/w6/", prefix=True, say=lines.append, abort=abort)
    assert closing.wait_watching(5) and aborting.wait_watching(5)
    etcd.kill()
    try:
        deadline = time.monotonic() + 5
        while sum("broke" in ln for ln in lines) < 2:
            assert time.monotonic() < deadline, lines
            time.sleep(0.05)
        started = time.monotonic()
        closing.close()
        abort.set()
        assert aborting.wait_until(lambda view: False, 5) is False and aborting.closed and aborting.aborted
        aborting.close()
        assert time.monotonic() - started < 3
        assert no_watch_threads_within(2.0)
    finally:
        etcd.start()


# -- one stream for a client's mirrors ------------------------------------------------------
def threads_within(at_most: int, timeout_s: float) -> bool:
    """Whether the process's threads came down to `at_most` (a creation's no-answer timer
    lives until its answer: it may be ending)."""
    deadline = time.monotonic() + timeout_s
    while threading.active_count() > at_most:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.timeout(30)
def test_the_mirrors_of_a_client_share_one_stream_and_its_threads(etcd):
    c = client(etcd.endpoint)
    streams = server_counts(etcd.endpoint)["watch_streams"]
    mirrors = [Mirror(c, "/w9/0/", prefix=True)]
    assert mirrors[0].wait_watching(5)
    assert threads_within(threading.active_count(), 1.0)
    with_one = threading.active_count()
    mirrors += [Mirror(c, f"/w9/{i}/", prefix=True) for i in range(1, 20)]
    assert all(m.wait_watching(5) for m in mirrors)
    assert threads_within(with_one, 2.0), [t.name for t in threading.enumerate()]
    ours = [t.name for t in watch_threads() - _OTHERS if t.name.startswith("planaria-watch")]
    # The stream's reader and the alarm of its watches' creations, for all twenty (no
    # thread per creation).
    assert sorted(name.split()[1] for name in ours) == ["alarm", "stream"], ours
    assert server_counts(etcd.endpoint)["watch_streams"] - streams == 1
    for i in range(20):
        c.put(f"/w9/{i}/k", str(i).encode())
    assert [m.wait_for_value("k", 5) for m in mirrors] == [str(i).encode() for i in range(20)]
    assert [(m.ranges, m.watch_creates) for m in mirrors] == [(1, 1)] * 20
    for mirror in mirrors:
        mirror.close()
    assert no_watch_threads_within(2.0), [t.name for t in threading.enumerate()]


@pytest.mark.timeout(30)
def test_closing_one_mirror_leaves_the_others_watching(etcd):
    c = client(etcd.endpoint)
    gone, prefix, key = Mirror(c, "/w10/a/", prefix=True), Mirror(c, "/w10/b/", prefix=True), Mirror(c, "/w10/k")
    assert gone.wait_watching(5) and prefix.wait_watching(5) and key.wait_watching(5)
    before = server_counts(etcd.endpoint)
    gone.close()
    assert gone.closed and gone.member is None and not gone.wait_watching(0)
    for name in ("/w10/a/x", "/w10/b/x", "/w10/k"):
        c.put(name, b"1")
    assert prefix.wait_for_value("x", 5) == b"1" and key.wait_for_value(timeout_s=5) == b"1"
    assert gone.value("x") is None
    after = server_counts(etcd.endpoint)
    assert after["watch_streams"] == before["watch_streams"]  # the same stream goes on
    assert after["watch_messages"] - before["watch_messages"] == 1  # its cancel request
    assert prefix.member == key.member == etcd.endpoint
    prefix.close()
    key.close()
    assert no_watch_threads_within(2.0), [t.name for t in threading.enumerate()]


@pytest.mark.timeout(30)
def test_a_callback_may_close_its_mirror_and_open_another(etcd):
    """On the stream's thread: the last mirror closed ends that stream, and the new one
    starts the client's next."""
    c = client(etcd.endpoint)
    opened: list[Mirror] = []

    def switch(changes):
        if any(ch.name == "go" for ch in changes):
            first.close()
            opened.append(Mirror(c, "/w11/", prefix=True))
    first = Mirror(c, "/w11/", prefix=True, on_change=switch)
    assert first.wait_watching(5)
    c.put("/w11/go", b"1")
    deadline = time.monotonic() + 5
    while not opened:
        assert time.monotonic() < deadline, "the callback did not finish"
        time.sleep(0.02)
    second = opened[0]
    assert second.wait_watching(5) and first.closed
    c.put("/w11/after", b"1")
    assert second.wait_for_value("after", 5) == b"1" and first.value("after") is None
    second.close()
    assert no_watch_threads_within(2.0), [t.name for t in threading.enumerate()]


@pytest.mark.timeout(30)
def test_a_compacted_watch_reads_again_alone(etcd):
    """Of two mirrors on one stream, only the one whose revision was compacted reads
    again; the other resumes from its own revision. The stream's thread is held (in a
    callback) while its member restarts, and the history is compacted; the second
    mirror starts meanwhile, after the compaction."""
    import pyetcd

    c = client(etcd.endpoint)
    c.put("/w12/old/a", b"0")
    old = Mirror(c, "/w12/old/", prefix=True)
    held, release = held_on_key(old)
    assert old.wait_watching(5)
    c.put("/w12/old/hold", b"1")
    assert held.wait(5)

    etcd.kill()
    etcd.start()
    c.delete("/w12/old/a")
    c.put("/w12/old/b", b"1")  # etcd drops a deletion AT the compaction revision from the history
    host, port = etcd.endpoint.split(":")
    raw = pyetcd.client(host=host, port=int(port))
    raw.compact(c.read_range("/w12/")[1], physical=True)
    raw.close()
    recent = Mirror(c, "/w12/recent/", prefix=True)
    release.set()

    c.put("/w12/recent/b", b"1")
    c.put("/w12/old/c", b"1")
    assert converges(old, c) == {"hold": b"1", "b": b"1", "c": b"1"}
    assert converges(recent, c) == {"b": b"1"}
    assert old.ranges == 2 and recent.ranges == 1
    old.close()
    recent.close()


# -- three members ------------------------------------------------------------------------
def stream_member(cluster, mirror: Mirror):
    assert mirror.wait_watching(5)
    return next(m for m in cluster.members if m.endpoint == mirror.member)


def others(cluster, member) -> str:
    return ",".join(m.endpoint for m in cluster.members if m is not member)


@pytest.mark.timeout(40)
def test_the_streams_member_killed_while_writes_go_on(cluster):
    lines: list[str] = []
    mirror = Mirror(client(cluster.endpoint), "/w3/", prefix=True, say=lines.append)
    changes = recorded(mirror)
    victim = stream_member(cluster, mirror)
    survivors = client(others(cluster, victim))
    thread, written = writer(survivors, "/w3/", 150, pause_s=0.005)
    time.sleep(0.2)
    victim.kill()
    thread.join()
    try:
        converges(mirror, survivors)
        written_in_order(changes, written)
        assert mirror.member not in (None, victim.endpoint)
        assert sum("broke" in ln for ln in lines) == 1 and sum("is back" in ln for ln in lines) == 1, lines
        assert mirror.ranges == 1  # nothing was compacted: the watch resumed where it stopped
    finally:
        victim.start()
        mirror.close()


@pytest.mark.timeout(40)
def test_a_frozen_member_is_left_by_keepalive(cluster):
    """SIGSTOP: the member's connections stay open and nothing comes; keepalive (5 s,
    2.5 s to answer) ends the stream and the watch goes on on another member."""
    lines: list[str] = []
    mirror = Mirror(client(cluster.endpoint, keepalive_s=5.0), "/w7/", prefix=True, say=lines.append)
    changes = recorded(mirror)
    frozen = stream_member(cluster, mirror)
    survivors = client(others(cluster, frozen))
    os.kill(frozen.process.pid, signal.SIGSTOP)
    try:
        thread, written = writer(survivors, "/w7/", 20, pause_s=0.05)
        thread.join()
        converges(mirror, survivors, timeout_s=15)
        written_in_order(changes, written)
        assert mirror.member != frozen.endpoint
        assert "ping timeout" in lines[0], lines
    finally:
        os.kill(frozen.process.pid, signal.SIGCONT)
        mirror.close()
    frozen.wait_healthy()


@pytest.mark.timeout(60)
def test_a_member_without_quorum_ends_the_stream(cluster):
    """The two other members are killed: the stream's member, alive but without a leader,
    ends the stream ("no leader") rather than stay silent; once they are back the watch
    resumes and sees what was written meanwhile."""
    lines: list[str] = []
    mirror = Mirror(client(cluster.endpoint), "/w8/", prefix=True, say=lines.append)
    alone = stream_member(cluster, mirror)
    gone = [m for m in cluster.members if m is not alone]
    for m in gone:
        m.kill()
    try:
        deadline = time.monotonic() + 15
        while not any("no leader" in ln for ln in lines):
            assert time.monotonic() < deadline, lines
            time.sleep(0.1)
    finally:
        for m in gone:
            m.start(wait=False)
        for m in gone:
            m.wait_healthy()
    writes = client(cluster.endpoint)
    writes.put("/w8/after", b"1")
    assert converges(mirror, writes, timeout_s=15) == {"after": b"1"}
    assert any("is back" in ln for ln in lines), lines
    mirror.close()


@pytest.mark.timeout(40)
def test_every_mirror_of_the_stream_resumes_from_its_own_revision(cluster):
    """Five mirrors of one client, on one stream, their prefixes written by turns (each
    its own revisions); the stream's member is killed while the writes go on: each
    mirror resumes where it was and misses nothing, and the outage is said once."""
    lines: list[str] = []
    c = EtcdClient(EtcdSettings(endpoint=cluster.endpoint), on_outage=lines.append)
    prefixes = [f"/w13/{i}/" for i in range(5)]
    for i, prefix in enumerate(prefixes):  # the mirrors start at different revisions
        c.put(f"{prefix}first", str(i).encode())
    mirrors = [Mirror(c, prefix, prefix=True) for prefix in prefixes]
    changes = [recorded(m) for m in mirrors]
    victim = stream_member(cluster, mirrors[0])
    assert all(m.wait_watching(5) and m.member == victim.endpoint for m in mirrors)
    survivors = client(others(cluster, victim))
    writers = [writer(survivors, prefix, 40, keys=3, pause_s=0.02) for prefix in prefixes]
    time.sleep(0.2)
    victim.kill()
    try:
        for thread, _ in writers:
            thread.join()
        for mirror, seen, (_, written) in zip(mirrors, changes, writers):
            converges(mirror, survivors)
            written_in_order(seen, written)
        members = {m.member for m in mirrors}
        assert len(members) == 1 and victim.endpoint not in members and None not in members
        assert [m.ranges for m in mirrors] == [1] * 5  # nothing compacted: each resumed where it was
        assert sum("watch stream broke" in ln for ln in lines) == 1, lines
        assert sum("watch stream is back" in ln for ln in lines) == 1, lines
    finally:
        victim.start()
        for mirror in mirrors:
            mirror.close()
