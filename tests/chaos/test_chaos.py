"""`planaria chaos` end to end: a local cluster of six agents on etcd, a node and a worker
SIGKILLed and a node added while it trains, against the same job without faults
(computed here, in a fresh reference cache, not taken from an earlier run). Then the
bad inputs that must be refused before anything starts."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from planaria.cli import main as chaos_main
from planaria.chaos.faults import FaultSpec, FaultSpecError, parse_fault, validate
from planaria.chaos.hosts import remove_stale
from planaria.runtime.contract.checkpoint_layout import complete_checkpoints, read_checkpoint_manifest, shard_dir
from tests.launch import TINY


AS_ROOT = pytest.mark.skipif(os.geteuid() != 0,
                             reason="simulated hosts need root (network namespaces and veth links)")
"""The runs on simulated hosts (`--hosts`). Root is the one reason to skip them: as root,
a missing `ip` (iproute2, which .ci/setup installs) is a broken set-up, and fails them."""


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One reference cache for this module's runs (fresh: every reference is computed here);
    runs of the same job and cluster shape share their reference, as a user's do."""
    return tmp_path_factory.mktemp("chaos-cache")


def chaos(args: list[str], tmp_path, cache, timeout: float = 600,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(cache), **(env or {}))
    return subprocess.run([sys.executable, "-m", "planaria.cli", "chaos", str(TINY), *args,
                           "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def refused(tmp_path, cache, capsys, monkeypatch):
    """`planaria chaos ARGS` run in this process on input it must refuse: checks the exit
    status (2) and returns stderr. In this process, as a subprocess would spend seconds
    importing torch to print one line; a run that did start would still fail the test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))

    def run(args: list[str]) -> str:
        try:
            code = chaos_main(["chaos", str(TINY), *args, "--out", str(tmp_path / "out")])
        except SystemExit as exit:
            code = exit.code
        err = capsys.readouterr().err
        assert code == 2, err
        return err
    return run


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_the_issues_command_loses_nothing_in_float32(tmp_path, cache):
    proc = chaos(["--nodes", "6", "--fault-tolerance", "1", "--fault", "kill-node@3",
                  "--fault", "kill-worker@6", "--fault", "add-node@9", "parallel.min_stages=2"], tmp_path, cache)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["completed"] and report["steps_committed"] == 30
    assert report["committed_steps_lost"] == 0 and report["checkpoint_loads"] == 0
    assert report["max_loss_diff"] < 1e-6  # float32: re-plans do not change the sums
    kinds = [r["fault"].split("@")[0] for r in report["recoveries"]]
    assert kinds == ["kill-node", "kill-worker", "add-node"]
    for recovery in report["recoveries"][:2]:  # the failures were seen and recovered from
        assert recovery["detect_s"] is not None and recovery["total_s"] is not None, recovery
        assert 0 < recovery["detect_s"] < recovery["total_s"]
    assert 0 < report["ettr"] <= 1
    assert (tmp_path / "out" / "report.png").stat().st_size > 10_000
    assert "nothing was lost" in proc.stdout


def assert_nothing_lost(proc, tmp_path, steps: int) -> dict:
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["completed"] and report["steps_committed"] == steps, report
    assert report["committed_steps_lost"] == 0 and report["checkpoint_loads"] == 0, report
    assert report["max_loss_diff"] < 1e-6, report
    return report


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
NET_STEPS = 400
NET_PACE = "node0.0:step@*!slow=0.09"
"""The run of every network fault kind: its faults start at steps but last seconds, and
the partition's node must be planned in again before the job ends, some 25 s after the
cut (20 s of cut, then its return). node0.0 (never faulted) sleeps 0.09 s at each step
(`PLANARIA_FAULTS`'s straggler), so that the 220 steps after the cut take at least 26 s
however fast the machine: on one where the demo job steps in 0.03 s, 330 unpaced steps
ended 9 s after the cut, with node3 still cut off."""


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_silent_peers_cost_seconds_not_the_collective_timeout(tmp_path, cache):
    """With default settings (a 300 s collective timeout): a worker SIGSTOPped (its agent
    sees its heartbeat stop and kills it) and a whole node frozen (its lease lapses, its
    sockets stay open and silent, and nobody can kill it: the survivors blocked on it are
    released by the leader's decision). Each is recovered from in seconds, nothing lost,
    and the replicas stay bit-identical through the releases (the audit finds nothing)."""
    proc = chaos(["--nodes", "6", "--fault-tolerance", "1", "--fault", "hang-worker@3:target=5.0",
                  "--fault", "freeze-node@10:target=2", "parallel.min_stages=2", "audit.every=2"], tmp_path, cache)
    report = assert_nothing_lost(proc, tmp_path, 30)
    assert not list((tmp_path / "out" / "run").glob("audit-*.jsonl")), "replicas disagreed after a release"
    hang, freeze = report["recoveries"]
    assert hang["fault"] == "hang-worker@3:target=5.0" and freeze["fault"] == "freeze-node@10:target=2"
    for recovery in (hang, freeze):
        assert recovery["total_s"] is not None and recovery["total_s"] <= 10, recovery
    # The frozen node's peers waited on it until the leader's decision, then left at once.
    assert freeze["release_s"] is not None and freeze["release_s"] < 1.0, freeze
    assert "released its collectives" in "".join(p.read_text() for p in (tmp_path / "out" / "run" / "logs").glob("node*.log"))


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
    - node3 cut off from the other three for 20 s (the cut is seen by probes and
      reported from both sides before the leader plans: up to ~12 s here), both
      sides still reaching etcd: the leader ends the epoch, plans over the three, which
      hold every layer, keeps node3 waiting, and plans it in once healed.

    Faults start at steps (not seconds) so that they come in this order on a machine of
    any speed; the partition comes late enough for node1 to be back first even when its
    worker had to be started afresh (a new process: imports and layers, ~100 steps here). Nothing lost, losses as without faults. (Each fault alone, at length, and
    on 6 nodes: the slow tests below.)"""
    proc = chaos(["--nodes", "4", "--hosts", "--etcd-members", "3", "parallel.min_stages=2",
                  f"train.steps={NET_STEPS}", "checkpoint.every=10", "checkpoint.keep=1000",
                  "--fault", "isolate-node@5:target=1:for=8", "--fault", "slow-link@80:target=2:for=5",
                  "--fault", "isolate-etcd-member@90:target=0:for=5", "--fault", "partition@180:target=3:for=20"],
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
    proc = chaos([*HOSTS_4, "--fault", "isolate-node@5:target=1:for=10"], tmp_path, cache,
                 env={"PLANARIA_LATE_WRITER": "node1.0"})
    report = assert_nothing_lost(proc, tmp_path, STEPS_4)
    (isolated,) = report["recoveries"]
    assert isolated["total_s"] is not None and isolated["total_s"] <= 10, isolated
    assert isolated["release_s"] is not None and isolated["release_s"] < 1.0, isolated
    assert_fenced(tmp_path / "out" / "run", "node1.0")


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
                  "--fault", "partition@15+9:target=4+5:for=12", "parallel.min_stages=2", "train.steps=200"],
                 tmp_path, cache, timeout=840)
    report = assert_nothing_lost(proc, tmp_path, 200)
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
                  "parallel.min_stages=2", "train.steps=120"], tmp_path, cache)
    report = assert_nothing_lost(proc, tmp_path, 120)
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


@pytest.mark.slow  # ~90 s; each kind is also in the default suite (tests/elastic, tests/runtime)
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_hung_worker_an_agent_and_an_etcd_member(tmp_path, cache):
    """The other kinds, through the harness, on a 3-member etcd: a worker SIGSTOPped (its
    peers time out after comm.timeout_s, before its agent sees its heartbeat stop), an
    agent SIGKILLed, an etcd member SIGKILLed (no reconfiguration)."""
    proc = chaos(["--nodes", "6", "--fault-tolerance", "1", "--etcd-members", "3",
                  "--fault", "hang-worker@3:target=5.0", "--fault", "kill-agent@8:target=0",
                  "--fault", "kill-etcd-member@12", "parallel.min_stages=2", "comm.timeout_s=4"],
                 tmp_path, cache)
    report = assert_nothing_lost(proc, tmp_path, 30)
    hang, agent, member = report["recoveries"]
    assert hang["fault"] == "hang-worker@3:target=5.0" and hang["total_s"] is not None
    assert agent["fault"] == "kill-agent@8:target=0" and agent["total_s"] is not None
    assert member["fault"].startswith("kill-etcd-member@12") and member["epoch"] is None
    assert hang["epoch"] < agent["epoch"]  # two reconfigurations, one each


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_simultaneous_faults_and_a_fault_during_the_recovery(tmp_path, cache):
    """Six nodes make three 2-stage pipelines (node0-1, node2-3, node4-5). A worker of
    node3 and all of node2 die at once; a second later, while the job recovers, node5's
    agent dies too. node0-1 still hold every layer."""
    proc = chaos(["--nodes", "6", "--fault-tolerance", "1", "--fault", "kill-worker@3:target=3.0",
                  "--fault", "kill-node@3:target=2", "--fault", "kill-agent@3+1:target=5",
                  "parallel.min_stages=2"], tmp_path, cache)
    report = assert_nothing_lost(proc, tmp_path, 30)
    worker, node, agent = report["recoveries"]
    assert worker["epoch"] == node["epoch"], "simultaneous faults are one reconfiguration"
    assert agent["total_s"] is not None, report["recoveries"]  # in that reconfiguration or the next
    assert agent["epoch"] >= node["epoch"]


@pytest.mark.parametrize("args, message", [
    (["--fault", "explode-node@3"], "unknown fault kind 'explode-node'"),
    (["--fault", "kill-node@30"], "step 30 is beyond the job's train.steps=30"),
    (["--fault", "kill-node@3:target=7"], "there is no node 7 by step 3"),
    (["--fault", "kill-worker@3:target=1.2"], "local ranks 0 to 0"),
    (["--fault", "kill-etcd-member@3"], "Run with --etcd-members 3"),
    (["--fault", "kill-node"], "expected KIND@STEP[+SECONDS][:target=NODE[.LOCAL]]"),
    (["--fault", "preempt-node@3:target=1"], "a preemption comes with a notice; say how long with :notice=SECONDS"),
    (["--fault", "kill-node@3:notice=20"], "only preempt-node takes :notice=, not kill-node"),
    (["--notice", "30"], "--notice announces a --trace's removals ahead; give --trace too"),
])
def test_bad_faults_are_refused_before_anything_starts(args, message, tmp_path, refused):
    assert message in refused(["--nodes", "4", *args])
    assert not (tmp_path / "out").exists(), "nothing may start for a bad fault"


def test_fault_specs_and_targets():
    assert parse_fault("kill-worker@6:target=2.1") == FaultSpec("kill-worker", 6, 2, 1)
    assert str(parse_fault("add-node@9")) == "add-node@9"
    with pytest.raises(FaultSpecError, match="acts on a whole node"):
        parse_fault("kill-node@3:target=2.0")
    # a node added at step 4 is a target from then on, not before
    validate([parse_fault("add-node@4"), parse_fault("kill-node@5:target=4")],
             steps=10, nodes=4, nproc=1, etcd_members=1)
    with pytest.raises(FaultSpecError, match="no node 4 by step 3"):
        validate([parse_fault("add-node@4"), parse_fault("kill-node@3:target=4")],
                 steps=10, nodes=4, nproc=1, etcd_members=1)


def test_a_preemption_names_its_notice_and_needs_the_local_cloud():
    fault = parse_fault("preempt-node@8:target=2,notice=20")  # the issue's spelling too
    assert fault == FaultSpec("preempt-node", 8, 2, notice_s=20.0)
    assert str(fault) == "preempt-node@8:target=2:notice=20"
    with pytest.raises(FaultSpecError, match="cannot reach the local cloud"):
        validate([fault], steps=10, nodes=4, nproc=1, etcd_members=1, hosts=True)


def test_network_faults_last_a_while_and_need_hosts():
    fault = parse_fault("isolate-node@4:target=1:for=20")
    assert fault == FaultSpec("isolate-node", 4, 1, None, 0.0, 20.0) and str(fault) == "isolate-node@4:target=1:for=20"
    with pytest.raises(FaultSpecError, match="say how long with :for=SECONDS"):
        parse_fault("slow-link@4:target=1")
    with pytest.raises(FaultSpecError, match="kill-node is not a network fault"):
        parse_fault("kill-node@4:for=3")
    validate([fault], steps=10, nodes=4, nproc=1, etcd_members=1, hosts=True)
    with pytest.raises(FaultSpecError, match="run with --hosts"):
        validate([fault], steps=10, nodes=4, nproc=1, etcd_members=1)
    from planaria.chaos.sources import RandomFaults, random_kinds

    assert "isolate-node" not in random_kinds(None, 1)  # without --hosts
    with pytest.raises(FaultSpecError, match="need nodes with networks of their own; run with --hosts"):
        random_kinds("isolate-node", 1)
    drawn = random_kinds(None, 3, hosts=True)
    assert {"isolate-node", "slow-link", "partition", "isolate-etcd-member"} <= set(drawn)
    source = RandomFaults(60, seed=3, low=4, high=6, kinds=("partition",))
    (fault,) = source.due(10.0, 5, True)
    assert fault.kind == "partition" and 5 <= fault.duration_s <= 30  # a drawn network fault lasts


def test_a_partition_names_a_group_of_nodes():
    fault = parse_fault("partition@4:target=4+5:for=12")
    assert fault.group == (4, 5) and fault.node is None and str(fault) == "partition@4:target=4+5:for=12"
    validate([fault], steps=10, nodes=6, nproc=1, etcd_members=1, hosts=True)
    with pytest.raises(FaultSpecError, match="only a partition takes a group"):
        parse_fault("isolate-node@4:target=1+2:for=5")
    with pytest.raises(FaultSpecError, match="name a group of them that leaves some out"):
        validate([parse_fault("partition@4:target=0+1+2+3:for=5")], steps=10, nodes=4, nproc=1,
                 etcd_members=1, hosts=True)
    with pytest.raises(FaultSpecError, match="--etcd-members 3"):
        validate([parse_fault("isolate-etcd-member@4:target=0:for=5")], steps=10, nodes=4, nproc=1,
                 etcd_members=1, hosts=True)


@pytest.mark.parametrize("trace_text, extra, message", [
    ("0,add,a\n0,add,b\n0,add,c\n0,add,d\n2000,remove;a\n", [], "trace.csv:5: expected time_ms,add|remove,NODE"),
    ("0,add,a\n0,add,b\n", [], "never has 4 nodes live at once (at most 2)"),
    ("0,add,a\n0,add,b\n0,add,c\n0,add,d\n", ["--fault", "kill-node@3"], "--trace replays alone"),
    ("0,add,a\n0,add,b\n0,add,c\n0,add,d\n", ["--time-scale", "0"], "--time-scale 0: must be > 0"),
    (None, ["--random", "2", "--random-kinds", "kill-node,melt"], "unknown kind(s) ['melt']"),
    (None, ["--random", "2", "--random-nodes", "5"], "expected LOW-HIGH"),
])
def test_bad_traces_and_random_settings_are_refused_before_anything_starts(trace_text, extra, message,
                                                                           tmp_path, refused):
    if trace_text is not None:
        (tmp_path / "trace.csv").write_text(trace_text)
        extra = ["--trace", str(tmp_path / "trace.csv"), *extra]
    assert message in refused(["--nodes", "4", *extra])
    assert not (tmp_path / "out").exists(), "nothing may start for bad input"


@pytest.mark.slow  # ~1 min; the replay's scheduling is in tests/chaos/test_sources.py; `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_trace_replay_removes_and_adds_nodes(tmp_path, cache):
    """A small trace, replayed at its own pace: one of four nodes is preempted 1.5 s into
    training and a new one arrives 2 s later; the job takes it in and loses nothing."""
    (tmp_path / "trace.csv").write_text("0,add,a\n0,add,b\n0,add,c\n0,add,d\n0,add,e\n"
                                        "1500,remove,b\n3500,add,f\n")
    proc = chaos(["--nodes", "4", "--fault-tolerance", "1", "--trace", str(tmp_path / "trace.csv"),
                  "parallel.min_stages=2", "train.steps=80"], tmp_path, cache)
    report = assert_nothing_lost(proc, tmp_path, 80)
    removal, addition = report["recoveries"]
    assert removal["fault"].startswith("kill-node@") and removal["fault"].endswith(":target=1")
    assert removal["total_s"] is not None
    assert addition["fault"].startswith("add-node") and addition["epoch"] is not None, addition
    assert "trace trace.csv:6 remove b" in proc.stdout and "1 trace event(s) beyond 4 nodes" in proc.stdout


@pytest.mark.slow  # ~2 min: the demo's reference and its run; `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_the_demo_loses_nothing(tmp_path, cache):
    env = dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(cache))
    proc = subprocess.run([sys.executable, "-m", "planaria.cli", "demo", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=850, env=env)
    report = assert_nothing_lost(proc, tmp_path, 300)
    kinds = [r["fault"].split(":")[0] for r in report["recoveries"]]
    assert kinds == ["kill-node@60", "add-node@70", "kill-node@230"]
    assert report["recoveries"][1]["epoch"] is not None, "the new node joined"
    assert all(r["total_s"] is not None for r in report["recoveries"])
    assert "nothing was lost" in proc.stdout and "report.png" in proc.stdout


@pytest.mark.slow  # ~1 min: a reference run, then a run stopped half way; `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_an_interrupted_run_stops_its_cluster_and_reports_the_run_so_far(tmp_path):
    """SIGTERM (as `timeout` sends it) half way through the faulted run: the command exits
    130, leaves no process of its cluster behind, and writes the report of what ran."""
    import signal
    import time

    from pathlib import Path

    from planaria.chaos.harness import ChaosSettings, _reference_key

    out = tmp_path / "out"
    overrides = ["train.steps=100000"]
    # A reference of 100,000 steps is not what this test is about: a cached one stands in.
    settings = ChaosSettings(Path(TINY), overrides, nodes=2, nproc=1, faults=[], out_dir=out)
    cached = tmp_path / "cache" / "planaria" / "chaos-references" / f"{_reference_key(settings)}.json"
    cached.parent.mkdir(parents=True)
    cached.write_text(json.dumps({"losses": {}, "step_s": 0.05, "median_step_s": 0.05}))
    env = dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "planaria.cli", "chaos", str(TINY), "--nodes", "2",
                             "--fault", "kill-worker@30:target=1.0", *overrides, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    commits = out / "run"
    deadline = time.monotonic() + 400

    def recovered() -> bool:
        """A step committed in epoch 1: the fault at step 30 struck and the job went on.
        (Counting steps alone raced the fault: at 31 steps it was not always injected.)"""
        lines = [line for p in commits.glob("commits-*.jsonl") for line in p.read_text().splitlines()]
        return any(json.loads(line).get("epoch", 0) >= 1 for line in lines if line.endswith("}"))
    try:
        while time.monotonic() < deadline:
            if commits.exists() and recovered():
                break
            time.sleep(0.5)
        else:
            pytest.fail("the faulted run never committed a step after its fault's recovery")
    finally:
        proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "the report of the run so far" in stderr
    report = json.loads((out / "report.json").read_text())
    assert report["outcome"] == "interrupted" and not report["completed"]
    assert report["steps_committed"] > 30 and report["recoveries"]
    leftover = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not leftover, f"processes of the stopped cluster are still running: {leftover}"


@pytest.mark.parametrize("extra, message", [
    (["--nproc-per-node", "0"], "--nproc-per-node must be at least 1, got 0"),
    (["--timeout", "0"], "--timeout must be positive"),
    (["--random-kinds", "kill-node"], "--random-kinds shape(s) the faults of --random RATE, which was not given"),
    (["--time-scale", "4"], "--time-scale speeds up a --trace replay, and no --trace was given"),
])
def test_options_that_would_be_ignored_or_break_the_reference_are_refused(extra, message, tmp_path, refused):
    """They were dropped silently ("no faults", then "nothing was lost"), or ended in the
    reference run's traceback."""
    assert message in refused(["--nodes", "4", *extra])
    assert not (tmp_path / "out").exists(), "nothing may start for bad input"


def test_a_corpus_prepared_again_gets_a_reference_of_its_own(tmp_path):
    """The cached fault-free reference is keyed by the data the job reads, not only its
    config: shards prepared again at the same path must not reuse the old losses."""
    from pathlib import Path

    from planaria.chaos.harness import ChaosSettings, _reference_key

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text('{"splits": {"train": [{"blake2b": "aa"}]}}')
    settings = ChaosSettings(Path(TINY), [f"data.source={corpus}"], nodes=2)
    before = _reference_key(settings)
    assert _reference_key(settings) == before
    (corpus / "manifest.json").write_text('{"splits": {"train": [{"blake2b": "bbbb"}]}}')
    assert _reference_key(settings) != before
