"""Leaving with notice (a preemption announced): real worker processes, a real store.

Four nodes, f = 1: pipelines [node0, node1] and [node2, node3], so node1 and node3 hold
every replica of the last stage's layers. Both are told they will be gone (`notify`)
once step 2 is committed, with peer snapshots off and no checkpoint: nothing but the
leaving nodes themselves can give the job those layers back. They must stop at a step
boundary with the others (the next epoch planned while they all trained, and entered at
the stop), hand the layers over, and exit; the job trains on, every step
committed once, with the losses of a run that lost nothing. A notice too short to act
on (0.1 s) takes the failure path instead, and loses nothing either.
"""
from __future__ import annotations

import pytest

from tests.runtime.test_recovery import STEPS, check_against_reference, commits, reference, run_job  # noqa: F401

NO_SAFETY_NET = ["checkpoint.memory_every=0"]  # and no checkpoint: the job has none
PACED = "node0.0:step@*!slow=0.2"


def notify_after(step: int, nodes: list[str], notice_s: float):
    """An `actions` callable: the notices once node0 has committed `step`."""
    sent = []

    def actions(job, elapsed):
        done = [e.step for e in commits(job.out_dir).get("node0.0", [])]
        if not sent and done and done[-1] >= step:
            sent.append(done[-1])
            for node in nodes:
                job.notify(node, notice_s)
    return actions, sent


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_every_holder_of_a_stage_leaves_with_notice_and_no_step_is_lost(reference, tmp_path):
    actions, sent = notify_after(2, ["node1", "node3"], notice_s=12)  # within the leave window: at once
    # Paced (a straggler that never faults), so that the stop comes before the last step
    # on a fast machine too: a stop at the last step would leave nothing to switch to.
    job, result = run_job(tmp_path, nodes=4, extra=NO_SAFETY_NET, actions=actions, faults=PACED)
    (event,) = result.controller.events
    assert event.reason == "leave" and event.left == ("node1", "node3"), job.logs()
    assert event.failed == () and event.source == "replicas" and event.rerun == 0
    assert event.handed_off > 0 and sent[0] < event.first_iteration < STEPS
    logs = check_against_reference(tmp_path, reference, job)
    for worker in ("node0.0", "node2.0"):  # trained every step once, nothing again
        assert [e.step for e in logs[worker]] == list(range(STEPS))
    for worker in ("node1.0", "node3.0"):  # left at the boundary, well before their deadline
        assert job.processes[(worker[:-2], 0)].returncode == 0, job.logs()
        assert [e.step for e in logs[worker]] == list(range(event.first_iteration))
    assert "handed" in job.logs() and "leaves the job, as its notice asked" in job.logs()
    # Planned while they trained: every worker went on to the next epoch at the stop,
    # without waiting for the controller's word after it.
    assert job.logs().count("prepared by the controller before the stop") == 4, job.logs()


@pytest.mark.slow  # the default suite's time: the controller's refusal is in test_controller_notices.py
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_notice_too_short_to_act_on_takes_the_failure_path_and_loses_nothing(reference, tmp_path):
    actions, sent = notify_after(2, ["node3"], notice_s=0.1)
    job, result = run_job(tmp_path, nodes=4, actions=actions)
    (event,) = result.controller.events
    assert event.reason == "failure" and event.failed == ("node3.0",), job.logs()
    assert event.source == "replicas" and event.rerun == 0
    check_against_reference(tmp_path, reference, job)
