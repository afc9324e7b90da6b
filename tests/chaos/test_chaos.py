"""`planaria chaos` end to end: a local cluster of six agents on etcd, a node and a worker
SIGKILLed and a node added while it trains, against the same job without faults
(computed here, in a fresh reference cache, not taken from an earlier run); silent
peers, simultaneous faults, a trace replay, the demo, a run interrupted. (The runs on
simulated hosts, with the network faults: test_chaos_hosts.py; the bad inputs that must
be refused before anything starts: test_chaos_inputs.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.chaos.faulted_runs import assert_nothing_lost, chaos
from tests.launch import TINY


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


@pytest.mark.slow  # ~1 min; the controller's side is tests/elastic/test_controller_waits.py; `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_job_below_its_minimum_waits_for_a_node_and_goes_on(tmp_path, cache):
    """Four nodes (pipelines of two stages); node1 dies, then nodes 2 and 3 together: one
    node is left where one replica needs two. The job waits; a node added 4 s later is
    planned in with node0, and the job goes on from node0's layers and its peer
    snapshots, to the end, with the reference's losses. Only the steps since the snapshot
    it had to go back to are trained again (the verdict counts them as lost)."""
    proc = chaos(["--nodes", "4", "--fault-tolerance", "1", "--fault", "kill-node@5:target=1",
                  "--fault", "kill-node@12:target=2", "--fault", "kill-node@12:target=3",
                  "--fault", "add-node@12+4", "parallel.min_stages=2", "train.steps=60"], tmp_path, cache)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["completed"] and report["steps_committed"] == 60, proc.stdout[-6000:]
    assert report["max_loss_diff"] < 1e-6 and report["checkpoint_loads"] == 0, report
    back = [r for r in report["recoveries"] if r["fault"].startswith("kill-node@12")]
    assert {r["source"] for r in back} == {"memory"}, report["recoveries"]
    assert report["committed_steps_lost"] == back[0]["rerun"], report
    assert "the job waits up to 600 s (--join-timeout) for 1 more node(s)" in proc.stdout + proc.stderr or \
        any("waits up to 600 s" in p.read_text() for p in (tmp_path / "out").rglob("*.log"))
