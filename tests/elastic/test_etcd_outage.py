"""etcd lost entirely, twice, under a job of four agents on a 3-member etcd cluster.

Every member is SIGKILLed (a crash: the data stays) and later started again:

1. with no failure meanwhile: the workers train on through the outage, and when etcd is
   back membership is as it was: no reconfiguration;
2. with a node SIGKILLed meanwhile: the survivors wait for etcd, saying so; when it is
   back the leader reconfigures once, and no step is lost or repeated (the losses and
   final parameters are the fault-free run's).
"""
from __future__ import annotations

import time

import pytest

from planaria.elastic.etcd_server import EmbeddedEtcdCluster
from tests.elastic.test_agents import OVERRIDES, Job
from tests.launch import reference_run
from tests.runtime.test_recovery import JOB, check_against_reference


STEPS = 90
OUTAGE_S = 6.0
"""Longer than the agents' lease TTL (3 s): a lease that could lapse would."""
SETTLE_S = 3 + 2 + 1
"""The leader's wait after etcd is back (lease TTL + 2 s), and a second more."""
SLOW = {"node0": {"PLANARIA_FAULTS": "node0.0:step@*!slow=0.2"}}
"""Steps of a quarter of a second, so that the job outlasts both outages."""


def commits(job: Job, worker: str) -> int:
    log = job.tmp_path / f"commits-{worker}.jsonl"
    return len(log.read_text().splitlines()) if log.exists() else 0


def agent_log(job: Job, node: str) -> str:
    return (job.tmp_path / "logs" / f"agent-{node}.log").read_text()


def wait_until(condition, timeout_s: float, what: str, job: Job) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}\n{job.logs()}"
        time.sleep(0.05)


def reconfigurations(job: Job) -> list[str]:
    return [line for line in job.logs(tail=10**7).splitlines() if "controller: epoch" in line]


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_job_rides_out_etcd_outages_with_and_without_a_failure(tmp_path):
    reference = reference_run([*JOB, f"train.steps={STEPS}"])
    cluster = EmbeddedEtcdCluster(3, log_dir=tmp_path).start()
    job = Job(cluster, tmp_path, 4, [*OVERRIDES, f"train.steps={STEPS}"], run_id="outage", env=SLOW)
    try:
        leader = job.leader()
        job.wait_for_commits(3)

        # 1. No failure while etcd is away: training goes on; when etcd is back (and the
        #    leader has looked at the membership again), nothing has reconfigured.
        cluster.kill()
        before = commits(job, "node0.0")
        time.sleep(OUTAGE_S)
        trained = commits(job, "node0.0") - before
        assert "is unreachable" in agent_log(job, leader), job.logs()
        cluster.start()
        wait_until(lambda: all("answers again" in agent_log(job, n) for n in job.agents), 30,
                   "an agent did not see etcd come back", job)
        time.sleep(SETTLE_S)
        after_first = reconfigurations(job)
        assert commits(job, "node0.0") < STEPS, "the job ended before the second outage; raise STEPS"

        # 2. A node dies while etcd is away: the job waits for etcd, then recovers in place.
        victim = next(n for n in ("node3", "node2") if n != leader)
        cluster.kill()
        job.kill_node(victim)
        time.sleep(OUTAGE_S)
        stalled = commits(job, "node0.0")
        time.sleep(1.0)
        assert commits(job, "node0.0") == stalled, "a step was committed without the dead node"
        cluster.start()
        codes = job.wait()
    finally:
        job.close()
        cluster.stop()
    logs = job.logs(tail=10**7)
    assert trained >= 3, f"training stopped while etcd was away ({trained} steps in {OUTAGE_S} s)\n{logs}"
    assert after_first == [], f"etcd's return caused a reconfiguration: {after_first}"
    assert all(code == 0 for node, code in codes.items() if node != victim), f"{codes}\n{job.logs()}"
    # Every node says it, once: its workers reach etcd through their agent's relay, which
    # waits the outage out for them (docs/control_plane.md, "the node relay").
    assert all("is unreachable" in agent_log(job, node) for node in job.agents if node != victim), logs
    # One reconfiguration in all, for the node that died.
    (reconfigured,) = reconfigurations(job)
    assert f"failed ['{victim}.0']" in reconfigured, reconfigured
    check_against_reference(tmp_path, reference, job, steps=STEPS)
