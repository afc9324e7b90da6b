"""Where a node process's CPU goes, by kind of thread: the harness's account of what
limits it on this machine.

A simulated node is some thirty threads (its agent, lease, watch streams, relay calls,
and per worker its main thread, epoch watcher and rendezvous watch). `name_threads`
gives each thread started after it a native name (Linux's 15-character `comm`) that is
its kind: its Python name without the node, worker or epoch in it
("epoch-watcher-3" -> "epoch-watcher", "worker-node5.2" -> "worker", "Thread-9
(channel_spin)" -> "channel_spin"). `ThreadCpu` samples /proc's per-thread CPU every 20
seconds and when asked (a sample of 2,000 threads costs some 0.1 CPU-s) and sums it by kind; what the
samples do not account for (threads that ended between two, /proc's rounding of each
thread's time to clock ticks) is "(unattributed)", the rest of the process's CPU.
Written here because neither py-spy (which
samples stacks, and cannot tell a thread blocked in a lock from one that runs) nor
/proc by itself (which names every Python thread after its process) says it.
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
import time
from collections import Counter

_PR_SET_NAME = 15
_SUFFIX = re.compile(r"(?:[-_. :]*(?:node)?[\d.]+)+$")


def kind_of(name: str) -> str:
    """A thread's kind from its Python name (module docstring)."""
    inner = re.search(r"\((.+)\)$", name)
    if inner:
        name = inner.group(1)
    kind = _SUFFIX.sub("", name) or name
    return kind[:15]


def name_threads() -> None:
    """Each thread started from now on names itself natively after its kind."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return

    def hook(*_args) -> None:
        sys.setprofile(None)  # once, at the thread's start: no cost after it
        libc.prctl(_PR_SET_NAME, kind_of(threading.current_thread().name).encode(), 0, 0, 0)
    threading.setprofile(hook)


_TICK = os.sysconf("SC_CLK_TCK")


def stat_of(path: str) -> tuple[str, float] | None:
    """A process's or thread's name and CPU seconds (user + system) from its /proc stat
    (one read, no file object); None once it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        text = os.read(fd, 1024)
    except OSError:  # the thread ended between the open and the read (ESRCH)
        return None
    finally:
        os.close(fd)
    close = text.rindex(b")")
    fields = text[close + 2:].split(b" ", 13)
    return text[text.index(b"(") + 1:close].decode(), (int(fields[11]) + int(fields[12])) / _TICK


def cpu_of(path: str) -> float:
    """CPU seconds of a process or thread from its /proc stat (0 once it is gone)."""
    stat = stat_of(path)
    return 0.0 if stat is None else stat[1]


class ThreadCpu:
    """This process's CPU by kind of thread, sampled every `period_s` (module docstring)."""

    def __init__(self, period_s: float = 20.0):
        self.period_s = period_s
        self._seen: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True, name="thread-cpu").start()

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - an account is not worth a node process's thread dying
                pass
            time.sleep(self.period_s)

    def sample(self) -> None:
        for tid in os.listdir("/proc/self/task"):
            stat = stat_of(f"/proc/self/task/{tid}/stat")
            if stat is not None:
                with self._lock:
                    self._seen[tid] = stat

    def totals(self) -> dict[str, float]:
        """CPU seconds so far by kind, and "(unattributed)" for the rest of the process's."""
        self.sample()
        totals: Counter = Counter()
        with self._lock:
            for kind, cpu in self._seen.values():
                totals[kind] += cpu
        totals["(unattributed)"] = max(0.0, time.process_time() - sum(totals.values()))
        return dict(totals)


def difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """CPU seconds by kind spent between two `totals`."""
    return {k: round(v - before.get(k, 0.0), 2) for k, v in after.items() if v - before.get(k, 0.0) >= 0.005}
