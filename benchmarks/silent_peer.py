"""Recovery from peers that go silent without closing anything: released survivors
against survivors left to their collective timeout, side by side.

    python benchmarks/silent_peer.py [--repeats 3] [--timeout-s 300] [--json out.json]
    python benchmarks/silent_peer.py --overhead [--rounds 6] [--steps 60]

Each run is `planaria chaos configs/tiny.yaml --nodes 4 parallel.min_stages=2
train.steps=20` with one fault at step 5, on this machine's agents and etcd:

  hang-worker  node1's worker SIGSTOPped: it neither dies nor answers, its sockets stay open;
  freeze-node  node1 SIGSTOPped whole (agent and worker): its lease lapses, its sockets
               stay open and silent, nobody can kill it (a node cut off the network).

and each is run two ways, with the same collective timeout (`comm.timeout_s`, --timeout-s):

  planaria  the defaults: the agent kills a worker whose heartbeat stopped for
            `comm.heartbeat_timeout_s` (5 s), and survivors release their blocked
            collectives when the leader declares the epoch failed (`comm.release`);
  before    what the job did before those existed: `comm.heartbeat_timeout_s=0` (the
            collective timeout) and `comm.release=false`: survivors wait for their
            collectives to time out.

Reported per run, from the chaos report: detection (fault to the leader's decision),
release (the decision to the last survivor leaving the failed epoch), and total (fault
to the first step committed after it); medians over repeats, and the ratio before /
planaria of the totals. Every run must lose nothing (the harness's verdict).

`--overhead`: what the mechanism costs a job without faults. The same 4-worker job
(`LocalJob`, 2 pipelines of 2 stages) runs `--rounds` times with `comm.release=true` and
as often with false, alternating; each run's median step time (its workers' commit logs,
the first 5 steps left out) is taken, and the ratio of the medians reported.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from chaos_verdict import checked_chaos_run

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny.yaml"
JOB = ["parallel.min_stages=2", "train.steps=20"]
FAULTS = {"hang-worker": "hang-worker@5:target=1.0", "freeze-node": "freeze-node@5:target=1"}
MODES = {"planaria": [], "before": ["comm.heartbeat_timeout_s=0", "comm.release=false"]}


def one_run(fault: str, mode: str, timeout_s: float, out: Path, cache: Path) -> dict:
    args = [sys.executable, "-m", "planaria.cli", "chaos", str(CONFIG), "--nodes", "4", "--fault", FAULTS[fault],
            *JOB, f"comm.timeout_s={timeout_s:g}", *MODES[mode], "--out", str(out),
            "--timeout", str(int(3 * timeout_s + 300))]
    (recovery,) = checked_chaos_run(args, out, cache, f"{fault} ({mode})")["recoveries"]
    return {"detect_s": recovery["detect_s"], "release_s": recovery["release_s"], "total_s": recovery["total_s"]}


def step_time_s(release: bool, steps: int, out: Path) -> float:
    """The median step time of one fault-free run (every worker's commits, steps 5 on)."""
    from planaria.elastic.local_job import LocalJob
    from planaria.runtime.contract.logs import COMMITS, CommitEntry, read_logs

    overrides = [*JOB[:1], f"train.steps={steps}", "fault_tolerance.f=1", "data.source=synthetic",
                 "train.log_every=100000", "output.save_final=false", f"comm.release={str(release).lower()}"]
    job = LocalJob(CONFIG, overrides, nodes=4, out_dir=out, log=lambda message: None)
    try:
        result = job.run(timeout_s=600)
    finally:
        job.close()
    if result.outcome != "ok":
        raise RuntimeError(f"the fault-free run failed: {result.outcome}")
    times = [e.step_time_s for entries in read_logs(out, COMMITS, CommitEntry).values()
             for e in entries if e.step >= 5 and e.step_time_s is not None]
    return statistics.median(times)


def overhead(rounds: int, steps: int) -> dict:
    medians: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="planaria-overhead-") as tmp:
        for r in range(rounds):
            for release in ((True, False) if r % 2 == 0 else (False, True)):
                medians[release].append(step_time_s(release, steps, Path(tmp) / f"{r}-{release}"))
                print(f"round {r + 1}: release={str(release).lower():5s} median step "
                      f"{medians[release][-1] * 1000:.2f} ms", flush=True)
    on, off = statistics.median(medians[True]), statistics.median(medians[False])
    print(f"\nmedian of {rounds} runs' median step time: release on {on * 1000:.2f} ms, "
          f"off {off * 1000:.2f} ms, on / off {on / off:.3f}")
    return {"release_on_ms": on * 1000, "release_off_ms": off * 1000, "ratio": on / off,
            "runs_ms": {str(k).lower(): [v * 1000 for v in vs] for k, vs in medians.items()}}


def median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="comm.timeout_s for both ways (the 'before' runs take about this long)")
    parser.add_argument("--faults", default="hang-worker,freeze-node")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--overhead", action="store_true", help="fault-free step time, release on against off")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    if args.overhead:
        result = overhead(args.rounds, args.steps)
        if args.json:
            from planaria.chaos.report import write_json_atomically

            write_json_atomically(args.json, result)
        return
    faults = [f.strip() for f in args.faults.split(",")]
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="planaria-silent-") as tmp:
        cache = Path(tmp) / "cache"
        for repeat in range(args.repeats):
            for fault in faults:
                for mode in MODES:  # side by side, alternating
                    result = one_run(fault, mode, args.timeout_s, Path(tmp) / f"{fault}-{mode}-{repeat}", cache)
                    runs.setdefault((fault, mode), []).append(result)
                    print(f"{fault:12s} {mode:9s} run {repeat + 1}: " + ", ".join(
                        f"{k} {v:.2f} s" if v is not None else f"{k} -" for k, v in result.items()), flush=True)
    summary = {}
    print(f"\nmedians of {args.repeats}, comm.timeout_s = {args.timeout_s:g}")
    print(f"{'fault':12s} {'way':9s} {'detection':>10s} {'release':>9s} {'total':>9s}")
    for fault in faults:
        for mode in MODES:
            row = {key: median(runs[(fault, mode)], key) for key in ("detect_s", "release_s", "total_s")}
            summary.setdefault(fault, {})[mode] = row
            print(f"{fault:12s} {mode:9s} " + " ".join(
                f"{row[k]:>8.2f} s" if row[k] is not None else f"{'-':>10s}" for k in ("detect_s", "release_s", "total_s")))
        ratio = summary[fault]["before"]["total_s"] / summary[fault]["planaria"]["total_s"]
        summary[fault]["ratio"] = ratio
        print(f"{fault:12s} before / planaria: {ratio:.1f}x")
    if args.json:
        from planaria.chaos.report import write_json_atomically

        write_json_atomically(args.json, {"timeout_s": args.timeout_s, "repeats": args.repeats,
                                          "summary": summary, "runs": {f"{k[0]}/{k[1]}": v for k, v in runs.items()}})


if __name__ == "__main__":
    main()
