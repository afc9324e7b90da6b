"""The simulator's figures for docs/simulator.md: Planaria, checkpoint-restart and Bamboo-style
redundancy on the p3 and g4dn traces and Oobleck's five synthetic rates, for GPT-3 2.7B
and 6.7B, beside what Oobleck's own simulator gives for the same setups.

    python benchmarks/simulator_table.py [--hardware v100] [--fault-tolerance 1] [--json out.json]

Traces as Oobleck's simulator has them: p3 and g4dn rescaled to peak at 30 nodes, the
synthetic ones starting from 30 nodes and losing one every 6 h, 3 h, 1 h, 30 min or
10 min, 15 times. Each row is run twice: with Planaria's calibration (docs/simulator.md)
and with the restart and checkpoint costs Oobleck's simulator charges its
checkpoint-restart baseline for that model, so that the effect of that one assumption is
visible. Takes about a minute on one core.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from planaria.chaos.report import write_json_atomically
from planaria.chaos.simulator.availability import load_availability
from planaria.chaos.simulator.calibration import Calibration
from planaria.chaos.simulator.models import PRESETS
from planaria.chaos.simulator.runner import run_simulation

TRACES = ("p3", "g4dn", "synthetic:6h", "synthetic:3h", "synthetic:1h", "synthetic:30m", "synthetic:10m")
MODELS = ("gpt3-2.7b", "gpt3-6.7b")

# Oobleck's artifact simulator (SymbioticLab/Oobleck, branch sosp23-artifact, tools/simulator),
# run unmodified: throughput in samples/s of Oobleck and of its checkpoint-restart baseline
# (Varuna). Bamboo runs out of memory there for both models. Its "gcp" trace replays the
# g4dn trace's timestamps rescaled to 30 nodes, which is what the g4dn row here does.
OOBLECK = {
    ("p3", "gpt3-2.7b"): (5.42, 0.60), ("p3", "gpt3-6.7b"): (2.68, 0.00),
    ("g4dn", "gpt3-2.7b"): (6.13, 0.91), ("g4dn", "gpt3-6.7b"): (2.92, 0.00),
    ("synthetic:6h", "gpt3-2.7b"): (7.29, 7.27), ("synthetic:3h", "gpt3-2.7b"): (7.28, 7.12),
    ("synthetic:1h", "gpt3-2.7b"): (7.23, 6.54), ("synthetic:30m", "gpt3-2.7b"): (7.18, 5.83),
    ("synthetic:10m", "gpt3-2.7b"): (6.89, 1.76),
    ("synthetic:6h", "gpt3-6.7b"): (4.33, 4.14), ("synthetic:3h", "gpt3-6.7b"): (4.31, 3.96),
    ("synthetic:1h", "gpt3-6.7b"): (4.22, 2.69), ("synthetic:30m", "gpt3-6.7b"): (4.11, 1.06),
    ("synthetic:10m", "gpt3-6.7b"): (3.55, 0.26),
}
# Oobleck's simulator: restart and checkpoint seconds of its checkpoint-restart baseline.
OOBLECK_RESTART = {"gpt3-2.7b": (515.0, 50.0), "gpt3-6.7b": (701.0, 120.0)}


def _row(trace: str, model: str, args, calibration: Calibration) -> dict:
    availability = load_availability(trace, nodes=30 if not trace.startswith("synthetic") else None)
    sim = run_simulation(PRESETS[model], availability, hardware_name=args.hardware,
                         fault_tolerance=args.fault_tolerance, calibration=calibration)
    row = {"trace": trace, "model": model}
    for name in ("planaria", "checkpoint", "redundancy"):
        result = sim.results.get(name)
        row[name] = None if result is None else {
            "ettr": result.ettr, "tokens_per_s": result.tokens / result.duration_s,
            "checkpoint_loads": result.checkpoint_loads, "n0": sim.n0.get(name)}
        if name in sim.unfit:
            row[name] = {"unfit": sim.unfit[name]}
    row["fault_free_tokens_per_s"] = sim.fault_free_tokens_per_s
    return row


def _ratio(a: dict | None, b: dict | None) -> str:
    if not a or not b or "tokens_per_s" not in a or "tokens_per_s" not in b or not b["tokens_per_s"]:
        return "-"
    return f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x"


def _cell(p: dict | None) -> str:
    if not p:
        return "-"
    if "unfit" in p:
        return "does not fit"
    return f"{p['ettr']:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="v100")
    parser.add_argument("--fault-tolerance", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    for model in MODELS:
        restart_s, checkpoint_s = OOBLECK_RESTART[model]
        for trace in TRACES:
            ours = _row(trace, model, args, Calibration())
            # Oobleck's restart cost; its checkpoint cost, as a storage speed for this model's shards.
            theirs = _row(trace, model, args, Calibration(restart_s=restart_s))
            rows.append({"ours": ours, "oobleck_restart": theirs, "oobleck": OOBLECK.get((trace, model)),
                         "oobleck_checkpoint_s": checkpoint_s})
    print(f"| model | trace | ETTR Planaria | ETTR checkpoint | ETTR redundancy | Planaria / checkpoint "
          f"| same, restart {OOBLECK_RESTART['gpt3-2.7b'][0]:.0f}/{OOBLECK_RESTART['gpt3-6.7b'][0]:.0f} s "
          "| Oobleck / Varuna (Oobleck's simulator) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ours, theirs, oob = r["ours"], r["oobleck_restart"], r["oobleck"]
        oobleck_ratio = "-" if not oob else ("inf (Varuna 0)" if oob[1] == 0 else f"{oob[0] / oob[1]:.2f}x")
        print(f"| {ours['model']} | {ours['trace']} | {_cell(ours['planaria'])} | {_cell(ours['checkpoint'])} | "
              f"{_cell(ours['redundancy'])} | {_ratio(ours['planaria'], ours['checkpoint'])} | "
              f"{_ratio(theirs['planaria'], theirs['checkpoint'])} | {oobleck_ratio} |")
    print(f"\n{time.perf_counter() - started:.0f} s")
    if args.json:
        write_json_atomically(Path(args.json), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
