"""What a node's agent costs to start: its imports' time and its peak memory, against the
same agent importing torch as it did when its modules pulled torch in.

    python benchmarks/agent_start.py [--rounds 10] [--json out.json]

Each round starts two fresh interpreters, one after the other, in alternating order:
  planaria   `import planaria.elastic.agent` (what `python -m planaria.elastic.agent` loads
             before it reads its arguments);
  baseline   `import torch.distributed` first, then the same: the agent as it was, when
             its controller, config and etcd store imported torch (a lower bound: it
             imported the kernels and Triton too, 295 MiB at its peak).
Reported: the median wall time and peak resident memory of each (the child's own
`ru_maxrss` from wait4), and the ratios baseline / planaria. A node's agent starts at the
job's start and whenever a node joins; on a machine where the job's workers start at the
same moment, its imports compete with theirs for the cores.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planaria.chaos.report import write_json_atomically  # noqa: E402

CASES = {
    "planaria": "import planaria.elastic.agent",
    "baseline": "import torch.distributed; import planaria.elastic.agent",
}


def start_once(code: str) -> tuple[float, float]:
    """(seconds, peak MiB) of a fresh interpreter running `code`."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, OMP_NUM_THREADS="1"))
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"`python -c {code!r}` exited {proc.returncode}")
    return elapsed, usage.ru_maxrss / 1024  # Linux reports KiB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in CASES}
    for round_ in range(args.rounds):
        order = list(CASES) if round_ % 2 == 0 else list(reversed(CASES))
        for name in order:
            samples[name].append(start_once(CASES[name]))
    result = {}
    for name, runs in samples.items():
        result[name] = {"median_s": statistics.median(s for s, _ in runs),
                        "median_peak_mib": statistics.median(m for _, m in runs), "runs": runs}
    ratio_s = result["baseline"]["median_s"] / result["planaria"]["median_s"]
    ratio_mem = result["baseline"]["median_peak_mib"] / result["planaria"]["median_peak_mib"]
    print(f"{'':10} {'median start':>13} {'median peak':>12}   ({args.rounds} rounds, alternating)")
    for name in CASES:
        print(f"{name:10} {result[name]['median_s']:>11.2f} s {result[name]['median_peak_mib']:>8.0f} MiB")
    print(f"baseline / planaria: {ratio_s:.1f}x the time, {ratio_mem:.1f}x the memory")
    if args.json:
        write_json_atomically(Path(args.json), {"rounds": args.rounds, "cases": result,
                                                "ratio_time": ratio_s, "ratio_memory": ratio_mem})
    return 0


if __name__ == "__main__":
    sys.exit(main())
