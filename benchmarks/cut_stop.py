"""How long a network cut stops a job: the longest gap between two commits, before and
after cuts were seen by overlapping probes within about 2 s (issue 45).

    python benchmarks/cut_stop.py [--before REF] [--repeats 1] [--json out.json]

Two trees side by side in one run: the working tree ("after") and `--before` (a commit,
checked out into a temporary git worktree and imported from there, as in
`benchmarks/join.py`). On each, chaos runs of `configs/tiny.yaml` on six simulated hosts
(`--hosts --etcd-members 3 --fault-tolerance 1 parallel.min_stages=2`, three pipelines
of two stages), one fault at step 5:

  isolate-node   node1's packets vanish for 12 s, etcd's included;
  partition      nodes 4 and 5 and the other four cannot reach each other for 20 s, both
                 sides reaching etcd;
  slow-link      node1's link at 1 Mbit/s for 10 s: slower steps, and no cut may be seen
                 (a false cut would end an epoch: the reconfigurations column says).

Reported per run: the job's longest gap between two commits (each step's first commit,
from the workers' commit logs), the fault's detection (the chaos report's), the
reconfigurations the leader made, and whether the run lost nothing (0 committed steps
lost, loss diff 0). The goal: an isolated node and a partition stop the job at most 3 s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from join import _import_root, before_tree

REPO = Path(__file__).resolve().parent.parent
BEFORE = "83fcd91"
"""The last commit whose probes saw a cut after a 6 s window of one-second rounds."""
CLUSTER = ["--nodes", "6", "--hosts", "--etcd-members", "3", "--fault-tolerance", "1", "parallel.min_stages=2",
           "train.steps=150"]
FAULTS = {
    "isolate-node": "isolate-node@5:target=1:for=12",
    "partition": "partition@5:target=4+5:for=20",
    "slow-link": "slow-link@5:target=1:for=10",
}


def chaos_run(tree: Path | None, kind: str, out: Path, timeout_s: float) -> dict:
    """One chaos run of `kind` on `tree` (None: the working tree); its figures."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PLANARIA_FAULTS", None)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(_import_root(tree)), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "planaria.cli", "chaos", str(REPO / "configs/tiny.yaml"), *CLUSTER,
           "--fault", FAULTS[kind], "--out", str(out), "--timeout", str(int(timeout_s))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out.parent, timeout=timeout_s + 60)
    report_path = out / "report.json"
    if proc.returncode != 0 or not report_path.exists():
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    report = json.loads(report_path.read_text())
    (recovery,) = report["recoveries"]
    agents = "".join(p.read_text() for p in (out / "run" / "logs").glob("agent-*.log"))
    return {"tree": "after" if tree is None else "before", "kind": kind, "longest_gap_s": longest_gap(out / "run"),
            "detect_s": recovery["detect_s"], "reconfigurations": agents.count("controller: epoch "),
            "lost": report["committed_steps_lost"], "loss_diff": report["max_loss_diff"],
            "completed": report["completed"]}


def longest_gap(run: Path) -> float:
    """The longest time between two consecutive steps' first commits (any worker's)."""
    first: dict[int, float] = {}
    for path in run.glob("commits-*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            first[entry["step"]] = min(first.get(entry["step"], entry["time"]), entry["time"])
    times = sorted(first.values())
    return max(b - a for a, b in zip(times, times[1:]))


def table(rows: list[dict]) -> str:
    lines = ["| tree | fault | longest gap between commits (s) | detected (s) | reconfigurations | lost | loss diff |",
             "|---|---|---:|---:|---:|---:|---:|"]
    f = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['tree']} | `{FAULTS[r['kind']]}` | {f(r['longest_gap_s'])} | {f(r['detect_s'])} | "
                     f"{r['reconfigurations']} | {r['lost']} | {r['loss_diff']} |")
    return "\n".join(lines)


def medians(rows: list[dict]) -> str:
    lines = ["| fault | before: longest gap (median, s) | after | after / before |", "|---|---:|---:|---:|"]
    for kind in FAULTS:
        gaps = {tree: [r["longest_gap_s"] for r in rows if r["kind"] == kind and r["tree"] == tree]
                for tree in ("before", "after")}
        if gaps["before"] and gaps["after"]:
            before, after = statistics.median(gaps["before"]), statistics.median(gaps["after"])
            lines.append(f"| `{FAULTS[kind]}` | {before:.2f} | {after:.2f} | {after / before:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=BEFORE, help=f"the commit to compare with (default {BEFORE})")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--kinds", nargs="+", choices=list(FAULTS), default=list(FAULTS))
    parser.add_argument("--timeout", type=float, default=600.0, help="per chaos run (s)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("the simulated hosts (--hosts) need root: network namespaces and veth links")
    rows = []
    with tempfile.TemporaryDirectory(prefix="planaria-cut-") as tmp, before_tree(args.before, Path(tmp)) as tree:
        for repeat in range(args.repeats):
            for kind in args.kinds:  # interleaved: the machine's drift spreads over both trees
                for side in (tree, None):
                    out = Path(tmp) / f"{'before' if side else 'after'}-{kind}-{repeat}"
                    rows.append(chaos_run(side, kind, out, args.timeout))
                    print(table([rows[-1]]).splitlines()[-1], flush=True)
    print(table(rows))
    print()
    print(medians(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
