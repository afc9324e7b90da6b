"""What each network fault costs a job, beside a node that vanishes, on simulated hosts.

    python benchmarks/network_faults.py [--repeats 2] [--json out.json]

Each run is `planaria chaos configs/tiny.yaml --nodes 6 --hosts --etcd-members 3
--fault-tolerance 1 parallel.min_stages=2 train.steps=100` (three pipelines of two
stages; every node and etcd member a network namespace of its own) with one fault at
step 5:

  kill-node            node1 SIGKILLed whole (the baseline: a machine that vanishes);
  isolate-node         node1's packets vanish for 12 s, etcd's included: its lease lapses;
  partition            nodes 4 and 5 and the other four cannot reach each other for 20 s
                       (several lease TTLs), both sides reaching etcd;
  slow-link            node1's link at 1 Mbit/s for 10 s;
  isolate-etcd-member  etcd member 0 cut off from the other two for 10 s.

Reported per kind, from the chaos report (medians over repeats): detection (fault to
the leader's decision), release (decision to the last survivor leaving the failed
epoch), total (fault to the first step committed after it), and the step-time ratio
while the fault lasted; the ratio of each total to kill-node's; and the reconfigurations
each run made (a slow link and an etcd member must make none). Every run must lose
nothing (the harness's verdict).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from chaos_verdict import checked_chaos_run

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny.yaml"
CLUSTER = ["--nodes", "6", "--hosts", "--etcd-members", "3", "--fault-tolerance", "1",
           "parallel.min_stages=2", "train.steps=100"]
FAULTS = {
    "kill-node": "kill-node@5:target=1",
    "isolate-node": "isolate-node@5:target=1:for=12",
    "partition": "partition@5:target=4+5:for=20",
    "slow-link": "slow-link@5:target=1:for=10",
    "isolate-etcd-member": "isolate-etcd-member@5:target=0:for=10",
}


def one_run(kind: str, out: Path, cache: Path) -> dict:
    args = [sys.executable, "-m", "planaria.cli", "chaos", str(CONFIG), *CLUSTER, "--fault", FAULTS[kind],
            "--out", str(out), "--timeout", "900"]
    report = checked_chaos_run(args, out, cache, kind)
    (recovery,) = report["recoveries"]
    agents = "".join(p.read_text() for p in (out / "run" / "logs").glob("agent-*.log"))
    return {"detect_s": recovery["detect_s"], "release_s": recovery["release_s"], "total_s": recovery["total_s"],
            "step_time_ratio": recovery["step_time_ratio"], "checkpoint_loads": report["checkpoint_loads"],
            "reconfigurations": agents.count("controller: epoch ")}


def median(values):
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {kind: [] for kind in FAULTS}
    with tempfile.TemporaryDirectory(prefix="planaria-netfaults-") as tmp:
        cache = Path(tmp) / "cache"
        for repeat in range(args.repeats):
            for kind in FAULTS:  # interleaved: the machine's drift spreads over every kind
                runs[kind].append(one_run(kind, Path(tmp) / f"{kind}-{repeat}", cache))
                print(f"{kind} #{repeat + 1}: {runs[kind][-1]}", flush=True)
    base = median(r["total_s"] for r in runs["kill-node"])
    fmt = lambda v, unit="": "-" if v is None else f"{v:.2f}{unit}"  # noqa: E731
    print("\n| fault | detect | release | total | total / kill-node | step time while it lasts "
          "| reconfigurations | checkpoint loads |\n|---|---|---|---|---|---|---|---|")
    summary = {}
    for kind, found in runs.items():
        row = {key: median(r[key] for r in found) for key in ("detect_s", "release_s", "total_s", "step_time_ratio")}
        row["reconfigurations"] = [r["reconfigurations"] for r in found]
        row["checkpoint_loads"] = sum(r["checkpoint_loads"] for r in found)
        ratio = row["total_s"] / base if row["total_s"] is not None and base else None
        summary[kind] = row
        print(f"| `{kind}` | {fmt(row['detect_s'], ' s')} | {fmt(row['release_s'], ' s')} | "
              f"{fmt(row['total_s'], ' s')} | {fmt(ratio, 'x')} | x{fmt(row['step_time_ratio'])} | "
              f"{row['reconfigurations']} | {row['checkpoint_loads']} |")
    if args.json:
        args.json.write_text(json.dumps({"repeats": args.repeats, "runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
