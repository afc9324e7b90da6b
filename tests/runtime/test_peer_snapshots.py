"""A worker's peer snapshots over the steps (planaria.runtime.state.peer_snapshots), its exchange
held back or failing at will: what a restore may use, what is kept, and that a step never
waits for an exchange.

The exchange itself (gloo, between processes) is exercised by the recovery tests
(tests/runtime/test_recovery.py); here it is replaced by a function the test releases,
so that every interleaving of steps and exchanges can be set up exactly.
"""
from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from planaria.runtime.contract.exactly_once import CommitRecord
from planaria.runtime.state import peer_snapshots
from planaria.runtime.state.peer_snapshots import PeerSnapshots
from planaria.templates.layout import plan_from_layout

PLAN = plan_from_layout(layout=[[1, 2]] * 2, n_blocks=3, tp=1, schedule="1f1b", virtual_stages=1,
                        global_batch=4, micro_batch=1)
ME = ("node0", 0)  # first stage of pipeline 0: layers 0-1; copies of layers 2-4 land here


class Engine(SimpleNamespace):
    def held_layers(self):
        return [0, 1]


@pytest.fixture
def snapshots(monkeypatch):
    """PeerSnapshots of node0 with an exchange that waits for the test's word."""
    gates: list[threading.Event] = []
    outcome = {"fail": False}

    def exchange(self, group, current, outgoing, incoming):
        gate = threading.Event()
        gates.append(gate)
        gate.wait(10)
        if outcome["fail"]:
            raise RuntimeError("Connection closed by peer")
        with self._lock:
            current.shards.update({shard: (torch.zeros(1),) for shards in incoming.values() for shard in shards})

    monkeypatch.setattr(PeerSnapshots, "_exchange", exchange)
    monkeypatch.setattr(peer_snapshots, "flatten_shard", lambda engine, layer, into=None: (torch.full((1,), layer),))
    monkeypatch.setattr(PeerSnapshots, "_connect", lambda self, store, rank, size, sockets: "group")
    monkeypatch.setattr(peer_snapshots.dist.distributed_c10d, "_get_default_store", lambda: dist.HashStore())
    logs: list[str] = []
    s = PeerSnapshots(1, 2, timeout_s=10, connect_timeout_s=10, log=logs.append)
    engine = Engine(plan=PLAN, rank=PLAN.rank_of_worker()[ME], tp=SimpleNamespace(rank=0),
                    last_stepped=-1, last_commit=None)
    begin(s, engine, 0)
    return SimpleNamespace(s=s, engine=engine, gates=gates, outcome=outcome, logs=logs)


def begin(s: PeerSnapshots, engine, epoch: int) -> None:
    """Enter `epoch` and wait for its group's connection (made on a thread)."""
    s.begin_epoch(engine, epoch)
    s._group.result(timeout=10)


def step(t, iteration: int, busy: int | None = None) -> None:
    """Commit `iteration`: its all-reduce counts this worker's `busy()` (and `busy` others)."""
    mine = t.s.busy()
    t.engine.last_stepped = iteration
    t.engine.last_commit = CommitRecord(iteration, float(iteration), 1.0)
    t.s.after_step(t.engine, int(mine) + (busy or 0), ends_epoch=False)


def kept(t) -> dict[int, list[int]]:
    return {h.step: sorted(layer for layer, _ in h.shards) for h in t.s.held()}


def release(t, index: int) -> None:
    """Let exchange `index` (counted from the epoch's first) go on, once it has begun."""
    for _ in range(500):
        if len(t.gates) > index:
            t.gates[index].set()
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"exchange {index} never began")


def wait_idle(t) -> None:
    for _ in range(200):
        if not t.s.busy():
            return
        threading.Event().wait(0.01)
    raise AssertionError("the exchange did not end")


def test_a_round_counts_its_copies_only_once_all_arrived_and_two_rounds_are_kept(snapshots):
    t = snapshots
    step(t, 0)
    assert kept(t) == {0: [0, 1]}  # own shards at once; the copies still in flight
    release(t, 0)
    wait_idle(t)
    assert kept(t) == {0: [0, 1, 2, 3, 4]}
    step(t, 1)  # nobody busy at its commit: round 0 whole everywhere, round 1 taken
    release(t, 1)
    wait_idle(t)
    step(t, 2)
    assert sorted(kept(t)) == [1, 2]  # round 0 forgotten: 1 is whole everywhere


def test_a_step_never_waits_for_an_exchange_rounds_are_skipped_instead(snapshots):
    t = snapshots
    step(t, 0)
    step(t, 1)  # this worker is still sending round 0: its commit says so, no round 1
    step(t, 2, busy=1)  # another one still is: no round 2 either, on any worker
    assert sorted(kept(t)) == [0] and t.s.skipped == 2
    release(t, 0)
    wait_idle(t)
    step(t, 3)
    assert sorted(kept(t)) == [0, 3]
    release(t, 1)  # round 3's: the second exchange of the epoch, no other began
    wait_idle(t)
    assert len(t.gates) == 2


def test_a_failed_exchange_ends_the_rounds_of_the_epoch_not_the_epoch(snapshots):
    t = snapshots
    step(t, 0)
    release(t, 0)
    wait_idle(t)
    step(t, 1)
    t.outcome["fail"] = True
    release(t, 1)
    for iteration in (2, 3, 4):
        step(t, iteration)  # no exception: training goes on
    for _ in range(200):  # until the failure is seen (asked, as before each commit)
        if t.s.busy() and any("not sent whole" in line for line in t.logs):
            break
        threading.Event().wait(0.01)
    step(t, 5)
    assert kept(t) == {0: [0, 1, 2, 3, 4], 1: [0, 1]}  # round 1 keeps only its own shards
    assert t.s.busy() and len(t.gates) == 2  # still "busy": no round is taken any more
    assert any("not sent whole" in line for line in t.logs), t.logs
    t.s.end_epoch()
    begin(t.s, t.engine, 1)  # a new epoch takes rounds again
    assert not t.s.busy()


def test_rounds_the_next_plan_trains_again_are_dropped(snapshots):
    t = snapshots
    for iteration in range(3):
        step(t, iteration)
        release(t, iteration)
        wait_idle(t)
    assert sorted(kept(t)) == [1, 2]
    t.s.end_epoch()
    back = dataclasses.replace(PLAN, epoch=1, first_iteration=2)
    t.engine.plan = back
    begin(t.s, t.engine, 1)  # the job went back to step 1: round 2 is of a timeline it left
    assert sorted(kept(t)) == [1]


def test_a_copy_is_the_shards_bits_apart_from_it_and_reuses_a_forgotten_ones_memory():
    """`flatten_shard` copies (a later step leaves the copy as it was), written into a
    forgotten copy's tensors when given one, and `load_flat` puts it back bit for bit."""
    from planaria.runtime.state.transfer import layer_state_tensors, load_flat
    from tests.runtime.test_optimizer_state import stepped_layer

    state = stepped_layer("cpu", seed=0)
    engine = SimpleNamespace(shard=lambda layer: state)
    before = [t.clone() for t in layer_state_tensors(state, True)]
    copy = peer_snapshots.flatten_shard(engine, 0)
    with torch.no_grad():
        for p in state.module.parameters():
            p.add_(1.0)
    other = stepped_layer("cpu", seed=1)
    load_flat(other, copy)
    assert all(torch.equal(a, b) for a, b in zip(before, layer_state_tensors(other, True)))
    again = peer_snapshots.flatten_shard(engine, 0, into=copy)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(again, copy))
    assert all(torch.equal(a, b) for a, b in zip(again, peer_snapshots.flatten_shard(engine, 0)))


def test_no_round_is_taken_until_the_group_is_connected_nor_is_one_left_behind_waited_for(monkeypatch):
    """The epoch's snapshot group connects while its first steps train: until it is up
    this worker is busy (its commits say so, and no worker takes a round). A peer gone
    while it connects: the epoch's end does not wait for the connection (only its
    timeout would end it), and the next epoch makes its own group."""
    import time

    released = threading.Event()
    made: list[int] = []

    def connect(self, store, rank, size, sockets):
        if not made:
            made.append(0)
            released.wait(30)  # a connection that does not complete until the test says
            raise RuntimeError("Connection refused")
        made.append(1)
        return "group"

    monkeypatch.setattr(PeerSnapshots, "_connect", connect)
    monkeypatch.setattr(PeerSnapshots, "_exchange", lambda *args: None)
    monkeypatch.setattr(peer_snapshots, "flatten_shard", lambda engine, layer, into=None: (torch.full((1,), layer),))
    logs: list[str] = []
    s = PeerSnapshots(1, 2, timeout_s=10, connect_timeout_s=10, log=logs.append)
    engine = Engine(plan=PLAN, rank=PLAN.rank_of_worker()[ME], tp=SimpleNamespace(rank=0),
                    last_stepped=-1, last_commit=None)
    t = SimpleNamespace(s=s, engine=engine)
    s.begin_epoch(engine, 0, dist.HashStore())
    step(t, 0)
    step(t, 1)
    assert s.busy() and s.held() == () and s.skipped == 2
    started = time.monotonic()
    assert s.end_epoch() == []
    assert time.monotonic() - started < 2
    assert any("not connected yet; left behind" in line for line in logs), logs
    s.begin_epoch(engine, 1, dist.HashStore())
    assert s._group.result(timeout=10) == "group" and made == [0, 1]
    step(t, 2)
    assert [h.step for h in s.held()] == [2]
    assert s.end_epoch() == ["group"]  # for the worker to retire with the epoch's groups
    released.set()


def test_a_group_that_fails_to_connect_ends_the_rounds_of_its_epoch(monkeypatch):
    def connect(self, store, rank, size, sockets):
        raise RuntimeError("Connection refused")

    monkeypatch.setattr(PeerSnapshots, "_connect", connect)
    logs: list[str] = []
    s = PeerSnapshots(1, 2, timeout_s=10, connect_timeout_s=10, log=logs.append)
    engine = Engine(plan=PLAN, rank=PLAN.rank_of_worker()[ME], tp=SimpleNamespace(rank=0),
                    last_stepped=-1, last_commit=None)
    s.begin_epoch(engine, 0, dist.HashStore())
    with pytest.raises(RuntimeError):
        s._group.result(timeout=10)
    assert s.busy() and s.busy()  # for the rest of the epoch
    assert [line for line in logs if "not made: Connection refused" in line] == [logs[0]] and len(logs) == 1
    assert s.end_epoch() == []


def test_the_snapshot_group_is_real_gloo_outside_the_registry_and_its_threads_idle():
    """Two ranks (threads of this process) make the group over one store: it carries a
    round's messages between them, torch's registry of groups never sees it, and the
    threads gloo started for it run at idle priority, and no other thread does."""
    import os

    before = peer_snapshots._threads()
    store = dist.HashStore()
    s = [PeerSnapshots(1, 2, timeout_s=10, connect_timeout_s=10) for _ in range(2)]
    connecting = [peer_snapshots._on_thread(s[r]._connect, dist.PrefixStore("peer-snapshots/", store), r, 2, set(),
                                            name=f"connect-{r}") for r in range(2)]
    groups = [c.result(timeout=30) for c in connecting]
    assert not dist.is_initialized()
    sent = SnapshotRoundFor(0, {(4, 0): (torch.arange(6, dtype=torch.float32), torch.ones(2, dtype=torch.float64))})
    got = SnapshotRoundFor(0, {})
    exchanges = [peer_snapshots._on_thread(s[0]._exchange, groups[0], sent, {1: [(4, 0)]}, {}, name="x0"),
                 peer_snapshots._on_thread(s[1]._exchange, groups[1], got, {}, {0: [(4, 0)]}, name="x1")]
    for e in exchanges:
        e.result(timeout=30)
    assert [t.tolist() for t in got.shards[(4, 0)]] == [list(map(float, range(6))), [1.0, 1.0]]
    gloo = peer_snapshots._gloo_threads(peer_snapshots._threads() - before)
    assert gloo, "no gloo thread found by name"
    if hasattr(os, "SCHED_IDLE"):
        assert {os.sched_getscheduler(tid) for tid in gloo} == {os.SCHED_IDLE}
        assert os.sched_getscheduler(0) != os.SCHED_IDLE


def SnapshotRoundFor(step: int, shards: dict) -> peer_snapshots.SnapshotRound:
    return peer_snapshots.SnapshotRound(CommitRecord(step, 1.0, 1.0), 0, dict(shards))


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="Linux scheduling policies")
def test_a_connection_starved_at_idle_priority_goes_on_at_normal_priority(monkeypatch):
    """No CPU left idle by training: the group's connection, at idle priority, is raised
    to normal priority once it has taken `CONNECT_AT_IDLE_S`, and then completes."""
    import os
    import time

    def connect(self, store, rank, size, sockets):
        peer_snapshots._idle_priority()
        deadline = time.monotonic() + 20
        while os.sched_getscheduler(0) == os.SCHED_IDLE:  # "starved" until raised
            assert time.monotonic() < deadline, "never raised"
            time.sleep(0.01)
        return "group"

    monkeypatch.setattr(PeerSnapshots, "_connect", connect)
    logs: list[str] = []
    s = PeerSnapshots(1, 2, timeout_s=10, connect_timeout_s=10, log=logs.append)
    engine = Engine(plan=PLAN, rank=PLAN.rank_of_worker()[ME], tp=SimpleNamespace(rank=0),
                    last_stepped=-1, last_commit=None)
    started = time.monotonic()
    s.begin_epoch(engine, 0, dist.HashStore())
    while s.busy():  # as before each commit
        assert time.monotonic() - started < 20
        time.sleep(0.01)
    assert time.monotonic() - started >= peer_snapshots.CONNECT_AT_IDLE_S
    assert s._group.result() == "group"
    assert sum("goes on at normal priority" in line for line in logs) == 1, logs


def test_at_a_stop_the_exchange_under_way_goes_on_into_the_next_epoch(snapshots):
    """A stop at a step boundary: the epoch's end does not wait for the exchange in
    flight (its peers are alive; it completes), no round is taken at the stop's step, and
    the next epoch counts this worker busy until the exchange is over. Its failure (a
    leaving peer gone first) ends nothing of the next epoch's rounds."""
    import time

    t = snapshots
    step(t, 0)  # round 0 in flight
    t.engine.last_stepped, t.engine.last_commit = 1, CommitRecord(1, 1.0, 1.0)
    t.s.after_step(t.engine, 1, ends_epoch=True)  # the stop's step: busy anyway, and no round
    started = time.monotonic()
    assert t.s.end_epoch(stopped=True) == ["group"]
    assert time.monotonic() - started < 1 and len(t.gates) == 1
    t.engine.plan = dataclasses.replace(PLAN, epoch=1, first_iteration=2)
    begin(t.s, t.engine, 1)
    assert t.s.busy()  # round 0's exchange still going on
    release(t, 0)
    wait_idle(t)
    assert kept(t) == {0: [0, 1, 2, 3, 4]}  # whole, after the epoch it began in
    step(t, 2)
    release(t, 1)
    wait_idle(t)
    t.outcome["fail"] = True
    step(t, 3)
    assert t.s.end_epoch(stopped=True) == ["group"]
    t.engine.plan = dataclasses.replace(PLAN, epoch=2, first_iteration=4)
    begin(t.s, t.engine, 2)
    release(t, 2)  # round 3's exchange fails in epoch 2: no word of epoch 2's own
    wait_idle(t)
    t.outcome["fail"] = False
    step(t, 4)
    assert 4 in kept(t)


def test_no_round_is_taken_at_a_step_that_ends_the_epoch(snapshots):
    t = snapshots
    t.engine.last_stepped, t.engine.last_commit = 0, CommitRecord(0, 1.0, 1.0)
    t.s.after_step(t.engine, 0, ends_epoch=True)
    assert kept(t) == {} and t.gates == []


def test_after_a_failure_an_exchange_left_waiting_on_a_live_peer_is_released():
    """The epoch failed while a worker's exchange waits for a live peer that will never
    send (its own exchange failed on the dead worker): the epoch's end shuts the group's
    connections down rather than wait out the operations' timeout."""
    import time

    store = dist.HashStore()
    logs: list[str] = []
    s = [PeerSnapshots(1, 2, timeout_s=120, connect_timeout_s=10, log=logs.append) for _ in range(2)]
    sockets = [set(), set()]
    connecting = [peer_snapshots._on_thread(s[r]._connect, dist.PrefixStore("peer-snapshots/", store), r, 2,
                                            sockets[r], name=f"connect-{r}") for r in range(2)]
    groups = [c.result(timeout=30) for c in connecting]
    assert sockets[0] and sockets[1]
    waiting = SnapshotRoundFor(0, {})
    s[0]._group, s[0]._inflight_sockets, s[0]._epoch = connecting[0], sockets[0], 0
    s[0]._inflight = s[0]._pool.submit(s[0]._exchange, groups[0], waiting, {}, {1: [(4, 0)]})
    time.sleep(0.3)
    assert not s[0]._inflight.done()  # rank 1 never sends
    started = time.monotonic()
    s[0].end_epoch()  # a failure: not `stopped`
    assert time.monotonic() - started < 5
    assert any("connection(s) shut down" in line for line in logs) and any("not sent whole" in line for line in logs), logs
    assert waiting.shards == {}
