"""One `planaria chaos` run for a benchmark: run it, check that it lost nothing, return its report.

Shared by the benchmarks that read recovery times from the chaos report
(`silent_peer.py`, `network_faults.py`): a run that lost a step or did not finish is an
error, never a figure.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


def checked_chaos_run(args: list[str], out: Path, cache: Path, what: str) -> dict:
    """`args` (the whole command line), with the reference cache `cache`; the report of `out`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(cache))
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    report = json.loads((Path(out) / "report.json").read_text())
    if report["committed_steps_lost"] or report["max_loss_diff"] > 1e-6 or not report["completed"]:
        raise RuntimeError(f"{what} lost something: {report}")
    return report
