"""The planner beyond a thousand nodes, where the batch bounds the pipeline count:
`instantiate(N)` with the short-batch packing built one pipeline count at a time in
numpy, against the same packing as plain loops over nodes, sizes and pipeline counts
(the oracle of tests/templates/test_packing.py, what it was before), side by side in
one run, on the same planner.

    python benchmarks/planner_short_batch.py [--config configs/llama3-70b.yaml]
        [--nodes 2048 3072 4096] [--baseline-max 2048]

LLaMA 3 70B's global batch of 512 sequences, micro batch 1, makes 512 microbatches: from
about 1,100 nodes on, pipelines of the smallest template could outnumber them, and every
pipeline needs one, so the packing counts pipelines exactly (`packing.pack_short_batch`).
Prints, per N, the time of one `instantiate` with each packing, their ratio, and whether
the two plans are equal. The loops take minutes above 2,048 nodes: `--baseline-max`
bounds where they run.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the oracle of tests/templates/test_packing.py

import planaria.templates.planner as planner_module  # noqa: E402
from planaria.runtime.config.loading import load_config  # noqa: E402
from planaria.runtime.planning.job_plans import build_planner, cost_model  # noqa: E402
from tests.templates.test_packing import short_batch_by_loops  # noqa: E402


def timed_plan(cfg, costs, nodes: int, packing):
    """One `instantiate(nodes)` on a new planner with `packing` as the short-batch packing."""
    planner_module.pack_short_batch = packing
    planner = build_planner(cfg, costs)
    started = time.perf_counter()
    choice = planner.instantiate(nodes, node_ids=[f"node{i}" for i in range(nodes)])
    return time.perf_counter() - started, choice.plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "llama3-70b.yaml"))
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--nodes", type=int, nargs="+", default=[2048, 3072, 4096])
    parser.add_argument("--baseline-max", type=int, default=2048,
                        help="the largest N the plain loops run at (they take minutes beyond)")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    costs = cost_model(cfg, hardware_name=args.hardware, gpus_per_node=args.gpus_per_node)
    numpy_packing = planner_module.pack_short_batch
    print(f"{Path(args.config).name}: {cfg.train.global_batch // cfg.train.micro_batch} microbatches, "
          f"{args.hardware} x {args.gpus_per_node} per node")
    print("| N | pipelines | numpy (s) | plain loops (s) | loops / numpy | same plan |")
    print("|---:|---:|---:|---:|---:|---|")
    try:
        for nodes in args.nodes:
            fast, plan = timed_plan(cfg, costs, nodes, numpy_packing)
            row = [str(nodes), str(len(plan.pipelines)), f"{fast:.2f}"]
            if nodes <= args.baseline_max:
                slow, reference = timed_plan(cfg, costs, nodes, short_batch_by_loops)
                row += [f"{slow:.2f}", f"{slow / fast:.1f}x", "yes" if reference == plan else "NO"]
            else:
                row += ["", "", ""]
            print("| " + " | ".join(row) + " |", flush=True)
    finally:
        planner_module.pack_short_batch = numpy_packing
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
