"""`planaria chaos` on a corpus made by `planaria data prepare`, with a validation loss:
a node killed and one added while it trains; nothing committed is lost, and every step's
loss and every validation loss equal those of the same job without faults."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.launch import TINY


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_chaos_on_prepared_shards_with_validation_loss(tmp_path):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = tmp_path / "corpus"
    prepare = subprocess.run(
        [sys.executable, "-m", "planaria.cli", "data", "prepare", str(stdlib / "json"), str(stdlib / "email"),
         "--out", str(corpus), "--train-bpe", "512", "--shard-tokens", "20000", "--val-fraction", "0.1", "--quiet"],
        capture_output=True, text=True, timeout=120)
    assert prepare.returncode == 0, prepare.stderr
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert len(manifest["splits"]["train"]) > 3 and manifest["splits"]["val"]

    env = dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "cache"))
    steps = 24
    proc = subprocess.run(
        [sys.executable, "-m", "planaria.cli", "chaos", str(TINY), "--nodes", "4", "--fault-tolerance", "1",
         "--fault", "kill-node@4", "--fault", "add-node@7", f"data.source={corpus}", "model.vocab_size=512",
         f"train.steps={steps}", "eval.every=3", "eval.batches=2", "parallel.min_stages=2",
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=560, env=env)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["completed"] and report["steps_committed"] == steps, report
    assert report["committed_steps_lost"] == 0 and report["checkpoint_loads"] == 0, report
    assert report["max_loss_diff"] < 1e-6, report  # float32: re-plans do not change the sums
    evaluated = sorted(int(k) for k in report["series"]["val_losses"])
    due = sorted({*range(2, steps, 3), steps - 1})  # every third step, and the last
    assert evaluated == sorted(int(k) for k in report["series"]["reference_val_losses"]) == due
    assert report["max_val_loss_diff"] < 1e-6, report
    assert [r["fault"].split("@")[0] for r in report["recoveries"]] == ["kill-node", "add-node"]
