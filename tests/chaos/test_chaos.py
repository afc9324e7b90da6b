"""`planaria chaos` end to end: a local cluster of six agents on etcd, a node and a worker
SIGKILLed and a node added while it trains, against the same job without faults
(computed here, in a fresh reference cache, not taken from an earlier run). Then the
bad inputs that must be refused before anything starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from planaria.chaos.faults import FaultSpec, FaultSpecError, parse_fault, validate
from tests.launch import TINY

pytest.importorskip("pyetcd")


def chaos(args: list[str], tmp_path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "planaria.chaos.cli", "chaos", str(TINY), *args,
                           "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_the_issues_command_loses_nothing_in_float32(tmp_path):
    proc = chaos(["--nodes", "6", "--fault-tolerance", "1", "--fault", "kill-node@3",
                  "--fault", "kill-worker@6", "--fault", "add-node@9", "parallel.min_stages=2"], tmp_path)
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


@pytest.mark.parametrize("args, message", [
    (["--fault", "explode-node@3"], "unknown fault kind 'explode-node'"),
    (["--fault", "kill-node@30"], "step 30 is beyond the job's train.steps=30"),
    (["--fault", "kill-node@3:target=7"], "there is no node 7 by step 3"),
    (["--fault", "kill-worker@3:target=1.2"], "local ranks 0 to 0"),
    (["--fault", "kill-etcd-member@3"], "Run with --etcd-members 3"),
    (["--fault", "kill-node"], "expected KIND@STEP[:target=NODE[.LOCAL]]"),
])
def test_bad_faults_are_refused_before_anything_starts(args, message, tmp_path):
    proc = chaos(["--nodes", "4", *args], tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
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
