"""The recovery suite's cases under NCCL (tests/runtime/test_recovery.py runs them on gloo):
a worker SIGKILLed in forward, backward, gradient sync and before the commit, a hung
worker, and a join; float64, each node a GPU of its own, checked against the plain
single-process reference as on CPU. Needs at least two GPUs (four run the CPU suite's
shapes: two pipelines of two stages); skipped, with the reason, elsewhere."""
from __future__ import annotations

import pytest
import torch

from planaria.elastic.local_job import LocalJob
from tests.gpu.conftest import gpus_or_skip
from tests.launch import TINY, reference_run
from tests.runtime.test_recovery import JOB, STEPS, check_against_reference

GPU_JOB = [o for o in JOB if not o.startswith(("comm.backend", "parallel.min_stages"))] + ["comm.backend=nccl"]


@pytest.fixture(scope="module")
def shape():
    """(nodes, overrides): four nodes of two-stage pipelines on four GPUs, else two nodes
    of one-stage pipelines (two replicas of every layer either way)."""
    gpus = gpus_or_skip(2)
    return (4, ["parallel.min_stages=2"]) if gpus >= 4 else (2, ["parallel.min_stages=1"])


@pytest.fixture(scope="module")
def reference(shape):
    return reference_run([*GPU_JOB, *shape[1]])


def run(tmp_path, shape, faults="", actions=None, extra=(), f=1):
    nodes, overrides = shape
    job = LocalJob(TINY, [*GPU_JOB, *overrides, f"fault_tolerance.f={f}", *extra], nodes=nodes, out_dir=tmp_path,
                   faults=faults, spread_gpus=torch.cuda.device_count(), log=lambda message: None)
    result = job.run(300, actions=actions)
    assert result.outcome == "ok", f"{result.outcome}\n{job.logs()}"
    return job, result


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("phase", ["forward@2#2", "backward@2#2", "sync@2", "commit@2"])
def test_a_worker_killed_in_each_phase_under_nccl(phase, shape, reference, tmp_path):
    last = f"node{shape[0] - 1}.0"
    job, result = run(tmp_path, shape, faults=f"{last}:{phase}")
    check_against_reference(tmp_path, reference, job)
    (event,) = result.controller.events
    assert event.failed == (last,) and event.first_iteration == 2


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_hung_worker_under_nccl_leaves_its_peers_alive(shape, reference, tmp_path):
    """SIGSTOP: nothing closes. The survivors' collectives time out (comm.timeout_s) or are
    released by the controller's decision; either way torch's NCCL error handling must
    not take them down (their layers are the job's state)."""
    last = f"node{shape[0] - 1}.0"
    job, result = run(tmp_path, shape, faults=f"{last}:backward@2!hang", extra=["comm.timeout_s=10"])
    check_against_reference(tmp_path, reference, job)
    (event,) = result.controller.events
    assert event.failed == (last,)


@pytest.fixture(scope="module")
def one_stage_reference():
    return reference_run([*GPU_JOB, "parallel.min_stages=1"])


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_node_joins_under_nccl(one_stage_reference, tmp_path):
    """One node trains alone (f = 0); a second, on the other GPU, joins after iteration 1
    and receives its layers from the first."""
    gpus_or_skip(2)
    added = []

    def add_after_iteration_1(job, elapsed):
        log = tmp_path / "commits-node0.0.jsonl"
        if not added and log.exists() and len(log.read_text().splitlines()) >= 2:
            added.append(job.add_node())

    job, result = run(tmp_path, (1, ["parallel.min_stages=1"]), faults="node0.0:commit@2!slow=10",
                      actions=add_after_iteration_1, f=0)
    check_against_reference(tmp_path, one_stage_reference, job)
    (event,) = result.controller.events
    assert event.reason == "join" and event.failed == () and event.transfers > 0
    assert STEPS > event.first_iteration >= 2
