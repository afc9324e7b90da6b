"""Which nodes train together when the network splits them (`planaria.elastic.reachability`),
and each agent's probe of the others (`planaria.elastic.peer_probe`) over real sockets."""
from __future__ import annotations

import socket
import time

from hypothesis import given, settings, strategies as st

from planaria.elastic.peer_probe import PeerProbe, node_address
from planaria.elastic.reachability import cut_pairs, reachable_group, reaches_all

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
    unreachable only after the window and three misses, and reachable at one success."""
    peer = PeerProbe("peer", "127.0.0.1", dict)
    probe = PeerProbe("me", "127.0.0.1", dict, unreachable_after_s=0.3)
    try:
        peers = {"peer": peer.address}
        assert probe.probe_once(peers) == []
        port = int(peer.address.rpartition(":")[2])
        peer.stop()
        assert probe.probe_once(peers) == []  # one miss is not a cut
        probe.probe_once(peers)
        time.sleep(0.35)
        assert probe.probe_once(peers) == ["peer"]
        back = socket.create_server(("127.0.0.1", port))
        try:
            assert probe.probe_once(peers) == []
        finally:
            back.close()
    finally:
        probe.stop()
        peer.stop()


def test_a_nodes_address_is_the_one_given_else_its_route_to_etcd():
    assert node_address("10.0.0.1:2379", {}, given="10.9.9.9") == "10.9.9.9"
    assert node_address("127.0.0.1:2379", {}) == "127.0.0.1"
    assert node_address("127.0.0.1:2379", {"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
