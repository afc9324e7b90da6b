"""One GPU: a one-process NCCL world made with Planaria's options, its communicators
aborted as a release does (all at once, which the aborts' spans and one group's abort
alone tell from one after another) and a new world built in the same process, then
bf16 training steps of the engine on it. Runs wherever there is one GPU (docs/gpu.md)."""
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
    assert found["first_world"] and found["rebuilt_world"] and found["probe_ok"], found
    assert found["abort"] == "4 communicator(s) aborted" and len(found["abort_spans"]) == 4, found
    # One NCCL abort takes about a second whatever the group (docs/gpu.md): one after
    # another, four take four times one group's abort alone; side by side, about one.
    spans, one = found["abort_spans"], found["one_abort_s"]
    # Side by side, every abort began before the first one ended; one after another, each
    # begins after the one before it ended. (Aborts shorter than a thread's start cannot
    # be seen to overlap, and then it matters little: the time below covers them.)
    longest = max(end - began for began, end in spans)
    assert max(began for began, _ in spans) < min(end for _, end in spans) or longest < 0.1, found
    assert found["abort_s"] < len(spans) / 2 * one + 0.5, found
    assert found["after_abort"] != "completed", found  # the aborted world did no more work
    assert len(found["losses"]) == 3 and all(math.isfinite(loss) for loss in found["losses"]), found
