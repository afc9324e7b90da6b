"""Running `planaria chaos` from a test, and what every faulted run must show: the job
completed, no committed step lost, no checkpoint read, losses as without faults. Shared by
the chaos tests that run real clusters (test_chaos.py, test_chaos_hosts.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.launch import TINY


def chaos(args: list[str], tmp_path, cache, timeout: float = 600,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(cache), **(env or {}))
    return subprocess.run([sys.executable, "-m", "planaria.cli", "chaos", str(TINY), *args,
                           "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=timeout, env=env)


def assert_nothing_lost(proc, tmp_path, steps: int) -> dict:
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["completed"] and report["steps_committed"] == steps, report
    assert report["committed_steps_lost"] == 0 and report["checkpoint_loads"] == 0, report
    assert report["max_loss_diff"] < 1e-6, report
    return report
