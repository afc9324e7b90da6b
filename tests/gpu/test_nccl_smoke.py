"""One GPU: a one-process NCCL world made with Planaria's options, its communicators
aborted as a release does and a new world built in the same process, then bf16 training
steps of the engine on it. Runs wherever there is one GPU (docs/gpu.md)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.conftest import gpus_or_skip
from tests.launch import TINY


@pytest.mark.timeout(300)
def test_nccl_abort_rebuild_and_bf16_steps_on_one_gpu():
    gpus_or_skip(1)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("nccl_smoke.py")), str(TINY)],
                          capture_output=True, text=True, timeout=280,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    print(found)  # for docs/gpu.md: `pytest -s` shows it
    assert found["first_world"] and found["rebuilt_world"], found
    # four communicators aborted side by side: about one abort's time (1 s on an H200), not four
    assert found["abort"] == "4 communicator(s) aborted" and found["abort_s"] < 10, found
    assert found["after_abort"] != "completed", found  # the aborted world did no more work
    assert len(found["losses"]) == 3 and all(math.isfinite(loss) for loss in found["losses"]), found
