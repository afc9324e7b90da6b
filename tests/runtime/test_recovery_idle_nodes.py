"""A job whose nodes no set of pipelines uses all of keeps the rest idle, and after a
failure into another such node count it keeps training with nothing lost.

The model has 3 layers and `parallel.min_stages=3`, so the only template is n0 = 3
stages, as under a memory limit that no deeper pipeline meets (the planner's tests
cover that case, `tests/templates/test_planner.py`). With f = 1, 8 nodes run two
pipelines of 3 and 2 nodes wait; one node of a pipeline is SIGKILLed in the backward
pass of iteration 2: on the 7 survivors an idle node takes its stage (receiving its
layer from the other pipeline's replica), one stays idle, and the job ends with the
losses and final parameters of a single-process float64 run where nothing failed.
"""
from __future__ import annotations

import pytest

from planaria.elastic.local_job import LocalJob
from planaria.runtime.contract.logs import COMMITS, CommitEntry, read_logs
from tests.launch import TINY, assert_final_parameters, reference_run

STEPS = 5
JOB = [
    "model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.vocab_size=64",
    "model.seq_len=8", "data.source=synthetic", f"train.steps={STEPS}", "train.global_batch=4",
    "train.micro_batch=1", "train.dtype=float64", "train.lr=0.01", "train.warmup_steps=1",
    "train.grad_clip=0.5", "train.log_every=1", "comm.backend=gloo", "comm.timeout_s=30",
    "parallel.min_stages=3", "fault_tolerance.f=1",
]


@pytest.mark.slow  # eight worker processes on 2 cores: about a minute
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_idle_nodes_wait_and_a_failure_into_another_unusable_count_loses_nothing(tmp_path):
    reference = reference_run(JOB)
    job = LocalJob(TINY, JOB, nodes=8, out_dir=tmp_path, faults="node1.0:backward@2#1",
                   log=lambda message: None)
    first = job.controller.planner.instantiate(8, node_ids=job.nodes)
    assert [len(p.stages) for p in first.plan.pipelines] == [3, 3]
    assert first.idle_nodes == ("node6", "node7")
    result = job.run(240)
    assert result.outcome == "ok", f"{result.outcome}\n{job.logs()}"

    (event,) = result.controller.events
    assert event.failed == ("node1.0",) and event.plan_shape == (3, 3)
    assert len(event.joined) == 1 and event.joined[0] in ("node6.0", "node7.0")  # one idle node took its place
    assert event.restored is None and event.snapshot is None and event.rerun == 0

    logs = read_logs(tmp_path, COMMITS, CommitEntry)
    idle_throughout = sorted(worker for worker, entries in logs.items() if not entries)
    assert len(idle_throughout) <= 1  # the idle node that stayed idle never trained
    done = set()
    for worker, entries in logs.items():
        if not entries:
            continue
        iterations = [e.step for e in entries]
        assert iterations == list(range(iterations[0], iterations[0] + len(iterations))), (worker, iterations)
        for entry in entries:  # the same losses as the run where nothing failed
            assert abs(entry.loss - reference.losses[entry.step]) < 1e-9, (worker, entry)
        done.update(iterations)
    assert done == set(range(STEPS))
    assert_final_parameters(tmp_path / "final", reference)
    assert not list(tmp_path.glob("checkpoint*")), "no checkpoint may be involved"
