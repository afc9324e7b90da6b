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


def start_beating(path: str | Path | None = None) -> threading.Event | None:
    """Touch `path` (default: from the environment) every second from a daemon thread;
    the returned event stops it. None when there is no path."""
    path = path or os.environ.get(ENV)
    if not path:
        return None
    path = Path(path)
    stop = threading.Event()

    def beat() -> None:
        while True:
            path.touch()
            if stop.wait(EVERY_S):
                return

    threading.Thread(target=beat, daemon=True, name="heartbeat").start()
    return stop


def silent_for(path: Path, now: float | None = None) -> float | None:
    """Seconds since the last beat; None before the first (the worker is still starting)."""
    try:
        return (now or time.time()) - Path(path).stat().st_mtime
    except FileNotFoundError:
        return None
