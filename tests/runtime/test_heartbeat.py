"""The heartbeat a worker's agent reads: it beats while the process runs, and stops when
the process is frozen (SIGSTOP), which is what the agent acts on."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from planaria.runtime.contract.heartbeat import EVERY_S, silent_for, start_beating


def test_a_beating_file_stays_fresh_and_goes_when_the_worker_leaves(tmp_path, monkeypatch):
    path = tmp_path / "beat"
    assert silent_for(path) is None  # not started yet
    heartbeat = start_beating(path)
    time.sleep(2.5 * EVERY_S)
    assert silent_for(path) < 1.5 * EVERY_S
    heartbeat.stop()  # a worker leaving the job: not watched any more
    time.sleep(1.5 * EVERY_S)
    assert silent_for(path) is None and not path.exists()
    monkeypatch.delenv("PLANARIA_HEARTBEAT_FILE", raising=False)
    assert start_beating() is None  # not under an agent: nothing to beat for


@pytest.mark.timeout(60)
def test_a_frozen_process_stops_beating(tmp_path):
    path = tmp_path / "beat"
    code = ("import time; from planaria.runtime.contract.heartbeat import start_beating; "
            f"start_beating({str(path)!r}); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.time() + 30
        while silent_for(path) is None and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(2 * EVERY_S)
        assert silent_for(path) < 1.5 * EVERY_S, "a running process beats"
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(3 * EVERY_S)
        assert silent_for(path) > 2 * EVERY_S, "a frozen one does not"
    finally:
        proc.kill()
        proc.wait()
