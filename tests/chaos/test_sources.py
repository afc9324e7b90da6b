"""The clock-driven fault sources: a preemption trace read, checked and capped to a local
cluster, and the seeded random process kept within its node range."""
from __future__ import annotations

from pathlib import Path

import pytest

from planaria.chaos.faults import FaultSpecError
from planaria.chaos.sources import NODE_LOSSES, RandomFaults, random_kinds, read_trace, replay_schedule

TRACES = Path(__file__).resolve().parents[2] / "chaos" / "traces"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, message", [
    ("0,add,a\n0,add\n", "trace.csv:2: expected time_ms,add|remove,NODE"),
    ("0,add,a\nsoon,remove,a\n", "trace.csv:2: the time 'soon' is not a whole number"),
    ("0,add,a\n5,preempt,a\n", "trace.csv:2: 'preempt' is neither add nor remove"),
    ("0,add,a\n9,add,b\n5,remove,a\n", "trace.csv:3: time 5 ms comes before the previous line's 9 ms"),
    ("0,add,a\n5,remove,b\n", "trace.csv:2: b is removed but was never added"),
    ("0,add,a\n5,add,a\n", "trace.csv:2: a is added while it is already live"),
    ("\n\n", "has no events"),
])
def test_malformed_traces_name_the_line(tmp_path, text, message):
    with pytest.raises(FaultSpecError, match=message.replace("|", r"\|").replace("(", r"\(")):
        read_trace(write(tmp_path, text))


def test_a_trace_is_capped_to_the_local_cluster(tmp_path):
    trace = write(tmp_path, "0,add,a\n0,add,b\n0,add,c\n1000,remove,c\n1000,remove,a\n"
                            "2000,add,d\n2000,add,e\n3000,add,f\n4000,remove,b\n")
    schedule, left_out = replay_schedule(read_trace(trace), nodes=2, time_scale=2.0, name="t")
    got = [(s.at_s, s.fault.kind, s.fault.node, s.source) for s in schedule]
    # a, b are local nodes 0, 1; c is beyond the cap. d takes index 2; e and f find the
    # cluster full (2 live) and are left out; b's removal kills local node 1.
    assert got == [(0.5, "kill-node", 0, "t:5 remove a"), (1.0, "add-node", None, "t:6 add d"),
                   (2.0, "kill-node", 1, "t:9 remove b")]
    assert left_out == 4  # c at the start, c's removal, e, f
    with pytest.raises(FaultSpecError, match="never has 5 nodes live at once \\(at most 4\\)"):
        replay_schedule(read_trace(trace), nodes=5, time_scale=1.0)


def test_with_a_notice_each_removal_is_announced_that_long_before_it(tmp_path):
    trace = write(tmp_path, "0,add,a\n0,add,b\n0,add,c\n1000,remove,c\n1000,remove,a\n"
                            "2000,add,d\n2000,add,e\n3000,add,f\n4000,remove,b\n")
    schedule, _ = replay_schedule(read_trace(trace), nodes=2, time_scale=2.0, name="t", notice_s=1.5)
    got = [(s.at_s, s.fault.kind, s.fault.node, s.fault.notice_s, s.source) for s in schedule]
    # a's removal at 0.5 s cannot be announced 1.5 s ahead: at the start, 0.5 s ahead. The
    # announcements come before the addition of d they used to follow; the cap is the same.
    assert got == [(0.0, "preempt-node", 0, 0.5, "t:5 remove a"), (0.5, "preempt-node", 1, 1.5, "t:9 remove b"),
                   (1.0, "add-node", None, None, "t:6 add d")]
    # A node added 1 s before its removal is told when it arrives, not before it exists.
    trace = write(tmp_path, "0,add,a\n0,add,b\n2000,remove,a\n4000,add,c\n6000,remove,c\n")
    schedule, _ = replay_schedule(read_trace(trace), nodes=2, time_scale=1.0, notice_s=5.0)
    assert [(s.at_s, s.fault.kind, s.fault.node, s.fault.notice_s) for s in schedule] == [
        (0.0, "preempt-node", 0, 2.0), (4.0, "add-node", None, None), (4.0, "preempt-node", 2, 2.0)]


def test_the_replay_starts_once_the_trace_has_the_clusters_nodes(tmp_path):
    trace = write(tmp_path, "0,add,a\n500,add,b\n800,remove,a\n900,add,c\n1000,add,d\n3000,remove,c\n")
    schedule, left_out = replay_schedule(read_trace(trace), nodes=3, time_scale=1.0)
    # b, c, d are live at 1000 ms: local nodes 0, 1, 2; c goes 2 s later
    assert [(s.at_s, s.fault.kind, s.fault.node) for s in schedule] == [(2.0, "kill-node", 1)]
    assert left_out == 0


@pytest.mark.parametrize("name, nodes", [("p3-trace.csv", 6), ("g4dn-trace.csv", 4)])
def test_the_shipped_traces_replay_onto_a_few_nodes(name, nodes):
    """Every kill names a node that is live at that moment, and the cluster never holds
    more than `nodes` nodes: the replay is consistent with how the harness adds nodes."""
    events = read_trace(TRACES / name)
    schedule, _ = replay_schedule(events, nodes, time_scale=68.0)
    live, launched = set(range(nodes)), nodes
    for step in schedule:
        if step.fault.kind == "add-node":
            live.add(launched)
            launched += 1
        else:
            assert step.fault.node in live, step
            live.remove(step.fault.node)
        assert len(live) <= nodes
    removals = sum(s.fault.kind == "kill-node" for s in schedule)
    assert removals >= 15 and schedule[-1].at_s < 11 * 60  # about 10 minutes at 68x


def test_random_faults_keep_the_live_nodes_in_range():
    source = RandomFaults(1.5, seed=7, low=4, high=6, kinds=random_kinds(None, etcd_members=3))
    live, elapsed, gaps, kinds = 6, 0.0, [], set()
    last = 0.0
    while elapsed < 3600:
        elapsed += 0.5
        for fault in source.due(elapsed, live, etcd_all_up=True):
            gaps.append(elapsed - last)
            last = elapsed
            kinds.add(fault.kind)
            live += 1 if fault.kind == "add-node" else -(fault.kind in NODE_LOSSES)
            assert 4 <= live <= 6, (fault, live)
    assert 19.5 <= min(gaps) and max(gaps) <= 60.5  # 1.5 a minute: every 20 to 60 s
    assert 60 <= len(gaps) <= 120
    assert kinds == set(random_kinds(None, etcd_members=3))


def test_some_random_faults_come_during_the_recovery_from_the_last():
    """--random-follow-up: about that share of the faults is followed by another within
    0.3 to 4 s (while the job recovers); without it, the seed's faults are as before."""
    def gaps(follow_up: float) -> list[tuple[float, str]]:
        source = RandomFaults(1.5, seed=7, low=4, high=6, kinds=("kill-node", "add-node", "partition"),
                              follow_up=follow_up)
        found, last, elapsed, live = [], 0.0, 0.0, 6
        while elapsed < 3600:
            elapsed = round(elapsed + 0.1, 1)
            for fault in source.due(elapsed, live, etcd_all_up=True):
                found.append((round(elapsed - last, 1), fault.kind))
                last = elapsed
                live += 1 if fault.kind == "add-node" else -(fault.kind in NODE_LOSSES)
        return found
    followed = [gap for gap, _ in gaps(0.3)]
    quick = [gap for gap in followed if gap <= 4.1]
    assert all(0.3 <= gap for gap in followed) and 0.15 <= len(quick) / len(followed) <= 0.45, followed
    plain = [gap for gap, _ in gaps(0.0)]
    assert min(plain) >= 19.9 and len(plain) >= 60
    with pytest.raises(FaultSpecError, match="a chance, from 0 to 1"):
        RandomFaults(1.5, seed=0, low=1, high=2, kinds=("add-node",), follow_up=2)


def test_random_kinds_are_checked():
    assert "kill-etcd-member" not in random_kinds(None, etcd_members=1)
    assert random_kinds("kill-node, add-node", etcd_members=1) == ("kill-node", "add-node")
    with pytest.raises(FaultSpecError, match="unknown kind"):
        random_kinds("kill-node,nuke", etcd_members=1)
    with pytest.raises(FaultSpecError, match="--etcd-members 3"):
        random_kinds("kill-etcd-member", etcd_members=1)
    with pytest.raises(FaultSpecError, match="must be > 0"):
        RandomFaults(0, seed=0, low=1, high=2, kinds=("add-node",))
