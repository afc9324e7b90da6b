"""Planner depth: template sizes capped at 2·n0−1 against the deeper set, side by side.

    python benchmarks/planner_depth.py [--hardware a100] [--min-nodes 8] [--max-nodes 1024]
                                       [--step 1] [--samples 8,16,32,64,128,200,256,512,1024]
                                       [--models 6.7b,13b,175b] [--json out.json]

For GPT-3 6.7B, 13B and 175B shapes (the GPT-3 paper's layers, widths, heads, 2,048
tokens of context and batch sizes), two planners of one job each: one whose templates
stop at 2·n0−1 nodes (`PlannerSettings(depth=2)`, the sizes that suffice to cover every
node count) and the default one (`depth=4`: deeper templates where they can cut the
gradient sync, `templates/planner.py`). For every N in [min, max] (every `--step`-th,
plus the samples) both instantiate a plan for N nodes; the table gives, at the sample
N's, the estimated iteration time of each (slowest pipeline + gradient sync), the
pipelines, and the gain, and a summary over every N: the median and largest gain, and
how many N's the deeper set made slower (the search over a larger set is not bound to be
no slower: it minimises the slowest pipeline per size class and adds the sync after).

Planning time: `Planner(...)` (cold: the first in the process) and every `instantiate`,
each one `time.perf_counter` span, on one planner per job as a running job holds it.
Reported: the largest instantiate over all N, and the largest cold construction plus
instantiate (a one-off `planaria plan`). Every plan is checked to use all N nodes (no
idle node: these jobs have batches large enough and every size fits), with f+1
pipelines from (f+1)·n0 nodes up.

The jobs (the analytic cost model of `--hardware`, bf16, micro batch 1, f = 1, tensor
parallelism = GPUs per node):
  6.7B: 32 blocks, d_model 4096, 32 heads; 2 GPUs per node; batch 1,024; no recomputation
  13B:  40 blocks, d_model 5120, 40 heads; 8 GPUs per node; batch 1,024; recomputation
  175B: 96 blocks, d_model 12288, 96 heads; 8 GPUs per node; batch 1,536; recomputation

Verdict (exit status 0 or 1): the 6.7B job at N = 200 is at least 15% faster with the
deeper set, no instantiate takes a second or more, and every plan is valid.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass

from planaria.templates.analytic import analytic_cost_model, hardware
from planaria.templates.costs import ModelShape
from planaria.templates.job_templates import PlannerSettings
from planaria.templates.planner import Planner

DEFAULT_SAMPLES = "8,16,32,64,128,200,256,512,1024"


@dataclass(frozen=True)
class Job:
    name: str
    shape: ModelShape
    gpus_per_node: int
    global_batch: int
    recompute: bool


JOBS = {
    "6.7b": Job("GPT-3 6.7B", ModelShape(32, 4096, 32, 51200, 2048), 2, 1024, False),
    "13b": Job("GPT-3 13B", ModelShape(40, 5120, 40, 51200, 2048), 8, 1024, True),
    "175b": Job("GPT-3 175B", ModelShape(96, 12288, 96, 51200, 2048), 8, 1536, True),
}


def build(job: Job, hardware_name: str, depth: int) -> tuple[Planner, float]:
    """(the planner, its cold construction time)."""
    hw = hardware(hardware_name, gpus_per_node=job.gpus_per_node)
    costs = analytic_cost_model(job.shape, hw, tp=job.gpus_per_node, micro_batch=1, dtype="bfloat16",
                                recompute=job.recompute, wide_gradients=True)  # train.exact_reduction
    started = time.perf_counter()
    planner = Planner(costs, PlannerSettings(fault_tolerance=1, global_batch=job.global_batch,
                                             micro_batch=1, depth=depth))
    return planner, time.perf_counter() - started


def problems_of(planner: Planner, choice, n: int) -> list[str]:
    f, n0 = planner.settings.fault_tolerance, planner.n0
    found = []
    if choice.idle_nodes or len(choice.plan.nodes()) != n:
        found.append(f"N={n}: {len(choice.idle_nodes)} idle nodes ({choice.idle_reason})")
    if n >= (f + 1) * n0 and len(choice.plan.pipelines) < f + 1:
        found.append(f"N={n}: {len(choice.plan.pipelines)} pipelines < f+1")
    if choice.plan.total_microbatches != planner.settings.total_microbatches:
        found.append(f"N={n}: the microbatches do not add up to the batch")
    return found


def shape_summary(choice) -> str:
    sizes = Counter(len(p.stages) for p in choice.plan.pipelines)
    return " + ".join(f"{count}×{size}" for size, count in sorted(sizes.items(), reverse=True))


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def run_job(key: str, args, ns: list[int], samples: list[int], say) -> dict:
    job = JOBS[key]
    capped, capped_cold = build(job, args.hardware, depth=2)
    deeper, deeper_cold = build(job, args.hardware, depth=4)
    say(f"\n{job.name} on {args.hardware} x {job.gpus_per_node} per node, batch {job.global_batch}, "
        f"f = 1: n0 = {deeper.n0}; capped sizes {capped.standing_sizes}; deeper set "
        f"{deeper.standing_sizes}; Planner() cold: capped {capped_cold * 1e3:.0f} ms, deeper "
        f"{deeper_cold * 1e3:.0f} ms")
    per_n, problems = {}, []
    first_deeper = None
    for n in ns:
        if n < deeper.n0:
            continue
        t0 = time.perf_counter()
        old = capped.instantiate(n)
        t1 = time.perf_counter()
        new = deeper.instantiate(n)
        t2 = time.perf_counter()
        first_deeper = t2 - t1 if first_deeper is None else first_deeper
        problems += problems_of(capped, old, n) + problems_of(deeper, new, n)
        per_n[n] = {"capped_s": old.iteration_time_s, "deeper_s": new.iteration_time_s,
                    "capped_sync_s": old.iteration_time_s - max(old.pipeline_times_s),
                    "deeper_sync_s": new.iteration_time_s - max(new.pipeline_times_s),
                    "capped_shape": shape_summary(old), "deeper_shape": shape_summary(new),
                    "gain": 1 - new.iteration_time_s / old.iteration_time_s,
                    "capped_plan_s": t1 - t0, "deeper_plan_s": t2 - t1}
    rows = []
    for n in samples:
        if n in per_n:
            r = per_n[n]
            rows.append([str(n), r["capped_shape"], f"{r['capped_s']:.3f}", f"{r['capped_sync_s']:.3f}",
                         r["deeper_shape"], f"{r['deeper_s']:.3f}", f"{r['deeper_sync_s']:.3f}",
                         f"{r['gain']:+.1%}", f"{r['deeper_plan_s'] * 1e3:.0f}"])
    say(table(rows, ["N", "capped: pipelines×stages", "iteration (s)", "sync (s)",
                     "deeper: pipelines×stages", "iteration (s)", "sync (s)", "gain", "plan (ms)"]))
    gains = [r["gain"] for r in per_n.values()]
    best = max(per_n, key=lambda n: per_n[n]["gain"])
    slower = sorted(n for n, r in per_n.items() if r["gain"] < -1e-12)
    plan_max = max(per_n, key=lambda n: per_n[n]["deeper_plan_s"])
    summary = {
        "n0": deeper.n0, "capped_sizes": capped.standing_sizes, "deeper_sizes": deeper.standing_sizes,
        "n_values": len(per_n), "median_gain": statistics.median(gains), "max_gain": per_n[best]["gain"],
        "max_gain_at": best, "slower_at": slower,
        "worst_loss": min(gains), "instantiate_max_s": per_n[plan_max]["deeper_plan_s"],
        "instantiate_max_at": plan_max,
        "capped_instantiate_max_s": max(r["capped_plan_s"] for r in per_n.values()),
        "construction_cold_s": deeper_cold, "cold_plus_first_s": deeper_cold + first_deeper,
        "problems": problems, "per_n": {str(n): r for n, r in per_n.items()},
    }
    say(f"over {len(per_n)} N's: gain median {summary['median_gain']:+.1%}, largest "
        f"{summary['max_gain']:+.1%} at N = {best}; slower at {len(slower)} N's"
        f"{f' (worst {min(gains):+.2%}, N = {slower[:8]})' if slower else ''}; instantiate max "
        f"{summary['instantiate_max_s'] * 1e3:.0f} ms at N = {plan_max} (capped: "
        f"{summary['capped_instantiate_max_s'] * 1e3:.0f} ms); cold Planner() + first instantiate "
        f"{summary['cold_plus_first_s'] * 1e3:.0f} ms; problems: {len(problems)}")
    for line in problems[:10]:
        say(f"  {line}")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hardware", default="a100")
    p.add_argument("--min-nodes", type=int, default=8)
    p.add_argument("--max-nodes", type=int, default=1024)
    p.add_argument("--step", type=int, default=1)
    p.add_argument("--samples", default=DEFAULT_SAMPLES)
    p.add_argument("--models", default="6.7b,13b,175b", help=f"any of {sorted(JOBS)}")
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args(argv)
    say = lambda *a: print(*a, flush=True)
    say(f"command: python benchmarks/planner_depth.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    say(f"machine: {platform.processor() or platform.machine()} | nproc {len(os.sched_getaffinity(0))} | "
        f"Python {platform.python_version()} | load average {os.getloadavg()[0]:.2f}")
    samples = [int(x) for x in args.samples.split(",") if x.strip()]
    ns = sorted(set(range(args.min_nodes, args.max_nodes + 1, args.step))
                | {n for n in samples if args.min_nodes <= n <= args.max_nodes})
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    unknown = [k for k in keys if k not in JOBS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {sorted(JOBS)}")
    results = {key: run_job(key, args, ns, samples, say) for key in keys}
    ok = all(not r["problems"] and r["instantiate_max_s"] < 1.0 for r in results.values())
    gain_200 = results.get("6.7b", {}).get("per_n", {}).get("200", {}).get("gain")
    if gain_200 is not None:
        ok = ok and gain_200 >= 0.15
    planning = max(r["instantiate_max_s"] for r in results.values())
    say(f"\nverdict: {'PASS' if ok else 'FAIL'}: 6.7B at N = 200 "
        f"{'-' if gain_200 is None else f'{gain_200:+.1%}'} (at least +15% wanted); instantiate at most "
        f"{planning * 1e3:.0f} ms over every N and job (under 1 s wanted); load average after "
        f"{os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"args": vars(args), "results": results, "ok": ok}, out, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
