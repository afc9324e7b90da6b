"""Does the simulator predict the local chaos runs' ETTR? Costs measured on one run, predicted for others.

    python benchmarks/simulator_vs_chaos.py \\
        --calibrate soak-out/report.json --calibrate replay-out/report.json \\
        --run soak-out/report.json configs/soak.yaml 6 \\
        --run replay-out/report.json configs/tiny.yaml 6 parallel.min_stages=2 ... \\
        --run demo-out/report.json configs/demo.yaml 4

`--calibrate REPORT` (one or more): a chaos report whose recoveries give the cost of
each fault kind on this machine (`planaria.chaos.simulator.chaos_runs.fault_costs`: medians
of the recoveries' durations, and a new node's boot until it asks to join).
`--run REPORT CONFIG NODES [OVERRIDES...]`: a chaos run to predict: its report, the
config and overrides it ran with, and the nodes it started with.

Prints, per run and calibration, the ETTR the simulator predicts from the run's faults,
the one the run measured, both against the run's own fault-free step time
(`quiet_step_s`), and the error; a calibration whose report lacks a kind of fault the
run had is skipped. A row whose run is its own calibration is marked "(in sample)".
The report's own ETTR, against its cached reference, is printed beside them: the
difference is the machine's speed drifting between the runs (docs/simulator.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from planaria.chaos.report import write_json_atomically
from planaria.chaos.simulator.chaos_runs import (fault_costs, load, measured_ettr, predict_ettr,
                                            quiet_step_s, reference_step_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrate", action="append", required=True, metavar="REPORT")
    parser.add_argument("--run", action="append", nargs="+", required=True,
                        metavar="REPORT CONFIG NODES [OVERRIDE]")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    for spec in args.run:
        if len(spec) < 3 or not spec[2].isdigit():
            parser.error(f"--run {' '.join(spec)}: need REPORT CONFIG NODES [OVERRIDES...]")
    calibrations = {path: fault_costs(load(path)) for path in args.calibrate}
    for path, costs in calibrations.items():
        print(f"cost of each fault kind (s, median; boot: a new node until it asks to join), from {path}")
        for kind, seconds in sorted(costs.items()):
            print(f"  {kind:18s} {seconds:6.2f}")
    print("\n| run | calibrated on | faults | step (own / reference) | predicted ETTR | measured ETTR "
          "| error | report's ETTR |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for path, config, nodes, *overrides in args.run:
        report = load(path)
        step_s = quiet_step_s(report)
        measured = measured_ettr(report, step_s)
        for calibration, costs in calibrations.items():
            try:
                predicted = predict_ettr(report, costs, Path(config), overrides, nodes=int(nodes), step_s=step_s)
            except ValueError as err:  # the calibration lacks a kind of fault this run had
                print(f"<!-- {path} from {calibration}: skipped, {err} -->")
                continue
            row = {"report": path, "calibration": calibration, "in_sample": Path(path) == Path(calibration),
                   "faults": len(report["series"]["faults"]), "step_s": step_s,
                   "reference_step_s": reference_step_s(report), "predicted": predicted,
                   "measured": measured, "error": (predicted - measured) / measured,
                   "report_ettr": report["ettr"]}
            rows.append(row)
            print(f"| {path} | {calibration}{' (in sample)' if row['in_sample'] else ''} | {row['faults']} "
                  f"| {step_s:.3f} / {row['reference_step_s']:.3f} s | {predicted:.3f} | {measured:.3f} "
                  f"| {row['error']:+.1%} | {row['report_ettr']:.3f} |")
    if args.json:
        write_json_atomically(Path(args.json), {"costs": calibrations, "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
