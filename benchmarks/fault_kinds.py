"""What each kind of fault cost one chaos run: its report's recoveries, per kind.

    python benchmarks/fault_kinds.py soak-net-out/report.json [--json out.json]

Reads the report a `planaria chaos ... --out DIR` run wrote (DIR/report.json; `make
soak-net` writes soak-net-out/) and prints, per fault kind, how many faults of it the run
had and the medians (with the largest in brackets, where there were several) of the
report's columns: detection (the fault to the leader's decision), release (the decision
to the last survivor out of the failed epoch), total (the fault to the first step
committed after it) and the step time while the fault lasted, over the run's step time
away from faults. A kind none of whose faults made a reconfiguration (a slow link, an
etcd member cut off) shows "none" for detection. The line above the table says the run:
its steps, faults and wall time, and whether it lost anything.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from planaria.chaos.faults import parse_fault
from planaria.chaos.report import Recovery, load_report


def per_kind(recoveries: list[Recovery]) -> dict[str, dict]:
    """{kind: {faults, detect_s, release_s, total_s, step_time_ratio}}, each a list of the
    values the report has (None left out), kinds in the order the run first had them."""
    found: dict[str, dict] = {}
    for r in recoveries:
        row = found.setdefault(parse_fault(r.fault).kind, {"faults": 0, "detect_s": [], "release_s": [],
                                                           "total_s": [], "step_time_ratio": []})
        row["faults"] += 1
        for key in ("detect_s", "release_s", "total_s", "step_time_ratio"):
            if getattr(r, key) is not None:
                row[key].append(getattr(r, key))
    return found


def cell(values: list[float], unit: str = " s", prefix: str = "") -> str:
    """The median, and the largest in brackets when there are several; empty for none."""
    if not values:
        return ""
    text = f"{prefix}{statistics.median(values):.2f}{unit}"
    return text if len(values) == 1 else f"{text} ({prefix}{max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="a chaos run's report.json")
    parser.add_argument("--json", type=Path, help="also write the per-kind values here")
    args = parser.parse_args(argv)
    report = load_report(args.report)
    kinds = per_kind(report.recoveries)
    print(f"{report.steps_committed} of {report.steps} steps, {len(report.recoveries)} faults in "
          f"{report.wall_s / 60:.1f} minutes; {report.committed_steps_lost} lost, "
          f"{report.checkpoint_loads} checkpoint loads, max loss diff "
          f"{'-' if report.max_loss_diff is None else f'{report.max_loss_diff:.2e}'}")
    print("\n| fault | faults | detection | release | total (fault to the next step) | step time while it lasted |"
          "\n|---|---:|---:|---:|---:|---:|")
    for kind, row in kinds.items():
        reconfigured = bool(row["detect_s"] or row["total_s"])
        print(f"| `{kind}` | {row['faults']} | {cell(row['detect_s']) if reconfigured else 'none'} | "
              f"{cell(row['release_s'])} | {cell(row['total_s']) if reconfigured else 'no reconfiguration'} | "
              f"{cell(row['step_time_ratio'], unit='', prefix='x')} |")
    if args.json:
        args.json.write_text(json.dumps(kinds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
