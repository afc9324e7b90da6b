"""The TensorBoard writer's exactly-once rule, in one process with real files: writers of
successive epochs, a rollback that commits steps again, a stale writer, a held lock, a
record cut short by a kill, steps no writer wrote, a new job in a used directory. The
event files are read back with TensorBoard's own reader. (A chaos run with a rollback and
writers on several nodes: tests/chaos/test_chaos_tensorboard.py.)"""
from __future__ import annotations

import fcntl
import os
import re
from collections import Counter
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.util import tensor_util

from planaria.runtime.contract.logs import COMMITS, CommitEntry, append, log_path
from planaria.runtime.worker.metrics_writer import LOCK, RunWriter
from planaria.runtime.worker.step_metrics import EVENT, EpochChange, StepMetrics, steps_from_logs


def events(directory: Path) -> list[tuple[int, dict]]:
    """(step, {tag: value}) of every event with values, in every event file of the directory."""
    found = []
    for path in sorted(p for p in directory.iterdir() if "tfevents" in p.name):
        for event in EventFileLoader(str(path)).Load():
            if event.summary.value:
                found.append((event.step, {v.tag: tensor_util.make_ndarray(v.tensor).item()
                                           for v in event.summary.value}))
    return found


def losses(directory: Path) -> dict[int, list[float]]:
    found: dict[int, list[float]] = {}
    for step, values in events(directory):
        if "train/loss" in values:
            found.setdefault(step, []).append(values["train/loss"])
    return found


def metrics(step: int, loss: float | None = None) -> StepMetrics:
    return StepMetrics(step=step, loss=loss if loss is not None else 10.0 - step, grad_norm=1.0, lr=0.1,
                       time=1000.0 + step, tokens_per_s=512.0)


def writer(directory, epoch: int, *, job="job-a", fresh=None, history=None, log=None) -> RunWriter:
    return RunWriter(directory, job=job, epoch=epoch, fresh=epoch == 0 if fresh is None else fresh,
                     history=history, log=log or (lambda message: None))


def test_writers_of_successive_epochs_write_each_step_once_through_a_rollback(tmp_path):
    first = writer(tmp_path, 0)
    for step in range(6):
        first.commit(metrics(step))
    first.close()
    # Epoch 1 went back to the snapshot of step 2: steps 3-5 are committed again. Their
    # values are equal under the exactness rule; they are marked here to show they are not
    # the ones written.
    second = writer(tmp_path, 1)
    change = EpochChange(epoch=1, step=3, reason="failure", workers=2, time=1010.0, source="memory",
                         rerun=3, restored_step=2, failed=("node0.0",))
    second.commit(metrics(3, loss=-1.0), change)
    for step in range(4, 9):
        second.commit(metrics(step, loss=-1.0 if step < 6 else None))
    second.close()
    assert losses(tmp_path) == {step: [10.0 - step] for step in range(9)}
    (epoch_event,) = [values for _, values in events(tmp_path) if "elastic/epoch" in values]
    assert epoch_event["elastic/epoch"] == 1 and epoch_event["elastic/rerun_steps"] == 3
    assert epoch_event["elastic/pause_s"] == pytest.approx(1010.0 - 1005.0)  # from step 5's commit
    assert b"restored from the peer snapshots of step 2" in epoch_event[EVENT]
    assert len([p for p in tmp_path.iterdir() if "tfevents" in p.name]) == 2  # one file per writer


def test_a_writer_of_an_epoch_the_job_left_writes_nothing_more(tmp_path):
    said = []
    old = writer(tmp_path, 0, log=said.append)
    old.commit(metrics(0))
    new = writer(tmp_path, 1)
    new.commit(metrics(1))
    old.commit(metrics(1, loss=-1.0))  # (it could not commit: its peers left; here it tries)
    old.commit(metrics(2, loss=-1.0))
    late = writer(tmp_path, 0, fresh=False)  # an epoch-0 rank 0 that starts only now
    late.commit(metrics(2, loss=-1.0))
    new.commit(metrics(2))
    for w in (old, new, late):
        w.close()
    assert losses(tmp_path) == {0: [10.0], 1: [9.0], 2: [8.0]}
    assert old.stopped and late.stopped and new.stopped is None
    assert any("epoch 1" in line and "took over" in line for line in said), said


def test_a_held_lock_defers_the_writes_and_a_cut_record_is_written_again(tmp_path):
    first = writer(tmp_path, 0)
    holder = os.open(tmp_path / LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a frozen process holding it
    first.commit(metrics(0))
    first.commit(metrics(1))
    assert first.pending_steps == [0, 1] and losses(tmp_path) == {}
    fcntl.flock(holder, fcntl.LOCK_UN)
    os.close(holder)
    first.commit(metrics(2))
    first.close()
    assert losses(tmp_path) == {0: [10.0], 1: [9.0], 2: [8.0]}
    # Killed while writing step 2: its record is cut short, and readers skip it.
    (path,) = [p for p in tmp_path.iterdir() if "tfevents" in p.name]
    path.write_bytes(path.read_bytes()[:-5])
    assert sorted(losses(tmp_path)) == [0, 1]
    second = writer(tmp_path, 1)
    second.commit(metrics(2))
    second.close()
    assert losses(tmp_path) == {0: [10.0], 1: [9.0], 2: [8.0]}


def test_steps_no_writer_wrote_come_from_the_commit_logs(tmp_path):
    runs, out = tmp_path / "tb", tmp_path / "out"
    out.mkdir()
    first = writer(runs, 0)
    for step in range(3):
        first.commit(metrics(step))
    first.close()
    # Steps 3 and 4 were committed (every worker logs its commits) and never written: the
    # writer died. Two workers logged them; the first record in time is taken.
    for worker, delay in (("node1.0", 0.0), ("node2.0", 0.5)):
        with open(log_path(out, COMMITS, worker), "a") as f:
            for step in (3, 4):
                append(f, CommitEntry(step=step, epoch=0, time=1000.0 + step + delay, loss=10.0 - step,
                                      grad_norm=1.0, step_time_s=0.5 if step == 3 else None,
                                      rolled_forward=step == 4))
    asked = []

    def history(after, before, after_epoch):
        asked.append((after, before, after_epoch))
        steps, missing = steps_from_logs(out, after, before, tokens=512, lr=lambda step: 0.1)
        assert missing == []
        return steps, []
    second = writer(runs, 1, history=history)
    second.commit(metrics(5), EpochChange(epoch=1, step=5, reason="failure", workers=2, time=1005.0))
    second.close()
    assert asked == [(2, 5, -1)]
    assert losses(runs) == {step: [10.0 - step] for step in range(6)}
    by_step = dict(events(runs))
    assert by_step[3]["train/tokens_per_s"] == 1024.0 and "train/tokens_per_s" not in by_step[4]
    (change,) = [values for _, values in events(runs) if "elastic/epoch" in values]
    assert change["elastic/pause_s"] == pytest.approx(1005.0 - 1004.0)


def test_a_new_job_from_step_0_starts_the_directory_anew_and_a_resumed_one_goes_on(tmp_path):
    old = writer(tmp_path, 0, job="first run")
    for step in range(4):
        old.commit(metrics(step, loss=1.0))
    old.close()
    resumed = writer(tmp_path, 0, job="resumed from its checkpoint of step 1", fresh=False)
    for step in range(2, 6):
        resumed.commit(metrics(step))
    resumed.close()
    assert losses(tmp_path) == {0: [1.0], 1: [1.0], 2: [1.0], 3: [1.0], 4: [6.0], 5: [5.0]}
    again = writer(tmp_path, 0, job="a new run", fresh=True)
    again.commit(metrics(0))
    again.close()
    assert losses(tmp_path) == {0: [10.0]}


def test_an_epoch_change_is_written_once_per_job(tmp_path):
    start = EpochChange(epoch=0, step=0, reason="start", workers=4, time=999.0)
    a = writer(tmp_path, 0)
    a.commit(metrics(0), start)
    a.close()
    b = writer(tmp_path, 1, history=lambda after, before, after_epoch: ([], [start]))  # asked again: not rewritten
    b.commit(metrics(1), EpochChange(epoch=1, step=1, reason="join", workers=6, time=1002.0, joined=("node4.0",)))
    b.close()
    changes = Counter(values["elastic/epoch"] for _, values in events(tmp_path) if "elastic/epoch" in values)
    assert changes == {0: 1, 1: 1}


def test_wandb_offline_runs_one_run_across_writers(tmp_path, monkeypatch):
    """Two writers of one job (epochs 0 and 1, as on two nodes) log to the same W&B run id,
    offline; W&B gets what the event files get. (Skipped where wandb is not installed: it
    is optional, and the suite does not install it.)"""
    pytest.importorskip("wandb")
    from planaria.runtime.config.sections import WandbConfig
    from planaria.runtime.worker.metrics_writer import WandbRun, job_key

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = WandbConfig(enabled=True, mode="offline", project="planaria-test")
    for epoch, steps in ((0, range(3)), (1, range(1, 5))):
        run = WandbRun(cfg, job="job-a", directory=tmp_path / "wandb")
        w = RunWriter(tmp_path / "tb", job="job-a", epoch=epoch, fresh=epoch == 0, wandb=run,
                      log=lambda message: pytest.fail(message))  # nothing to complain of
        for step in steps:
            w.commit(metrics(step))
        w.close()
        run.close()
    runs = sorted((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    # (W&B names an offline run's directory by the second it began, adding "-1" to the
    # second of two begun in the same second)
    assert len(runs) == 2 and all(re.search(f"-planaria-{job_key('job-a')}(-[0-9]+)?$", r.name) for r in runs), runs
    assert all(next(r.glob("run-*.wandb")).stat().st_size > 0 for r in runs)
    assert losses(tmp_path / "tb") == {step: [10.0 - step] for step in range(5)}
