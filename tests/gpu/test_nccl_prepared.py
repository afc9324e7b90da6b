"""One GPU: an NCCL epoch's groups connected ahead while the epoch before trains
(`prepared_groups`), then used as the next epoch's (docs/gpu.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.conftest import gpus_or_skip


@pytest.mark.timeout(300)
def test_nccl_groups_connected_ahead_become_the_next_epochs():
    gpus_or_skip(1)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("nccl_prepared.py"))],
                          capture_output=True, text=True, timeout=280,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    print(found)  # for docs/gpu.md: `pytest -s` shows it
    assert found["connected"], found
    assert found["steps"] >= 20 and found["backend"] == found["expected_backend"] and found["value"] == 3.0, found
