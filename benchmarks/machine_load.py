"""How busy a shared machine is while a benchmark measures on it: the CPU time other
processes take, a wait for a quiet moment before a run, and the CPU's name for the
report. Shared by step_time.py, planner_scale.py and the cost-model benchmarks; Linux's
/proc, read defensively (without it the shares are nan and nothing waits)."""
from __future__ import annotations

import os
import time
from pathlib import Path


def busy_seconds() -> float:
    """CPU seconds all of the machine's CPUs have spent busy since boot (from /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return float("nan")
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_quiet(threshold: float, limit_s: float) -> float:
    """Wait (at most limit_s) until other processes use under `threshold` of the CPUs over
    a one-second sample; return the seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        busy0, t0 = busy_seconds(), time.perf_counter()
        time.sleep(1.0)
        share = (busy_seconds() - busy0) / ((time.perf_counter() - t0) * (os.cpu_count() or 1))
        if not share > threshold:  # also stops on nan (no /proc/stat)
            break
    return time.perf_counter() - start


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"
