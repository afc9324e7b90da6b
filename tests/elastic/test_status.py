"""`planaria status` against a live job: the chaos harness's local cluster (real agents on
a real etcd) trains, a node is killed, and the status, read only, shows the epoch and the
plan change and the node go from training to gone; with etcd out of reach it says so."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from planaria.chaos.cluster import LocalCluster
from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.elastic.status import read_status, render
from tests.launch import TINY
from tests.runtime.test_recovery import JOB

pytest.importorskip("pyetcd")


def status_json(cluster: LocalCluster, started: bool = True) -> dict:
    """What a person gets from `planaria status --json` (the command, as they run it).
    Before the first agent has recorded the job it says there is none, and exits 1."""
    out = subprocess.run([sys.executable, "-m", "planaria.cli", "status", "--etcd", cluster.etcd.endpoint,
                          "--run-id", cluster.run_id, "--json"], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ))
    view = json.loads(out.stdout)
    if started:
        assert out.returncode == 0, (out.stderr, view)
    else:
        assert out.returncode == 0 or "no job with run id" in view["error"], (out.stderr, view)
    return view


def wait_for(predicate, what: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"{what} did not happen within {timeout_s:.0f} s")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_status_shows_the_plan_change_and_a_killed_node_gone(tmp_path):
    overrides = [*[o for o in JOB if not o.startswith("train.steps")], "train.steps=100000",
                 "fault_tolerance.f=1", f"output.dir={tmp_path}"]
    cluster = LocalCluster(TINY, overrides, nodes=4, nproc=1, out_dir=tmp_path, run_id="status-test")
    try:
        before = wait_for(lambda: (s := status_json(cluster, started=False))["committed_step"] is not None and s,
                          "the job's first steps")
        assert before["epoch"] == 0 and before["outcome"] is None and before["leader"]
        states = {n["name"]: n["state"] for n in before["nodes"]}
        assert states == {f"node{i}": "training" for i in range(4)}
        assert all(n["renewed_s_ago"] is not None and n["renewed_s_ago"] < 5 for n in before["nodes"])
        assert sorted(s["node"] for p in before["pipelines"] for s in p) == [f"node{i}" for i in range(4)]
        assert before["steps_per_s"] > 0 and before["recoveries"] == []

        cluster.kill_node(3)
        # The leader sees the node gone within a second (its probe); etcd, and so the
        # status, once the node's lease has expired (3 s here).
        after = wait_for(lambda: (s := status_json(cluster))["epoch"] == 1
                         and s["committed_step"] > before["committed_step"]
                         and {n["name"]: n["state"] for n in s["nodes"]}["node3"] == "gone" and s, "the recovery")
        states = {n["name"]: n["state"] for n in after["nodes"]}
        assert states == {"node0": "training", "node1": "training", "node2": "training", "node3": "gone"}
        assert "node3" not in {s["node"] for p in after["pipelines"] for s in p}
        (recovery,) = after["recoveries"]
        assert recovery["reason"] == "failure" and recovery["failed"] == ["node3.0"]
        assert recovery["source"] == "replicas" and recovery["rerun"] == 0
        text = render(read_status(EtcdClient(EtcdSettings(endpoint=cluster.etcd.endpoint)), cluster.run_id))
        from rich.console import Console
        console = Console(width=200, record=True)
        console.print(text)
        shown = console.export_text()
        assert "node3" in shown and "gone" in shown and "failed node3.0" in shown, shown
    finally:
        cluster.close()


def test_status_says_when_etcd_is_out_of_reach(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "planaria.cli", "status", "--etcd", f"127.0.0.1:{port}",
                          "--run-id", "any", "--json"], capture_output=True, text=True, timeout=60)
    view = json.loads(out.stdout)
    assert out.returncode == 1 and view["reachable"] is False and "did not answer" in view["error"]
