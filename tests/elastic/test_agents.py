"""Agents on etcd: one process per node, leases for membership, a leader that runs the
controller. The leader's own node dies (agent and worker SIGKILLed together, as a machine
vanishes); another agent takes over the leadership and the job recovers in place."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from tests.launch import TINY, reference_run
from tests.runtime.test_recovery import JOB, check_against_reference

pytest.importorskip("pyetcd")


class Job:
    def __init__(self, etcd, tmp_path, nodes: int, overrides: list[str], run_id: str):
        self.overrides = [*overrides, f"output.dir={tmp_path}"]
        self.agents = {}
        (tmp_path / "logs").mkdir(parents=True, exist_ok=True)
        for i in range(nodes):
            node = f"node{i}"
            log = open(tmp_path / "logs" / f"agent-{node}.log", "w")
            self.agents[node] = subprocess.Popen(
                [sys.executable, "-m", "planaria.elastic.agent", "--node", node, "--etcd", etcd.endpoint,
                 "--run-id", run_id, "--nnodes", str(nodes), "--lease-ttl", "3", str(TINY),
                 *self.overrides],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                start_new_session=True)  # a node: the agent and its workers, killed together
        self.client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint))
        self.prefix = f"/planaria/{run_id}/"

    def leader(self, timeout=60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value, _ = self.client.get(self.prefix + "leader")
            if value:
                return value.decode()
            time.sleep(0.1)
        raise AssertionError("no leader elected")

    def kill_node(self, node: str) -> None:
        os.killpg(self.agents[node].pid, signal.SIGKILL)

    def wait(self, timeout=240) -> dict[str, int]:
        return {node: agent.wait(timeout=timeout) for node, agent in self.agents.items()}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_leader_node_killed_another_agent_leads_and_the_job_recovers(etcd, tmp_path):
    overrides = [*JOB, "parallel.fault_tolerance=1", "train.steps=6"]
    reference = reference_run(JOB)
    job = Job(etcd, tmp_path, 4, overrides, run_id="leader-dies")
    try:
        leader = job.leader()
        log = tmp_path / "commits-node0.0.jsonl"
        deadline = time.monotonic() + 120
        while not (log.exists() and len(log.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.05)
        job.kill_node(leader)
        codes = job.wait()
    finally:
        for agent in job.agents.values():
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert all(code == 0 for node, code in codes.items() if node != leader), f"{codes}\n{logs}"
    assert job.leader() != leader
    check_against_reference(tmp_path, reference, job=type("J", (), {"logs": lambda self: logs})())
