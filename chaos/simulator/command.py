"""`planaria simulate`: the command line over `planaria.chaos.simulator.runner`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from planaria.chaos.simulator.runner import POLICIES

TRACE_HARDWARE = {"p3": "v100", "g4dn": "t4", "gcp": "a100"}
"""The instance type each shipped trace was recorded on (its default --hardware)."""


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="replay a preemption trace at cluster scale and compare "
                                        "Planaria with checkpoint-restart and redundancy")
    p.add_argument("--trace", required=True, metavar="FILE|p3|g4dn|gcp|synthetic:EVERY",
                   help="a trace file or a shipped trace; synthetic:6h (3h, 1h, 30m, 10m) removes a "
                        "node every EVERY from 30")
    p.add_argument("--model", required=True, metavar="NAME|CONFIG.yaml",
                   help="gpt3-medium, gpt3-2.7b, gpt3-6.7b, llama-7b, llama-13b, or a config file")
    p.add_argument("--hardware", default=None,
                   help="a100, h100, h200, v100 or t4 (default: the trace's instance type: p3 v100, "
                        "g4dn t4, gcp a100; a100 otherwise)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node, all tensor-parallel (default: the hardware's: 8, or 1 for v100/t4 "
                        "and for the gcp trace's one-GPU instances)")
    p.add_argument("--fault-tolerance", type=int, default=1, help="f for Planaria (default 1)")
    p.add_argument("--policy", default="all", choices=(*POLICIES, "all"))
    p.add_argument("--nodes", type=int, default=None,
                   help="rescale the trace's live count to peak at N (synthetic: start with N)")
    p.add_argument("--time-scale", type=float, default=1.0, metavar="X", help="replay X times faster")
    p.add_argument("--seed", type=int, default=0, help="which nodes go when a rescaled count drops")
    p.add_argument("--notice", type=float, default=0.0, metavar="SECONDS",
                   help="every removal is announced SECONDS ahead (EC2 spot: 120, GCP and Azure: 30); "
                        "Planaria then leaves at a step boundary; the other policies do not use notices "
                        "(default 0: no notice)")
    p.add_argument("--spot-price", type=float, default=None, help="$ per GPU-hour on spot (default 1.64)")
    p.add_argument("--on-demand-price", type=float, default=None,
                   help="$ per GPU-hour on demand (default 4.10)")
    p.add_argument("--target-tokens", type=float, default=1e9, help="token target for time-to-target")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override a calibration figure (docs/simulator.md), e.g. restart_s=300; the "
                        "scale curves take a number (flat: regroup_s=2) or SIZE:SECONDS points "
                        "(control_s=4:0.75,64:1.2)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", default=None, metavar="FILE", help="write a plot of throughput over the trace")
    p.set_defaults(func=run)


def _default_hardware(trace: str) -> str:
    stem = Path(trace).name
    return next((hw for prefix, hw in TRACE_HARDWARE.items() if stem.startswith(prefix)), "a100")


TRACE_GPUS = {"gcp": 1}
"""GPUs per instance where a shipped trace's instances are not the hardware's usual node:
the GCP trace counts one-GPU a100 instances (gcp-a100x1)."""


def _default_gpus(trace: str) -> int | None:
    stem = Path(trace).name
    return next((gpus for prefix, gpus in TRACE_GPUS.items() if stem.startswith(prefix)), None)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from planaria.chaos.faults import FaultSpecError
    from planaria.chaos.simulator.availability import load_availability
    from planaria.chaos.simulator.calibration import Calibration
    from planaria.chaos.simulator.models import load_job
    from planaria.chaos.simulator.simulation_report import plot, print_table, summary, to_json
    from planaria.chaos.simulator.runner import Prices, run_simulation
    from planaria.runtime.config.sections import ConfigError

    try:
        if args.fault_tolerance < 0:
            raise ValueError(f"--fault-tolerance {args.fault_tolerance}: f must be 0 or more")
        if args.target_tokens <= 0:
            raise ValueError("--target-tokens must be positive")
        if args.notice < 0:
            raise ValueError(f"--notice {args.notice:g}: must be 0 or more seconds")
        defaults = Prices()
        prices = Prices(spot=defaults.spot if args.spot_price is None else args.spot_price,
                        on_demand=defaults.on_demand if args.on_demand_price is None else args.on_demand_price)
        if prices.spot <= 0 or prices.on_demand <= 0:
            raise ValueError("prices must be positive")
        availability = load_availability(args.trace, nodes=args.nodes, time_scale=args.time_scale, seed=args.seed)
        job = load_job(args.model)
        sim = run_simulation(job, availability, hardware_name=args.hardware or _default_hardware(args.trace),
                             gpus_per_node=args.gpus_per_node or _default_gpus(args.trace),
                             fault_tolerance=args.fault_tolerance,
                             policies=POLICIES if args.policy == "all" else (args.policy,),
                             calibration=Calibration().with_overrides(args.set), prices=prices,
                             notice_s=args.notice)
    except (ValueError, FaultSpecError, FileNotFoundError, ConfigError) as err:
        print(f"planaria simulate: {err}", file=sys.stderr)
        return 2
    data = summary(sim, args.target_tokens)
    if args.plot:
        plot(sim, Path(args.plot))
    if args.json:
        print(to_json(data))
    else:
        print_table(data, Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 150))
        for name, reason in sim.unfit.items():
            print(f"  {name}: {reason}")
        if args.plot:
            print(f"plot: {args.plot}")
    return 0
