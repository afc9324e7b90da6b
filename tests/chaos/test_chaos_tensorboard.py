"""`planaria chaos` writes the faulty run's TensorBoard events (`<out>/tensorboard`), each
committed step exactly once, through a recovery that moves the writer to another node
and goes back to a checkpoint (more failures than replicas): read back with
TensorBoard's own reader, every step is there once, with the loss and validation loss the
workers committed, and the recovery is there as an epoch change."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.util import tensor_util

from planaria.chaos.report import read_commits, read_evals
from tests.launch import TINY

STEPS = 14


def read_events(directory) -> list[tuple[str, int, dict]]:
    """(file name, step, {tag: value}) of every event with values in the directory."""
    found = []
    for path in sorted(p for p in directory.iterdir() if "tfevents" in p.name):
        for event in EventFileLoader(str(path)).Load():
            if event.summary.value:
                found.append((path.name, event.step, {v.tag: tensor_util.make_ndarray(v.tensor).item()
                                                      for v in event.summary.value}))
    return found


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_each_step_is_written_once_through_a_node_loss_beyond_the_replicas(tmp_path):
    """4 nodes, two pipelines of two stages, f = 1, no peer snapshots, a checkpoint every 6
    steps. At step 9, node0 (rank 0: the writer) and node2 are killed together: every
    replica of the first stage's layers is gone, and the job goes back to the checkpoint of
    step 5 (3 steps before the kills: written by then), training steps 6 and on again on
    the two nodes left, one of which now writes."""
    env = dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "cache"))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "planaria.cli", "chaos", str(TINY), "--nodes", "4", "--fault-tolerance", "1",
         "--fault", "kill-node@9:target=0", "--fault", "kill-node@9:target=2", "parallel.min_stages=2",
         f"train.steps={STEPS}", "checkpoint.every=6", "checkpoint.memory_every=0", "eval.every=4",
         "eval.batches=1", "data.source=synthetic", "--out", str(out)],
        capture_output=True, text=True, timeout=560, env=env)
    assert (out / "report.json").exists(), proc.stdout[-6000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["completed"] and report["steps_committed"] == STEPS, proc.stdout[-6000:] + proc.stderr[-3000:]
    restores = [r for r in report["recoveries"] if r["source"] == "disk"]
    assert restores and restores[0]["rerun"] >= 1, report["recoveries"]
    recovery = restores[0]
    assert f"tensorboard: {out / 'tensorboard'}" in proc.stdout

    found = read_events(out / "tensorboard")
    steps = [(step, values) for _, step, values in found if "train/loss" in values]
    assert Counter(step for step, _ in steps) == Counter(range(STEPS)), sorted(s for s, _ in steps)
    # The loss of each step is the one every worker committed (equal on each, in float32).
    commits = read_commits(out / "run")
    for step, values in steps:
        committed = {e.loss for entries in commits.values() for e in entries if e.step == step}
        assert committed == {values["train/loss"]}, (step, committed, values)
        assert values["train/loss"] == report["series"]["losses"][str(step)]
    evaluated = {e.step: e.val_loss for entries in read_evals(out / "run").values() for e in entries}
    assert {step: values["val/loss"] for step, values in steps if "val/loss" in values} == evaluated
    assert sorted(evaluated) == [3, 7, 11, 13]

    changes = [(name, values) for name, _, values in found if "elastic/epoch" in values]
    assert Counter(v["elastic/epoch"] for _, v in changes) == Counter(range(len(changes))), changes
    restore = [(name, v) for name, v in changes if b"checkpoint" in v["elastic/event"]]
    assert len(restore) == 1, changes
    name, values = restore[0]
    assert values["elastic/rerun_steps"] == recovery["rerun"] and values["elastic/pause_s"] > 0, values
    said = b" ".join(v["elastic/event"] for _, v in changes)
    assert b"node0.0" in said and b"node2.0" in said, said  # (one epoch change, or two if seen apart)
    # The writer moved: the files of the first epoch and of the restore are two processes'.
    # (epoch 0's by its suffix: files begun in the same second sort by process id)
    first = next(n for n, _, v in found if "train/loss" in v and n.endswith("-e0"))
    pid = re.compile(r"\.(\d+)\.\d+\.planaria-")  # events.out.tfevents.<time>.<host>.<pid>.<n>.planaria-...
    assert pid.search(first)[1] != pid.search(name)[1], (first, name)
