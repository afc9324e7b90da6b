"""The recovery of tests/runtime/test_recovery.py with the job's store in a real etcd:
the controller's keys, the workers' statuses and every epoch's process-group
rendezvous go through `EtcdStore`, with no TCPStore anywhere."""
from __future__ import annotations

import pytest

from planaria.elastic.local_job import LocalJob
from tests.launch import TINY, reference_run
from tests.runtime.test_recovery import JOB, check_against_reference


@pytest.mark.slow  # agents over etcd recover in the default suite: tests/elastic/test_agents.py, test_launcher.py
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_rank_killed_recovers_in_place_over_etcd(tmp_path):
    reference = reference_run(JOB)
    job = LocalJob(TINY, [*JOB, "fault_tolerance.f=1"], nodes=4, out_dir=tmp_path,
                   faults="node3.0:backward@2#2", store="etcd", log=lambda message: None)
    assert job.store_url.startswith("etcd://127.0.0.1:")
    result = job.run(250)
    assert result.outcome == "ok", job.logs()
    check_against_reference(tmp_path, reference, job)
    (event,) = result.controller.events
    assert event.failed == ("node3.0",) and event.first_iteration == 2


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_losing_one_of_three_etcd_members_changes_nothing(tmp_path):
    """A 3-member etcd cluster; one member is SIGKILLed while the job trains. The clients
    fail over; no reconfiguration happens and the losses are the reference's."""
    reference = reference_run(JOB)
    # node0 dawdles 3 s in iteration 2 (a straggler, nothing fails) so that the member
    # dies while the job trains: its ~50 ms iterations could all end before the poll.
    job = LocalJob(TINY, [*JOB, "fault_tolerance.f=1"], nodes=4, out_dir=tmp_path,
                   store="etcd", etcd_members=3, faults="node0.0:commit@2!slow=3",
                   log=lambda message: None)
    killed = []

    def kill_a_member(job, elapsed):
        log = tmp_path / "commits-node0.0.jsonl"
        if not killed and log.exists() and len(log.read_text().splitlines()) >= 2:
            member = job.etcd.members[1]
            member.process.kill()
            member.process.wait()
            killed.append(member.name)

    result = job.run(250, actions=kill_a_member)
    assert result.outcome == "ok", job.logs()
    assert killed and result.controller.events == []
    check_against_reference(tmp_path, reference, job)
