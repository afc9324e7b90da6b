"""What a node's join costs the job: the pause between two commits around it, before and
after joins were planned only once the joiner announced itself (issue 45).

    python benchmarks/join.py [--before REF] [--slow-start 30] [--nodes 4] [--repeats 3] [--json out.json]

Two trees side by side in one run: the working tree ("after") and `--before` (a commit,
checked out into a temporary git worktree and imported from there: the script checks
that the chaos run's modules came from it). On each, two chaos runs of
`configs/tiny.yaml` on `--nodes` nodes with `add-node@5`:

  join        the new node's worker starts as fast as it can (on CPU: Python, torch,
              the dataset: a few seconds);
  slow join   its start-up takes `--slow-start` seconds more, as a GPU worker's device
              context, NCCL and compilation do: the joiner's worker process sleeps that
              long as its interpreter starts (a `sitecustomize` of this script's, which
              both trees run alike; `PLANARIA_FAULTS`'s `start` phase does the same
              in the trees that have it).

Reported from each run's chaos report (`planaria.chaos.report`): the pause (the last
commit before the join's epoch to its first commit), the longest gap between two
commits around the join (the pause, or one of the join's epoch's next five steps, which
the switch can still slow; from the run's commit logs, so that both trees are measured
alike), the run's own step time away from faults, the switch (the pause less that step),
the layer copy and the rendezvous of the join's epoch; and whether the run lost nothing
(0 committed steps lost, loss diff 0). The goal: a longest gap of about one step plus
the copy, the slow joiner's too (`over`: the longest gap less the step and the copy,
per run). With `--repeats`, the trees' runs
alternate, and a last table gives each tree's and case's medians.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from planaria.chaos.report import longest_commit_gap

REPO = Path(__file__).resolve().parent.parent
BEFORE = "4e972f9"
"""The last commit at which a worker counted as ready to join as soon as its process was alive."""
CASES = ("join", "slow join")


SLOW_START = """\
# The join benchmark's slow joiner: its worker process sleeps as its interpreter starts.
import os, time
if os.environ.get("PLANARIA_NODE") == os.environ.get("JOIN_BENCHMARK_SLOW_NODE") and "PLANARIA_HEARTBEAT_FILE" in os.environ:
    time.sleep(float(os.environ["JOIN_BENCHMARK_SLOW_START_S"]))
"""


def chaos_run(tree: Path | None, case: str, args, out: Path) -> dict:
    """One chaos run with a join, on `tree` (None: the working tree); its report's figures."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PLANARIA_FAULTS", None)
    paths = [] if tree is None else [str(_import_root(tree))]
    if case == "slow join":
        slow = out.parent / "slow-start"
        slow.mkdir(exist_ok=True)
        (slow / "sitecustomize.py").write_text(SLOW_START)
        paths.append(str(slow))
        # add-node starts the next index; only its workers (they have a heartbeat file) sleep
        env.update(JOIN_BENCHMARK_SLOW_NODE=f"node{args.nodes}", JOIN_BENCHMARK_SLOW_START_S=f"{args.slow_start:g}")
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    # Long enough for the slow joiner to be planned in before the end (steps of 0.05 to 0.1 s).
    steps = 120 + (int(2.5 * args.slow_start / 0.05) if case == "slow join" else 0)
    cmd = [sys.executable, "-m", "planaria.cli", "chaos", str(REPO / "configs/tiny.yaml"), "--nodes", str(args.nodes),
           "--fault-tolerance", "1", "--fault", "add-node@5", "--out", str(out), "parallel.min_stages=2",
           f"train.steps={steps}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out.parent, timeout=args.timeout)
    report_path = out / "report.json"
    if proc.returncode != 0 or not report_path.exists():
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    report = json.loads(report_path.read_text())
    join = next(r for r in report["recoveries"] if r["fault"].startswith("add-node"))
    row = {"tree": "after" if tree is None else "before", "case": case, "pause_s": join["pause_s"],
           "gap_s": longest_gap(out, join["epoch"]),
            "own_step_s": report.get("own_step_s"), "switch_s": join["switch_s"],
            "transfer_s": join["transfer_s"], "rendezvous_s": join["rendezvous_s"], "reason": join["reason"],
            "lost": report["committed_steps_lost"], "loss_diff": report["max_loss_diff"]}
    row["over_s"] = over_s(row)
    return row


def longest_gap(out: Path, epoch: int) -> float | None:
    """The job's longest gap between two commits around the join (`Recovery.longest_gap_s`:
    the pause or one of the join's epoch's next steps), from the run's commit logs, so
    that a tree whose report does not have it is measured alike."""
    first: dict[tuple[int, int], float] = {}
    for path in (out / "run").glob("commits-*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if not entry["rolled_forward"]:
                key = (entry["step"], entry["epoch"])
                first[key] = min(first.get(key, entry["time"]), entry["time"])
    commits = sorted((t, e) for (_, e), t in first.items())
    resumed = next((t for t, e in commits if e >= epoch), None)
    return longest_commit_gap(commits, epoch, resumed)


def _import_root(tree: Path) -> Path:
    """A directory whose `planaria` is `tree`'s: each of its subpackages linked to the
    folder `tree`'s pyproject.toml maps it to (`planaria.cli` is `chaos/cli`), so that
    none of them is found in the installed working tree instead."""
    root = tree.parent / "import-root"
    package = root / "planaria"
    if not package.exists():
        package.mkdir(parents=True)
        folders = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
        for name, folder in folders.items():
            parts = name.split(".")
            if len(parts) == 2 and parts[0] == "planaria":
                (package / parts[1]).symlink_to((tree / folder).resolve(), target_is_directory=True)
    return root


def check_imports_from(tree: Path) -> None:
    """Refuse to measure the wrong code: `planaria` (its command line too) must come from `tree`."""
    env = dict(os.environ, PYTHONPATH=str(_import_root(tree)))
    for module in ("planaria.elastic.controller", "planaria.cli"):
        found = subprocess.run([sys.executable, "-c", f"import {module} as m; print(m.__file__)"],
                               capture_output=True, text=True, env=env, cwd=tree.parent, check=True).stdout.strip()
        if not Path(found).resolve().is_relative_to(tree.resolve()):
            raise RuntimeError(f"the 'before' run would import {module} from {found}, not from {tree}; "
                               "run this script from an environment where planaria is installed editable")


@contextlib.contextmanager
def before_tree(ref: str, tmp: Path):
    """`ref` checked out into a git worktree under `tmp`, checked to be what a run with
    `_import_root` imports, and removed afterwards."""
    tree = tmp / "before"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), ref],
                   check=True, capture_output=True)
    try:
        check_imports_from(tree)
        yield tree
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)


FIGURES = ("pause_s", "gap_s", "own_step_s", "switch_s", "transfer_s", "rendezvous_s", "over_s")


def over_s(row: dict) -> float | None:
    """How far the longest gap between commits around the join is over one step plus the
    copy (the goal), in one run."""
    if None in (row["gap_s"], row["own_step_s"], row["transfer_s"]):
        return None
    return row["gap_s"] - row["own_step_s"] - row["transfer_s"]


def table(rows: list[dict]) -> str:
    lines = ["| tree | case | runs | pause (s) | longest gap (s) | step (s) | switch (s) | copy (s) | rendezvous (s) "
             "| over (s) | lost | loss diff |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f = lambda v: "" if v is None else f"{v:.3f}"  # noqa: E731
    for r in rows:
        figures = " | ".join(f(r[k]) for k in FIGURES)
        lines.append(f"| {r['tree']} | {r['case']} | {r.get('runs', 1)} | {figures} | {r['lost']} | {r['loss_diff']} |")
    return "\n".join(lines)


def medians(rows: list[dict]) -> list[dict]:
    """One row per tree and case: the median of each figure over its runs, the worst
    of what was lost."""
    found = []
    for key in dict.fromkeys((r["tree"], r["case"]) for r in rows):
        runs = [r for r in rows if (r["tree"], r["case"]) == key]
        row = {"tree": key[0], "case": key[1], "runs": len(runs), "lost": max(r["lost"] for r in runs),
               "loss_diff": max(r["loss_diff"] for r in runs)}
        for k in FIGURES:
            values = [r[k] for r in runs if r[k] is not None]
            row[k] = statistics.median(values) if values else None
        found.append(row)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=BEFORE, help=f"the commit to compare with (default {BEFORE})")
    parser.add_argument("--slow-start", type=float, default=30.0, help="the slow joiner's extra start-up (s)")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--timeout", type=float, default=900.0, help="per chaos run (s)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each case on each tree")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="planaria-join-") as tmp, before_tree(args.before, Path(tmp)) as tree:
        for repeat in range(args.repeats):
            for case in args.cases:
                for side in (tree, None):
                    out = Path(tmp) / f"{'before' if side else 'after'}-{case.replace(' ', '-')}-{repeat}"
                    rows.append(chaos_run(side, case, args, out))
                    print(f"{rows[-1]['tree']} {case}: " + table([rows[-1]]).splitlines()[-1], flush=True)
    print(table(rows))
    if args.repeats > 1:
        print("\nmedians\n" + table(medians(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
