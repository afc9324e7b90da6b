"""Which nodes train together when the network splits them (`planaria.elastic.reachability`),
and each agent's probe of the others (`planaria.elastic.peer_probe`) over real sockets."""
from __future__ import annotations

import socket
import time

import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from planaria.elastic.controller import Controller
from planaria.elastic.peer_probe import MAX_WAITING, PeerProbe, node_address
from planaria.elastic.reachability import cut_pairs, reachable_group, reaches_all
from planaria.runtime.config.loading import load_config
from planaria.runtime.contract import keys
from planaria.runtime.planning.job_plans import build_planner, cost_model
from tests.elastic.test_controller_joins import report_statuses
from tests.launch import TINY

NODES = [f"node{i}" for i in range(6)]


def test_a_partition_is_planned_over_its_larger_side():
    views = {"node0": ["node4", "node5"], "node4": ["node0", "node1", "node2", "node3"]}
    assert reachable_group(NODES, views) == ["node0", "node1", "node2", "node3"]
    assert not reaches_all("node5", ["node0", "node1"], {"node5": ["node1"]})
    assert reaches_all("node5", ["node0", "node1"], {"node5": ["node9"]})


def test_a_tie_goes_to_the_leaders_side_then_to_the_first_names():
    split = {a: [b for b in NODES if (b < "node3") != (a < "node3")] for a in NODES}
    assert reachable_group(NODES, split, leader="node4") == ["node3", "node4", "node5"]
    assert reachable_group(NODES, split, leader=None) == ["node0", "node1", "node2"]


def test_one_sided_reports_cut_a_pair_and_nodes_outside_are_ignored():
    assert cut_pairs(NODES, {"node2": ["node1", "node9"], "node9": ["node0"]}) == [("node1", "node2")]
    assert reachable_group(NODES, {}) == NODES


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 9).flatmap(lambda n: st.tuples(
    st.just(n), st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1))))))
def test_the_group_is_a_largest_set_that_all_reach_each_other(case):
    """Against brute force over every subset."""
    n, cuts = case
    nodes = [f"n{i}" for i in range(n)]
    views = {}
    for a, b in cuts:
        views.setdefault(nodes[a], []).append(nodes[b])
    group = reachable_group(nodes, views)
    assert not cut_pairs(group, views)
    best = max(sum(1 for i in range(n) if mask >> i & 1) for mask in range(1, 1 << n)
               if not cut_pairs([nodes[i] for i in range(n) if mask >> i & 1], views))
    assert len(group) == best


def test_the_probe_finds_a_peer_that_stopped_answering_and_sees_it_back():
    """A live listener is reachable; one whose port stops accepting (closed) turns
    unreachable only after the window and three misses, and reachable at one success.
    Its refusals say at once that its agent is gone (`gone`: its workers are counted
    dead). A peer never reached is not reported (a configuration error, named apart)."""
    peer = PeerProbe("peer", "127.0.0.1")
    probe = PeerProbe("me", "127.0.0.1", unreachable_after_s=0.3)
    try:
        peers = {"peer": peer.address}
        assert probe.probe_once(peers) == []
        port = int(peer.address.rpartition(":")[2])
        peer.stop()
        assert probe.probe_once(peers) == []  # one miss is not a cut
        assert probe.gone == ["peer"]  # but a refusal is an answer: nothing listens there
        probe.probe_once(peers)
        time.sleep(0.35)
        assert probe.probe_once(peers) == ["peer"]
        back = socket.create_server(("127.0.0.1", port))
        try:
            assert probe.probe_once(peers) == [] and probe.gone == []
        finally:
            back.close()
        never = {"ghost": f"127.0.0.1:{port}"}  # closed from the start
        for _ in range(3):
            assert probe.probe_once(never) == []
        time.sleep(0.35)
        assert probe.probe_once(never) == [] and probe.never_reached == ["ghost"] and probe.gone == []
    finally:
        probe.stop()
        peer.stop()


def test_a_peer_that_stops_answering_is_unreachable_within_two_seconds_and_probes_stay_few():
    """The running probe against a peer reached before whose port then drops every SYN (a
    listener whose accept queue is full, on loopback: the silence of a cut): unreachable
    within about 2 s (1.5 s without an answer, over three probes), and no more than
    MAX_WAITING probes of it waiting at a time; reachable again at its first answer."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    probe = PeerProbe("me", "127.0.0.1").start()
    clogged, held = None, []
    try:
        probe.set_peers({"peer": f"127.0.0.1:{port}"})
        deadline = time.monotonic() + 5
        while "peer" not in probe._last_ok and time.monotonic() < deadline:
            time.sleep(0.05)
        server.close()
        clogged = socket.create_server(("127.0.0.1", port), backlog=0)
        for _ in range(3):  # fill its accept queue: later SYNs are dropped
            held.append(socket.socket())
            held[-1].setblocking(False)
            held[-1].connect_ex(("127.0.0.1", port))
        cut = time.monotonic()
        while probe.unreachable != ["peer"] and time.monotonic() - cut < 10:
            assert len(probe._pending) <= MAX_WAITING
            time.sleep(0.05)
        seen = time.monotonic() - cut
        assert probe.unreachable == ["peer"] and probe.gone == [] and 1.2 <= seen <= 5.0, seen  # (6 s and more before)
        for sock in held:
            sock.close()
        clogged.close()
        back = socket.create_server(("127.0.0.1", port))
        try:
            deadline = time.monotonic() + 5
            while probe.unreachable and time.monotonic() < deadline:
                time.sleep(0.05)
            assert probe.unreachable == []
        finally:
            back.close()
    finally:
        probe.stop()
        for sock in held:
            sock.close()
        if clogged is not None:
            clogged.close()


def test_a_nodes_address_is_the_one_given_else_its_route_to_etcd():
    assert node_address("10.0.0.1:2379", {}, given="10.9.9.9") == "10.9.9.9"
    assert node_address("127.0.0.1:2379", {}) == "127.0.0.1"
    assert node_address("127.0.0.1:2379", {"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"


def partitioned_job(views: dict[str, list[str]], *, n: int = 6, f: int = 1, leader: str | None = None):
    """A controller over `n` one-worker nodes (pipelines of two stages), whose reachability
    reports are `views` (changed by the test), at epoch 0 with every worker's status in."""
    cfg = load_config(TINY, [f"fault_tolerance.f={f}", "parallel.min_stages=2"])
    planner = build_planner(cfg, cost_model(cfg, hardware_name="h100", gpus_per_node=1))
    store, logs = dist.HashStore(), []
    controller = Controller(store, planner, total_steps=100, debounce_s=0, log=logs.append,
                            node=leader, unreachable=lambda: views)
    workers = [(f"node{i}", 0) for i in range(n)]
    plan = controller.start(workers)
    return controller, store, logs, workers, plan


def test_a_cut_ends_the_epoch_and_the_larger_side_trains_until_the_other_reaches_it():
    """Nodes 4 and 5 are cut off the others (both sides alive, reporting through the
    store): the leader plans over node0-3, which hold every layer (copies, no
    checkpoint); node4 and node5 wait while the cut lasts and join once it heals."""
    cut = {"node4": ["node0", "node1", "node2", "node3"], "node5": ["node0", "node1", "node2", "node3"],
           **{f"node{i}": ["node4", "node5"] for i in range(4)}}
    views = dict(cut)
    controller, store, logs, workers, plan = partitioned_job(views)
    alive = set(workers)
    # (The statuses the workers publish once released, the cut-off ones' included: here
    # before the poll, which would otherwise wait for them.)
    report_statuses(store, plan, 3, workers)
    assert controller.poll(lambda: alive, kill=lambda w: None) == "running"
    assert store.get("epoch/0/reconfigure") == b"failure"  # released, not left to the collective timeout
    assert controller.epoch == 1 and sorted(controller.plan.nodes()) == ["node0", "node1", "node2", "node3"]
    (event,) = controller.events
    assert event.cut_off == ("node4", "node5") and event.restored is None and event.failed == ()
    store.set("epoch/1/trained", "1")
    for worker in [("node4", 0), ("node5", 0)]:  # as theirs do, once they see epoch 1 without them
        store.set(keys.ready(worker), "1")
    assert controller.poll(lambda: alive, kill=lambda w: None) == "running"
    assert controller.epoch == 1  # out of reach: they wait, the epoch goes on
    assert any("cannot reach every node of the job; they wait" in line for line in logs)

    views.clear()  # healed
    report_statuses(store, controller.plan, 9, [w for w in workers if w[0] in controller.plan.nodes()])
    assert controller.poll(lambda: alive, kill=lambda w: None) == "running"
    assert controller.epoch == 2 and sorted(controller.plan.nodes()) == [n for n, _ in workers]
    assert controller.events[-1].joined == ("node4.0", "node5.0")


def test_no_group_that_can_train_waits_for_the_cut_to_heal_instead_of_failing_the_job():
    """Every node cut from every other: no group holds a replica of the model. The leader
    publishes nothing and says so once; when the cut heals it plans them all."""
    views = {f"node{i}": [f"node{j}" for j in range(4) if j != i] for i in range(4)}
    controller, store, logs, workers, plan = partitioned_job(views, n=4)
    alive = set(workers)
    report_statuses(store, plan, 3, workers)
    for _ in range(3):
        assert controller.poll(lambda: alive, kill=lambda w: None) == "running"
    assert controller.epoch == 0 and controller.outcome is None
    assert sum("waiting for the partition to heal" in line for line in logs) == 1
    views.clear()
    assert controller.poll(lambda: alive, kill=lambda w: None) == "running"
    assert controller.epoch == 1 and sorted(controller.plan.nodes()) == [n for n, _ in workers]
