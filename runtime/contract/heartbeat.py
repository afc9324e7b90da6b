"""A worker's heartbeat: proof that its process runs at all, for its agent to read.

A worker that is alive but frozen (SIGSTOP, a machine swapping itself to death, a
process stuck in the kernel) keeps its sockets open: no peer sees it die, its peers'
collectives only time out (`comm.timeout_s`), and it never reports a status, so the
leader would wait for it until its status timeout. Its threads are frozen with it,
though. A daemon thread touches a file every second; the agent, on the same node, kills
a worker whose file has not changed for `comm.heartbeat_timeout_s` (default: the
collective timeout), which turns a frozen worker into a dead one in that time. A worker
that is merely busy (a long step, a collective waiting on a peer) keeps beating: its
thread needs nothing but the interpreter.

The path comes in `PLANARIA_HEARTBEAT_FILE`; a file is a plain, local, dependency-free
channel between two processes of one node (no etcd writes per worker per second).
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

ENV = "PLANARIA_HEARTBEAT_FILE"
EVERY_S = 1.0


class Heartbeat:
    """The beating thread of one worker (`start_beating`)."""

    def __init__(self, path: Path):
        self.path = path
        self._stop = threading.Event()
        threading.Thread(target=self._beat, daemon=True, name="heartbeat").start()

    def _beat(self) -> None:
        while True:
            self.path.touch()
            if self._stop.wait(EVERY_S):
                return

    def stop(self) -> None:
        """Stop beating and remove the file: the worker is leaving, and the seconds its
        interpreter takes to shut down (its threads stopped first, the beat with them)
        are no freeze. Without a file the agent watches nothing (`silent_for` is None)."""
        self._stop.set()
        self.path.unlink(missing_ok=True)


def start_beating(path: str | Path | None = None) -> Heartbeat | None:
    """Touch `path` (default: from the environment) every second from a daemon thread
    until `stop()`. None when there is no path (no agent watches this process)."""
    path = path or os.environ.get(ENV)
    return Heartbeat(Path(path)) if path else None


def silent_for(path: Path, now: float | None = None) -> float | None:
    """Seconds since the last beat; None before the first (the worker is still starting)."""
    try:
        return (now or time.time()) - Path(path).stat().st_mtime
    except FileNotFoundError:
        return None
