"""`planaria chaos --hosts` end to end: every node and etcd member a network namespace of
its own (docs/chaos.md, "Nodes as hosts"), and the network faults on them: a node
isolated and fenced, a partition, a slow link, an etcd member cut off. Each run against
the same job without faults; nothing lost."""
from __future__ import annotations

import json
import os
import re

import pytest

from planaria.chaos.hosts import remove_stale
from planaria.runtime.contract.checkpoint_layout import complete_checkpoints, read_checkpoint_manifest, shard_dir
from tests.chaos.faulted_runs import assert_nothing_lost, chaos


AS_ROOT = pytest.mark.skipif(os.geteuid() != 0,
                             reason="simulated hosts need root (network namespaces and veth links)")
"""The runs on simulated hosts (`--hosts`). Root is the one reason to skip them: as root,
a missing `ip` (iproute2, which .ci/setup installs) is a broken set-up, and fails them."""


def assert_cut_off_then_back(tmp_path, nodes: list[str]) -> str:
    """The partition of `nodes`: one failure that planned them out, one join that took
    them back (every node trains again), no other epoch (no loop of failing epochs); the
    agents' logs, for more checks."""
    logs = "".join(p.read_text() for p in (tmp_path / "out" / "run" / "logs").glob("agent-*.log"))
    assert f"cut off {nodes}" in logs and f"joined {[f'{n}.0' for n in nodes]}" in logs
    epochs = re.findall(r"controller: epoch (\d+) \((\w+);", logs)
    assert [reason for _, reason in epochs] == ["failure", "join"], epochs
    return logs


STEPS_4 = 150
HOSTS_4 = ["--nodes", "4", "--hosts", "parallel.min_stages=2", f"train.steps={STEPS_4}", "checkpoint.every=5",
           "checkpoint.keep=1000"]
"""The 4-node runs on hosts of one fault share these (and so their reference run)."""
NET_STEPS = 360
NET_PACE = "node0.0:step@*!slow=0.09"
"""The run of every network fault kind: its faults start at steps but last seconds, and
the partition's node must be planned in again before the job ends, some 16 s after the
cut (12 s of cut, then its return). node0.0 (never faulted) sleeps 0.09 s at each step
(`PLANARIA_FAULTS`'s straggler), so that the 180 steps after the cut take at least 16 s
however fast the machine: on one where the demo job steps in 0.03 s, 330 unpaced steps
ended 9 s after the cut, with node3 still cut off."""


@pytest.mark.slow  # ~2 min; every network fault kind runs on hosts in the default suite (below)
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@AS_ROOT
def test_nodes_as_hosts_talk_over_their_own_addresses(tmp_path, cache):
    """--hosts: every node and the etcd member in a network namespace of its own, with
    only `lo` and its link to the others: the job can train only over those addresses.
    A node SIGKILLed, nothing lost, and nothing of the network left after the run."""
    proc = chaos(["--nodes", "4", "--hosts", "--fault", "kill-node@5:target=2", "parallel.min_stages=2",
                  "train.steps=20"], tmp_path, cache)
    report = assert_nothing_lost(proc, tmp_path, 20)
    (kill,) = report["recoveries"]
    assert kill["total_s"] is not None
    assert remove_stale() == []  # the harness (gone now) removed its namespaces and links itself


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@AS_ROOT
def test_every_network_fault_kind_in_one_run(tmp_path, cache):
    """--hosts, 4 nodes, 3 etcd members, one run of every network fault kind in turn:

    - node1's packets vanish for 8 s (connections open, nothing answers, its etcd lease
      lapses). The others go on without it (released on the leader's decision). Its
      worker is fenced: it commits nothing after the cut, and when its epoch fails it
      writes its layers as the next checkpoint's and reports them
      (PLANARIA_LATE_WRITER), which no manifest ever names. Healed, its layers are of an
      old step: it joins as a new worker, receiving its layers.
    - node2's link at 1 Mbit/s for 5 s: slower steps, no reconfiguration.
    - etcd member 0, the one every agent talks to first, cut off from the other two for
      5 s: the agents fail over, no lease lapses, nothing changes.
    - node3 cut off from the other three for 12 s (the cut is seen by probes and
      reported before the leader plans: about 3 s, docs/benchmarks.md), both
      sides still reaching etcd: the leader ends the epoch, plans over the three, which
      hold every layer, keeps node3 waiting, and plans it in once healed.

    Faults start at steps (not seconds) so that they come in this order on a machine of
    any speed; the partition comes late enough for node1 to be back first even when its
    worker had to be started afresh (a new process: imports and layers, ~100 steps here). Nothing lost, losses as without faults. (Each fault alone, at length, and
    on 6 nodes: the slow tests below.)"""
    proc = chaos(["--nodes", "4", "--hosts", "--etcd-members", "3", "parallel.min_stages=2",
                  f"train.steps={NET_STEPS}", "checkpoint.every=10", "checkpoint.keep=1000",
                  "--fault", "isolate-node@5:target=1:for=8", "--fault", "slow-link@80:target=2:for=5",
                  "--fault", "isolate-etcd-member@90:target=0:for=5", "--fault", "partition@180:target=3:for=12"],
                 tmp_path, cache, env={"PLANARIA_LATE_WRITER": "node1.0", "PLANARIA_FAULTS": NET_PACE})
    report = assert_nothing_lost(proc, tmp_path, NET_STEPS)
    isolated, slow, etcd, cut = report["recoveries"]
    assert isolated["total_s"] is not None and isolated["total_s"] <= 10, isolated
    assert isolated["release_s"] is not None and isolated["release_s"] < 1.0, isolated
    assert slow["note"] == "no reconfiguration needed" and slow["step_time_ratio"] > 3, slow
    assert etcd["note"] == "etcd member: no reconfiguration needed", etcd
    assert cut["fault"].startswith("partition") and cut["plan_shape"] == [3], cut
    run = tmp_path / "out" / "run"
    agents = "".join(p.read_text() for p in (run / "logs").glob("agent-*.log"))
    assert "cut off ['node3']" in agents and "joined ['node3.0']" in agents, agents[-3000:]
    # node1's failure and return, node3's: four epochs. At most one more: the entry into
    # the epoch that takes node1 back can fail once while its worker is still leaving
    # the epoch it was cut off in (then the same plan is entered again; nothing lost).
    epochs = re.findall(r"controller: epoch \d+ \(([^)]*)\)", agents)
    retries = [e for e in epochs if e == "failure; failed -, joined -"]
    back = "node1~1.0" if "joined ['node1~1.0']" in agents else "node1.0"  # (see assert_fenced)
    assert [e for e in epochs if e not in retries] == [
        "failure; failed ['node1.0'], joined -", f"join; failed -, joined ['{back}']",
        "failure; failed -, joined -; cut off ['node3']", "join; failed -, joined ['node3.0']"], epochs
    assert len(retries) <= 1, epochs
    assert agents.count("registering again") == 1, agents  # node1's, isolated; no other lease lapsed
    assert_fenced(run, "node1.0")


def assert_fenced(run, worker: str) -> None:
    """`worker`, cut off and back, joined as a new worker: itself, having left the epoch it
    was cut off in (only then is it planned in), or, when its collectives stayed blocked
    after their release, its agent's fresh worker `<node>~1`. It committed nothing
    between the cut and its return; the checkpoint it wrote late (PLANARIA_LATE_WRITER)
    is named by no manifest: each names the shards of the epoch that committed its step."""
    logs = "".join(p.read_text() for p in (run / "logs").glob("*.log"))
    node, local = worker.split(".")
    if f"joined ['{node}~1.{local}']" in logs:  # reset: the worker asked to be started again
        assert "this worker exits, to be started again as a new one" in logs
        # It never left its epoch, so it wrote nothing late, and committed nothing after the cut.
        commits = [json.loads(line) for line in (run / f"commits-{worker}.jsonl").read_text().splitlines()]
        assert all(c["epoch"] == 0 for c in commits), commits
        return
    else:
        assert "it was left out; joining as a new worker" in logs
        assert f"joined ['{worker}']" in logs  # back in the job
    late = re.search(r"wrote its layers of step (\d+) as checkpoint (\d+)'s, late", logs)
    assert late, logs[-3000:]
    late_step, late_checkpoint = int(late[1]), int(late[2])
    commits = [json.loads(line) for line in (run / f"commits-{worker}.jsonl").read_text().splitlines()]
    resumed = min([c["step"] for c in commits if c["epoch"] > 0], default=10**9)
    assert not [c["step"] for c in commits if late_step < c["step"] < resumed], commits
    found = complete_checkpoints(run / "checkpoints")
    assert late_checkpoint in [k for k, _ in found], found
    for k, path in found:
        epoch = read_checkpoint_manifest(path).epoch
        assert epoch is not None and shard_dir(path) == path / f"epoch-{epoch}"
        assert (epoch == 0) == (k <= late_step), (k, epoch)


@pytest.mark.slow  # ~1.5 min; every network fault kind is in the one run above, in the default suite
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@AS_ROOT
def test_an_isolated_node_is_fenced_then_comes_back_as_a_new_one(tmp_path, cache):
    """--hosts: node1's packets vanish for 10 s, alone (the run above has the same
    fault among others): fenced, then back as a new worker; nothing lost."""
    # Paced (NET_PACE), with steps for the node's way back: its worker hears of the failed
    # epoch when the cut heals, exits 10 s later, and joins again as a new one.
    proc = chaos([*HOSTS_4, "train.steps=350", "--fault", "isolate-node@5:target=1:for=10"], tmp_path, cache,
                 env={"PLANARIA_LATE_WRITER": "node1.0", "PLANARIA_FAULTS": NET_PACE})
    report = assert_nothing_lost(proc, tmp_path, 350)
    (isolated,) = report["recoveries"]
    assert isolated["total_s"] is not None and isolated["total_s"] <= 10, isolated
    assert isolated["release_s"] is not None and isolated["release_s"] < 1.0, isolated
    assert_fenced(tmp_path / "out" / "run", "node1.0")


@pytest.mark.slow  # ~3 min with its reference; docs/chaos.md ("A cut while an epoch is being planned")
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@AS_ROOT
def test_a_cut_while_an_epoch_is_being_planned_loses_nothing(tmp_path, cache):
    """--hosts, 6 nodes, f=1: node4 killed and node1 cut off from the others in the same
    moment (the kill is seen in about 0.1 s and planned in 0.07 s more, over node1, whose
    cut no probe has seen yet), then node5 killed and node3 isolated (etcd too) likewise.
    The epochs planned over a node that was already cut fail and are planned again
    without it, or the leader waits for the cut to heal where its layers are the only
    ones left; both nodes join again once back. Nothing lost, losses as without faults."""
    proc = chaos(["--nodes", "6", "--hosts", "--etcd-members", "3", "--fault-tolerance", "1",
                  "--fault", "kill-node@300:target=4", "--fault", "partition@300:target=1:for=8",
                  "--fault", "kill-node@700:target=5", "--fault", "isolate-node@700:target=3:for=8",
                  "parallel.min_stages=2", "comm.timeout_s=10", "train.steps=1200"], tmp_path, cache, timeout=540)
    assert_nothing_lost(proc, tmp_path, 1200)
    logs = "".join(p.read_text() for p in (tmp_path / "out" / "run" / "logs").glob("agent-*.log"))
    assert "joined ['node1.0']" in logs and "joined ['node3.0']" in logs, logs[-3000:]


@pytest.mark.slow  # ~3 min; every network fault kind is in one run in the default suite
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@AS_ROOT
def test_a_slow_link_an_etcd_minority_and_a_partition_on_six_nodes(tmp_path, cache):
    """--hosts, 6 nodes, 3 etcd members, f=1: node1's link at 1 Mbit/s for 8 s (slower
    steps, no reconfiguration); etcd member 0 cut off from the other two for 8 s (the
    agents fail over, no lease lapses, nothing changes); then nodes 4 and 5 cut off from
    the other four for 12 s (four lease TTLs), both sides still reaching etcd (the leader
    plans over the four, which hold every layer, and plans the two in once healed)."""
    proc = chaos(["--nodes", "6", "--hosts", "--etcd-members", "3", "--fault-tolerance", "1",
                  "--fault", "slow-link@5:target=1:for=8", "--fault", "isolate-etcd-member@15:target=0:for=8",
                  "--fault", "partition@15+9:target=4+5:for=12", "parallel.min_stages=2", "train.steps=350"],
                 tmp_path, cache, timeout=840, env={"PLANARIA_FAULTS": NET_PACE})  # paced: the cut heals before the end
    report = assert_nothing_lost(proc, tmp_path, 350)
    slow, etcd, cut = report["recoveries"]
    assert slow["note"] == "no reconfiguration needed" and slow["step_time_ratio"] > 3, slow
    assert etcd["note"] == "etcd member: no reconfiguration needed", etcd
    assert cut["fault"].startswith("partition") and cut["plan_shape"] == [2, 2], cut
    logs = assert_cut_off_then_back(tmp_path, ["node4", "node5"])
    assert "registering again" not in logs  # no lease lapsed


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@AS_ROOT
def test_a_partition_trains_on_its_larger_side_then_on_every_node_again(tmp_path, cache):
    """--hosts: nodes 4 and 5 cannot reach the other four for 20 s (several lease TTLs), and
    both sides still reach etcd: no lease lapses, no worker dies. The agents' probes see
    the cut; the leader ends the epoch, plans over the four (which hold a replica of every
    layer: no checkpoint), keeps the two waiting while they cannot reach them, and plans
    them in once the cut heals. One failure, one join; nothing lost, losses as without
    faults."""
    proc = chaos(["--nodes", "6", "--hosts", "--fault-tolerance", "1", "--fault", "partition@5:target=4+5:for=20",
                  "parallel.min_stages=2", "train.steps=300"], tmp_path, cache,
                 env={"PLANARIA_FAULTS": NET_PACE})  # paced: the cut heals before the end
    report = assert_nothing_lost(proc, tmp_path, 300)
    (cut,) = report["recoveries"]
    assert cut["fault"] == "partition@5:target=4+5:for=20" and cut["plan_shape"] == [2, 2], cut
    assert_cut_off_then_back(tmp_path, ["node4", "node5"])


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@AS_ROOT
def test_a_slow_link_slows_the_job_and_is_not_taken_for_a_failure(tmp_path, cache):
    """--hosts: node1's link limited to 1 Mbit/s for 10 s. Every step waits for it (its
    activations and gradients cross it), so the steps that end meanwhile are many times
    slower, but nothing is declared failed: no probe sees a cut, no epoch ends."""
    proc = chaos([*HOSTS_4, "--fault", "slow-link@5:target=1:for=10"], tmp_path, cache)
    report = assert_nothing_lost(proc, tmp_path, STEPS_4)
    (slow,) = report["recoveries"]
    assert slow["note"] == "no reconfiguration needed" and slow["step_time_ratio"] > 3, slow
    logs = "".join(p.read_text() for p in (tmp_path / "out" / "run" / "logs").glob("agent-*.log"))
    assert "controller: epoch" not in logs and "cannot reach" not in logs, logs[-3000:]


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@AS_ROOT
def test_an_etcd_member_cut_off_from_the_others_changes_nothing(tmp_path, cache):
    """--hosts, 3 etcd members: member 0, the one every agent talks to first, is cut off
    from the other two for 10 s. It still accepts connections but, a minority, serves
    nothing: the agents fail over to the others within a third of their lease's TTL, no
    lease lapses, and the job trains on without a reconfiguration."""
    proc = chaos([*HOSTS_4, "--etcd-members", "3", "--fault", "isolate-etcd-member@5:target=0:for=10"],
                 tmp_path, cache)
    report = assert_nothing_lost(proc, tmp_path, STEPS_4)
    (cut,) = report["recoveries"]
    assert cut["note"] == "etcd member: no reconfiguration needed", cut
    logs = "".join(p.read_text() for p in (tmp_path / "out" / "run" / "logs").glob("agent-*.log"))
    assert "controller: epoch" not in logs and "registering again" not in logs, logs[-3000:]


CUT_6 = ["--nodes", "6", "--hosts", "--etcd-members", "3", "--fault-tolerance", "1", "parallel.min_stages=2",
         "train.steps=120"]
"""Six nodes, three pipelines of two stages: nodes 0, 2 and 4 hold the first stage's
layers in epoch 0, nodes 1, 3 and 5 the second's."""


@pytest.mark.slow  # ~1 min; the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@AS_ROOT
def test_a_cut_is_not_a_death_the_job_waits_for_the_layers_only_cut_off_nodes_hold(tmp_path, cache):
    """--hosts: node1 killed at step 10, and a moment later nodes 3 and 5, the other
    holders of the second stage, cut off the network (etcd included) for 15 s: their
    leases lapse, but no probe found their agents gone. The survivors' peer snapshots
    would train a step again; the leader waits for the cut-off nodes instead, and copies
    their layers when they come back: nothing trained again, nothing lost."""
    proc = chaos([*CUT_6, "--fault", "kill-node@10:target=1", "--fault", "isolate-node@10+0.2:target=3:for=15",
                  "--fault", "isolate-node@10+0.2:target=5:for=15"], tmp_path, cache)
    report = assert_nothing_lost(proc, tmp_path, 120)
    assert report["memory_restores"] == 0, report
    logs = "".join(p.read_text() for p in (tmp_path / "out" / "run" / "logs").glob("agent-*.log"))
    assert "out of reach but not known dead" in logs and "the nodes out of reach came back after" in logs, logs
    assert any("waited" in r["note"] and "for nodes out of reach" in r["note"] for r in report["recoveries"]), report


@pytest.mark.slow  # ~1 min; the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@AS_ROOT
def test_a_partition_during_a_planned_leave_loses_nothing(tmp_path, cache):
    """--hosts: node1 told (SIGTERM, 20 s of grace) that it will be gone, and a moment
    later nodes 3 and 5 cut off the others for 15 s, both sides reaching etcd. The leave
    and the cut meet: whichever the leader acts on first, node1 leaves before its
    deadline, handing over the layers only it holds; the job completes, nothing lost,
    losses as without faults."""
    proc = chaos([*CUT_6, "--fault", "preempt-node@10:target=1:notice=20",
                  "--fault", "partition@10+0.1:target=3+5:for=15"], tmp_path, cache)
    assert_nothing_lost(proc, tmp_path, 120)
    logs = "".join(p.read_text() for p in (tmp_path / "out" / "run" / "logs").glob("agent-*.log"))
    assert "left ['node1']" in logs, logs
