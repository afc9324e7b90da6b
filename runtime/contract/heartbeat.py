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

The beat also carries the worker's progress within its steps (`progress`: seconds
stalled outside any collective, and its bound; runtime/worker/progress_watch.py), which
the heartbeat alone cannot show: a worker stuck in a kernel or a deadlock beats on.

The path comes in `PLANARIA_HEARTBEAT_FILE`; a file is a plain, local, dependency-free
channel between two processes of one node (no etcd writes per worker per second).
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Callable

ENV = "PLANARIA_HEARTBEAT_FILE"
EVERY_S = 1.0


class Heartbeat:
    """The beating thread of one worker (`start_beating`)."""

    def __init__(self, path: Path, progress: Callable[[], tuple[float, float]] | None = None):
        """`progress`: (seconds stalled, bound) at each beat, written into the file."""
        self.path, self.progress = path, progress
        self._stop = threading.Event()
        threading.Thread(target=self._beat, daemon=True, name="heartbeat").start()

    def _beat(self) -> None:
        while True:
            if self.progress is None:
                self.path.touch()
            else:
                stalled, bound = self.progress()
                # Whole or not at all: the agent reads it at any moment.
                partial = self.path.with_name(self.path.name + ".partial")
                partial.write_text(json.dumps({"stalled_s": round(stalled, 3), "bound_s": round(bound, 3)}))
                os.replace(partial, self.path)
            if self._stop.wait(EVERY_S):
                return

    def stop(self) -> None:
        """Stop beating and remove the file: the worker is leaving, and the seconds its
        interpreter takes to shut down (its threads stopped first, the beat with them)
        are no freeze. Without a file the agent watches nothing (`silent_for` is None)."""
        self._stop.set()
        self.path.unlink(missing_ok=True)


def start_beating(path: str | Path | None = None,
                  progress: Callable[[], tuple[float, float]] | None = None) -> Heartbeat | None:
    """Touch `path` (default: from the environment) every second from a daemon thread
    until `stop()`, writing `progress` into it when given. None when there is no path
    (no agent watches this process)."""
    path = path or os.environ.get(ENV)
    return Heartbeat(Path(path), progress) if path else None


def silent_for(path: Path, now: float | None = None) -> float | None:
    """Seconds since the last beat; None before the first (the worker is still starting)."""
    try:
        return (now or time.time()) - Path(path).stat().st_mtime
    except FileNotFoundError:
        return None


def stalled(path: Path) -> tuple[float, float] | None:
    """(seconds the worker has been stalled within a step, its bound) as of its last
    beat; None when its beat carries no progress (or none yet)."""
    try:
        beat = json.loads(Path(path).read_text() or "null")
        return (float(beat["stalled_s"]), float(beat["bound_s"])) if isinstance(beat, dict) else None
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
