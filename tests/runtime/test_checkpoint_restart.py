"""The non-elastic path, as torchrun users run today: periodic checkpoints, and a job
whose worker is SIGKILLed is restarted whole by torchrun and resumes from its newest
checkpoint, re-running the steps since. It must still train exactly like the reference."""
from __future__ import annotations

import pytest

from planaria.runtime.contract.checkpoint_layout import complete_checkpoints
from planaria.runtime.contract.logs import COMMITS, CommitEntry, read_logs
from planaria.runtime.state.checkpoints import read_layer
from tests.launch import assert_final_parameters, read_metrics, reference_run, torchrun_train
from tests.runtime.test_recovery import JOB, STEPS


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_torchrun_restart_resumes_from_the_newest_checkpoint(tmp_path):
    reference = reference_run(JOB)
    overrides = [*JOB, "parallel.pp=2", "checkpoint.every=2", "checkpoint.keep=1"]
    proc = torchrun_train(2, overrides, tmp_path, extra_args=["--max-restarts=1"],
                          env={"PLANARIA_FAULTS": "rank1:backward@5#2"})
    assert "resumed from the checkpoint of iteration 3" in proc.stdout, proc.stdout[-3000:]
    steps = [m["step"] for m in read_metrics(tmp_path)]
    assert steps == [0, 1, 2, 3, 4, 4, 5]  # 4 was committed after the checkpoint: lost, run again
    for m in read_metrics(tmp_path):
        assert abs(m["loss"] - reference.losses[m["step"]]) < 1e-9
    # keep=1: only the newest complete checkpoint is left, with optimizer state in it.
    ((iteration, path),) = complete_checkpoints(tmp_path / "checkpoints")
    assert iteration == 3 and any(k.startswith("exp_avg/") for k in read_layer(path, 0, 0))
    assert_final_parameters(tmp_path / "final", reference)
    assert len(reference.losses) == STEPS


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_elastic_job_run_again_after_losing_every_node_resumes_from_its_checkpoint(tmp_path):
    """Every node of an elastic job dies in iteration 7: the job fails. The same command run
    again goes on from the newest checkpoint (of iteration 5), not from scratch, and
    trains exactly like the reference. (Before, it started over, and a later loss of
    every replica restored a checkpoint of the previous run.)"""
    from planaria.elastic.local_job import LocalJob
    from tests.launch import TINY

    overrides = [*JOB, "train.steps=9", "checkpoint.every=3", "fault_tolerance.f=1"]
    reference = reference_run(overrides)
    every_node = ",".join(f"node{i}.0:forward@7" for i in range(4))
    lost = LocalJob(TINY, overrides, nodes=4, out_dir=tmp_path, faults=every_node, log=lambda m: None)
    assert lost.run(200).outcome.startswith("failed")
    assert [k for k, _ in complete_checkpoints(tmp_path / "checkpoints")][-1] == 5

    rerun = LocalJob(TINY, [*overrides, f"checkpoint.dir={tmp_path / 'checkpoints'}"], nodes=4,
                     out_dir=tmp_path / "rerun", log=lambda m: None)
    result = rerun.run(200)
    assert result.outcome == "ok", rerun.logs()
    commits = read_logs(tmp_path / "rerun", COMMITS, CommitEntry)["node0.0"]
    assert [c.step for c in commits] == [6, 7, 8]
    for c in commits:
        assert abs(c.loss - reference.losses[c.step]) < 1e-9
    assert_final_parameters(tmp_path / "rerun" / "final", reference)
