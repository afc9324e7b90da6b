"""What peer snapshots cost a fault-free elastic job: the same job with them and without.

    python benchmarks/snapshot_overhead.py [--steps N] [--warmup W] [--repeats R]
                                           [--every K ...] [--json out.json]

The job is benchmarks/recovery.py's (8 layers, d_model 256, 4 nodes of one CPU worker,
two pipelines of two stages, f=1), run as an elastic `LocalJob` with
`checkpoint.memory_every` = 0 (off) and each K given (default 1, the default interval),
in alternating order, R times. A step's time is the time between two consecutive
commits of worker node0.0 (its commit log): the whole loop, the snapshot's copy to host
memory after the step and the wait for the exchange before the next commit included,
which the engine's own step_time_s leaves out. Each run drops its first W steps and
takes the median of the rest; the table gives the median over repeats and the overhead
against snapshots off, each repeat's pair measured back to back, and how often a round
was actually taken (node0.0's count at the end of the epoch: a round due while some
worker's exchange is still going on is skipped, so the interval a job gets can be
longer than the one it asks for).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

from recovery import CONFIG, JOB, NODES, PLANARIA

from planaria.chaos.report import write_json_atomically
from planaria.runtime.contract.logs import COMMITS, CommitEntry, read_logs


def step_time(every: int, steps: int, warmup: int, out: Path) -> tuple[float, int]:
    """(the median time between node0.0's commits in a fault-free run, the peer snapshot
    rounds node0.0 took)."""
    from planaria.elastic.local_job import LocalJob

    job = LocalJob(CONFIG, [*JOB, *PLANARIA, f"train.steps={steps}", f"checkpoint.memory_every={every}"],
                   nodes=NODES, out_dir=out, log=lambda message: None)
    result = job.run(900)
    if result.outcome != "ok":
        raise RuntimeError(f"memory_every={every}: {result.outcome}\n{job.logs()}")
    times = [e.time for e in read_logs(out, COMMITS, CommitEntry)["node0.0"]][warmup:]
    taken = sum(int(n) for n in re.findall(r"peer snapshots of epoch \d+: (\d+) round",
                                                (out / "logs" / "node0.0.log").read_text()))
    return statistics.median(b - a for a, b in zip(times, times[1:])), taken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--every", type=int, action="append", help="snapshot intervals to measure (default 1)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    intervals = [0, *(args.every or [1])]
    runs: dict[int, list[float]] = {k: [] for k in intervals}
    rounds: dict[int, list[int]] = {k: [] for k in intervals}
    with tempfile.TemporaryDirectory(prefix="planaria-snapshots-") as tmp:
        for r in range(args.repeats):
            order = intervals if r % 2 == 0 else intervals[::-1]
            for every in order:
                step, taken = step_time(every, args.steps, args.warmup, Path(tmp) / f"{r}-{every}")
                runs[every].append(step)
                rounds[every].append(taken)
                print(f"repeat {r + 1} memory_every={every}: {step * 1e3:.1f} ms a step, "
                      f"{taken} snapshot round(s) in {args.steps} steps", flush=True)
    base = statistics.median(runs[0])
    print("\n| checkpoint.memory_every | step (ms, median) | overhead vs off (median of paired repeats) "
          "| steps per round taken (median) |")
    print("|---:|---:|---:|---:|")
    for every in intervals:
        paired = statistics.median(t / b - 1 for t, b in zip(runs[every], runs[0]))
        label = "0 (off)" if every == 0 else str(every)
        taken = statistics.median(rounds[every])
        print(f"| {label} | {statistics.median(runs[every]) * 1e3:.1f} | "
              f"{'-' if every == 0 else f'{paired:+.1%}'} | {f'{args.steps / taken:.1f}' if taken else '-'} |")
    print(f"\n(off: {base * 1e3:.1f} ms a step)")
    if args.json:
        write_json_atomically(Path(args.json), {"step_s": {str(k): v for k, v in runs.items()},
                                                "rounds": {str(k): v for k, v in rounds.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
