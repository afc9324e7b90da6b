"""The report of `planner_scale.py`: the machine's load, the git state, quantiles,
tables, plan summaries and cProfile (the CPU's name and busy time: `machine_load`).

A module of the benchmark script, imported from the benchmarks folder as
`cost_model_accuracy.py` imports `step_time.py`.
"""
from __future__ import annotations

import contextlib
import cProfile
import io
import math
import pstats
import subprocess
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "n/a"


def git_state() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        def git(*cmd: str) -> str:
            return subprocess.run(["git", *cmd], check=False, cwd=REPO, capture_output=True,
                                  text=True, timeout=10).stdout

        head = git("rev-parse", "--short", "HEAD").strip()
        dirty = git("status", "--porcelain", "--", "templates", "runtime").split("\n")
        changed = sorted(line[3:] for line in dirty if line.strip())
        return head + (f" + uncommitted changes in {', '.join(changed)}" if changed else " (clean)")
    return "unknown"


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def shape_summary(sizes: list[int]) -> str:
    """'2×8 + 168×6': pipelines × stages."""
    return " + ".join(f"{c}×{s}" for s, c in sorted(Counter(sizes).items(), reverse=True))


def split_summary(sizes: list[int], counts: list[int]) -> str:
    """'8-stage: 2×9 | 6-stage: 150×9, 18×8': per template, pipelines × microbatches."""
    by_size: dict[int, Counter] = {}
    for s, m in zip(sizes, counts):
        by_size.setdefault(s, Counter())[m] += 1
    return " | ".join(
        f"{s}-stage: " + ", ".join(f"{c}×{m}" for m, c in sorted(cnt.items(), reverse=True))
        for s, cnt in sorted(by_size.items(), reverse=True))


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def table(rows: list[list[str]], header: list[str], right: set[int] | None = None) -> str:
    right = right if right is not None else set(range(1, len(header)))
    cells = [header, *rows]
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                              for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def profile_call(label: str, call, top: int = 12) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    call()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.strip_dirs()
    out.write(f"cProfile of {label}, by cumulative time:\n")
    stats.sort_stats("cumulative").print_stats(top)
    out.write(f"cProfile of {label}, by own time:\n")
    stats.sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())
