"""Does the simulator predict the local chaos runs' ETTR? Costs measured on one run, predicted for others.

    python benchmarks/simulator_vs_chaos.py --calibrate soak-out/report.json \\
        --run soak-out/report.json configs/soak.yaml 6 \\
        --run replay-out/report.json configs/tiny.yaml 6 parallel.min_stages=2 ... \\
        --run demo-out/report.json configs/demo.yaml 4

`--calibrate`: the chaos report whose recoveries give the cost of each fault kind on
this machine (`planaria.chaos.simulator.local.fault_costs`: medians of the recoveries'
durations, and a new node's boot until it asks to join).
`--run REPORT CONFIG NODES [OVERRIDES...]`: a chaos run to predict: its report, the
config and overrides it ran with, and the nodes it started with. Prints, per run, the
ETTR the simulator predicts from the run's faults, the measured one, and the error.
See planaria.chaos.simulator.local and docs/simulator.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from planaria.chaos.simulator.local import fault_costs, load, predict_ettr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrate", required=True, metavar="REPORT")
    parser.add_argument("--run", action="append", nargs="+", required=True,
                        metavar="REPORT CONFIG NODES [OVERRIDE]")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    costs = fault_costs(load(args.calibrate))
    print("cost of each fault kind (s, median; boot: a new node until it asks to join), from", args.calibrate)
    for kind, seconds in sorted(costs.items()):
        print(f"  {kind:18s} {seconds:6.2f}")
    print("\n| run | faults | predicted ETTR | measured ETTR | error |")
    print("|---|---:|---:|---:|---:|")
    rows = []
    for spec in args.run:
        if len(spec) < 3:
            parser.error(f"--run {' '.join(spec)}: need REPORT CONFIG NODES [OVERRIDES...]")
        path, config, nodes, *overrides = spec
        report = load(path)
        predicted = predict_ettr(report, costs, Path(config), overrides, nodes=int(nodes))
        measured = report["ettr"]
        error = (predicted - measured) / measured
        rows.append({"report": path, "faults": len(report["series"]["faults"]), "predicted": predicted,
                     "measured": measured, "error": error})
        print(f"| {path} | {rows[-1]['faults']} | {predicted:.3f} | {measured:.3f} | {error:+.1%} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"costs": costs, "runs": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
