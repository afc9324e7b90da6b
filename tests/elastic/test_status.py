"""`planaria status`: the helpers that read it as a person does (the command, `--json`),
and etcd out of reach. The live job it watches across a kill, a spare taking the dead
node's place, is `tests/elastic/test_spares.py`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from planaria.chaos.cluster import LocalCluster


def status_json(cluster: LocalCluster, started: bool = True) -> dict:
    """What a person gets from `planaria status --json` (the command, as they run it).
    Before the first agent has recorded the job it says there is none, and exits 1."""
    out = subprocess.run([sys.executable, "-m", "planaria.cli", "status", "--etcd", cluster.etcd.endpoint,
                          "--run-id", cluster.run_id, "--json"], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ))
    view = json.loads(out.stdout)
    if started:
        assert out.returncode == 0, (out.stderr, view)
    else:
        assert out.returncode == 0 or "no job with run id" in view["error"], (out.stderr, view)
    return view


def wait_for(predicate, what: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"{what} did not happen within {timeout_s:.0f} s")


def test_status_says_when_etcd_is_out_of_reach(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "planaria.cli", "status", "--etcd", f"127.0.0.1:{port}",
                          "--run-id", "any", "--json"], capture_output=True, text=True, timeout=60)
    view = json.loads(out.stdout)
    assert out.returncode == 1 and view["reachable"] is False and "did not answer" in view["error"]
