"""Planner scale: planning a GPT-3-175B-sized job for every node count N from 8 to 1024.

    python benchmarks/planner_scale.py [--hardware h100] [--gpus-per-node 8]
                                       [--fault-tolerance 2] [--min-nodes 8] [--max-nodes 1024]
                                       [--schedule 1f1b] [--virtual-stages 1]
                                       [--global-batch 1536] [--naive-max-nodes 40]
                                       [--samples 8,18,37,64,256,1024] [--step 1]
                                       [--replan-step 8] [--limit 1.0] [--profile] [--no-cli]
                                       [--json out.json]

The planner issue's Must-show: planning a 96-layer GPT-3-175B-sized model for every N
from 8 to 1024 nodes with f = 2 takes under a second per N. The job: ModelShape(96
blocks, d_model 12288, 96 heads, vocab 51200, seq_len 2048), bfloat16, activation
recomputation, micro batch 1, global batch 1536, tensor parallelism = GPUs per node,
analytic cost model of the hardware preset (`templates/analytic.py`). Nothing here
needs a GPU. torch is imported only for the in-process `plan_job` and CLI rows and
for `model_flops_per_token` (a copy of its formula is used without torch).

What is measured (time.perf_counter, one process, one thread):

  1. Template generation: `Planner(costs, settings)` (n0 and the templates n0..2n0-1).
     The first construction in the process (cold, as a fresh `planaria plan` has it)
     and the median of a few more (warm: schedule helpers' caches filled).
  2. `planner.instantiate(N)` for every N in [min, max] (every `--step`-th, plus the
     samples), on the one planner, as a running job does: its templates are cached.
     Every plan is checked: Plan validates itself on construction; on top, every one
     of the N nodes runs exactly one stage, the world has N·G ranks, there are ≥ f+1
     pipelines whenever N ≥ (f+1)·n0 (and `degraded` says so exactly when N is
     smaller), every pipeline is a template size, and the microbatch counts sum to
     the batch. Reported: median / p95 / max over all N, the N of the max, and how
     many N took over `--limit` seconds (the Must-show asks for 0). Only the samples'
     plans are kept alive: holding a thousand plans of up to 1,024 stages would make the
     garbage collector's full passes land, hundreds of ms each, inside the timings.
     The search alone (`Planner._best_multiset` + `_split`, no Plan built) is timed in a
     second pass, when the planner has those methods.
  3. What a user pays for one N without a cached planner: construction + instantiate.
     For every N as the sum (cold construction + that N's instantiate), and measured
     directly at the sample N's: a fresh Planner and instantiate in this process, and
     `runtime.planning.plan_job` on configs/gpt3-175b.yaml (what `planaria plan` runs
     in-process: cost model, planner, plan, MFU). Once, the real CLI for the largest
     N as a subprocess (Python start-up and the torch import included).
  4. Re-planning after a failure, at every --replan-step-th N and the samples, when
     `instantiate` takes the running plan (`current=`): the plan for N+1 nodes (node0 ..
     nodeN) loses its middle node, and the N survivors are planned with it as current.
  5. Baseline, side by side: a naive planner for N ≤ --naive-max-nodes that
     enumerates every multiset of template sizes summing to N (with ≥ min(f+1, N//n0)
     pipelines, as the planner requires), splits the batch over each with the
     planner's own greedy split (`Planner._split`, each microbatch to the pipeline
     that finishes it first), adds the planner's gradient-sync estimate
     (`Planner._sync_time`), and keeps the fastest. It must reach the planner's
     slowest pipeline (what the planner's search minimises); the table also compares
     iteration times (sync included) and gives the time ratio. The naive time leaves out
     building the Plan, which instantiate's time includes, so the ratio is
     conservative. For larger N the number of multisets is counted (not enumerated)
     and the naive time extrapolated from its measured cost per multiset.
     Beyond it, at the sample N's, a sync-aware reference: the planner's own search
     restricted, for each template's gradient-sync cost w, to the templates whose sync
     is at most w, with the sync added; the best over w. The planner minimises the
     slowest pipeline and adds the sync afterwards, so it can miss a plan whose deeper
     pipelines (smaller stages, less gradient to all-reduce) finish sooner overall.
  6. If any N takes over --limit (or with --profile): cProfile of the slowest
     instantiate, and of the slowest re-plan, top functions by cumulative and own time.

Sample plans (N = 8, 18, 37, 64, 256, 1024 by default): pipelines × stages, the
microbatch split, estimated iteration time, tokens/s and MFU with
`runtime.planning.model_flops_per_token` (the same formula as `planaria plan`).

The machine's load is reported: the load average before and after, and the share of
the CPUs other processes used during the all-N loop (from /proc/stat).
Exit status 0 when every plan is valid, no call (instantiate, cold construction +
instantiate, re-plan) is over the limit, and the naive baseline reaches the planner's
slowest pipeline; 1 otherwise. Where the naive baseline or the sync-aware reference
has a smaller iteration time once the gradient sync is added, that is listed as a
finding (the planner's plan is valid, a little slower), not a failure.

Beside this script: `planner_references.py` (the plan check, the naive baseline and the
sync-aware reference, with their tables) and `planner_scale_report.py` (the machine's
state, tables, cProfile).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from planaria.templates.analytic import analytic_cost_model, hardware
from planaria.templates.costs import ModelShape
from planaria.templates.job_templates import PlannerSettings
from planaria.templates.planner import Planner

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_references import (  # noqa: E402
    RestrictedPlanner,
    check_plan,
    compare_with_naive,
    compare_with_sync_aware,
)
from machine_load import busy_seconds, cpu_name  # noqa: E402
from planner_scale_report import (  # noqa: E402
    git_state,
    loadavg,
    ms,
    profile_call,
    quantile,
    shape_summary,
    split_summary,
    table,
)

CONFIG = REPO / "configs" / "gpt3-175b.yaml"

SHAPE = ModelShape(n_layers=96, d_model=12288, n_heads=96, vocab_size=51200, seq_len=2048)
DTYPE = "bfloat16"
RECOMPUTE = True
MICRO_BATCH = 1
DEFAULT_SAMPLES = (8, 18, 37, 64, 256, 1024)


# ------------------------------------------------------------------ the job
def make_costs(args):
    hw = hardware(args.hardware, gpus_per_node=args.gpus_per_node)
    return analytic_cost_model(SHAPE, hw, tp=args.gpus_per_node, micro_batch=MICRO_BATCH,
                               dtype=DTYPE, recompute=RECOMPUTE, wide_gradients=True)  # train.exact_reduction


def make_settings(args) -> PlannerSettings:
    return PlannerSettings(fault_tolerance=args.fault_tolerance, global_batch=args.global_batch,
                           micro_batch=MICRO_BATCH, schedule=args.schedule,
                           virtual_stages=args.virtual_stages)


def model_flops_per_token(shape: ModelShape) -> float:
    try:  # the formula `planaria plan` uses (imports torch)
        from planaria.runtime.planning.job_plans import model_flops_per_token as flops
    except ImportError:  # the same formula, for a machine without torch
        return 6 * shape.parameters + 12 * shape.n_layers * shape.d_model * shape.seq_len // 2
    return flops(shape)


def failure_case(planner: Planner, n: int):
    """(running plan for n+1 nodes, the n survivors) when the middle node of n+1 fails."""
    old = planner.instantiate(n + 1).plan
    lost = f"node{(n + 1) // 2}"
    return old, [f"node{i}" for i in range(n + 1) if f"node{i}" != lost]


# ------------------------------------------------------------------ main
def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hardware", default="h100", help="a100, h100, h200 (analytic presets) or cpu")
    p.add_argument("--gpus-per-node", type=int, default=8, help="G; tensor parallelism = G")
    p.add_argument("--fault-tolerance", type=int, default=2, help="f")
    p.add_argument("--min-nodes", type=int, default=8)
    p.add_argument("--max-nodes", type=int, default=1024)
    p.add_argument("--step", type=int, default=1, help="time every step-th N (plus the samples)")
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, zb1f1b or interleaved")
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=1536)
    p.add_argument("--naive-max-nodes", type=int, default=40,
                   help="largest N the exhaustive baseline enumerates (0: none)")
    p.add_argument("--samples", default=",".join(map(str, DEFAULT_SAMPLES)),
                   help="N's whose plans are printed and whose per-N user cost is measured")
    p.add_argument("--limit", type=float, default=1.0, help="seconds per N (the Must-show: 1)")
    p.add_argument("--warm-constructions", type=int, default=5)
    p.add_argument("--replan-step", type=int, default=8,
                   help="time a re-plan after a failure at every step-th N and the samples (0: none)")
    p.add_argument("--profile", action="store_true", help="cProfile the slowest N even if under the limit")
    p.add_argument("--no-cli", action="store_true", help="skip the `planaria plan` subprocess")
    p.add_argument("--json", help="write every figure here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    command = shlex.join(["python", os.path.relpath(__file__, REPO) if Path.cwd() == REPO
                          else __file__, *argv])
    say = lambda *a: print(*a, flush=True)
    say(f"command: {command}")
    say(f"machine: {cpu_name()} | nproc {len(os.sched_getaffinity(0))} | Python "
        f"{platform.python_version()} | planaria {git_state()}")
    say(f"load average before: {loadavg()}")
    result: dict = {"command": command, "machine": {"cpu": cpu_name(), "nproc": len(os.sched_getaffinity(0)),
                                                    "python": platform.python_version()},
                    "git": git_state(), "args": vars(args)}
    problems: list[str] = []  # fail the run: invalid plans, a wrong search result
    findings: list[str] = []  # reported: the planner's pick is valid but not the fastest

    # 1. cost model and templates ------------------------------------------------
    t0 = time.perf_counter()
    costs = make_costs(args)
    cost_model_s = time.perf_counter() - t0
    settings = make_settings(args)
    t0 = time.perf_counter()
    planner = Planner(costs, settings)
    cold_s = time.perf_counter() - t0
    warm = []
    for _ in range(args.warm_constructions):
        t0 = time.perf_counter()
        Planner(costs, settings)
        warm.append(time.perf_counter() - t0)
    warm_s = statistics.median(warm) if warm else cold_s
    hw, f, n0, g = costs.hardware, args.fault_tolerance, planner.n0, args.gpus_per_node
    sizes = sorted(planner.templates)
    say(f"\njob: {SHAPE.n_layers} blocks, d_model {SHAPE.d_model}, {SHAPE.n_heads} heads, vocab "
        f"{SHAPE.vocab_size}, seq_len {SHAPE.seq_len} ({SHAPE.parameters / 1e9:.1f}B parameters, "
        f"{costs.num_layers} planned layers) | {DTYPE}, recompute, micro batch {MICRO_BATCH}, global "
        f"batch {args.global_batch} | {hw.name} x {g} per node, tp {g} | schedule {args.schedule} "
        f"(v={args.virtual_stages}) | f = {f}")
    say(f"cost model (analytic): {ms(cost_model_s)} ms | Planner construction: cold {ms(cold_s)} ms, "
        f"warm median of {len(warm)} {ms(warm_s)} ms")
    say(f"n0 = {n0}; templates of {sizes} nodes; (f+1)·n0 = {(f + 1) * n0}")
    rows = []
    tinfo = []
    for s in sizes:
        part = planner.templates[s].partition
        layers = [b - a for c in range(part.num_stages) for a, b in part.stage_chunks(c)]
        rows.append([str(s), f"{min(layers)}-{max(layers)}", ms(max(part.stage_times)),
                     f"{max(part.peak_memory_bytes) / 2**30:.1f}"])
        tinfo.append({"nodes": s, "layers_per_stage": [min(layers), max(layers)],
                      "bottleneck_stage_s": max(part.stage_times),
                      "peak_memory_bytes": max(part.peak_memory_bytes)})
    say(table(rows, ["template (nodes)", "layers/stage", "slowest stage (ms/microbatch)",
                     f"peak memory (GiB of {hw.device_memory_bytes / 2**30:.1f})"]))
    result.update(cost_model_s=cost_model_s, construction_cold_s=cold_s, construction_warm_s=warm_s,
                  n0=n0, templates=tinfo)

    # 2. instantiate for every N ---------------------------------------------------
    samples = sorted({int(x) for x in args.samples.split(",") if x.strip()})
    first = max(args.min_nodes, n0)
    if first > args.min_nodes:
        say(f"N < n0 = {n0} cannot hold a replica: starting at N = {first}")
    ns = sorted(set(range(first, args.max_nodes + 1, args.step))
                | {n for n in samples if first <= n <= args.max_nodes} | {args.max_nodes})
    say(f"\ninstantiate(N) for {len(ns)} values of N in [{first}, {args.max_nodes}] on one planner "
        "(templates cached, as in a running job)...")
    times: dict[int, float] = {}
    choices: dict[int, object] = {}  # only the samples' plans: keeping 1,000 plans of up to
    picked: dict[int, tuple] = {}  # 1,024 stages alive makes the GC's full passes slow
    busy0, cpu0, wall0 = busy_seconds(), time.process_time(), time.perf_counter()
    refused: dict[int, str] = {}  # N's the planner raised ValueError for
    for n in ns:
        t0 = time.perf_counter()
        try:
            choice = planner.instantiate(n)
        except ValueError as err:
            refused[n] = str(err)
            continue
        times[n] = time.perf_counter() - t0
        problems += check_plan(planner, choice, n)
        picked[n] = (sorted((len(p.stages) for p in choice.plan.pipelines), reverse=True),
                     choice.iteration_time_s, max(choice.pipeline_times_s))
        if n in samples:
            choices[n] = choice
        del choice
        if times[n] > args.limit:
            say(f"  N={n}: {times[n]:.3f} s (over {args.limit:g} s)")
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    if refused:
        say(f"the planner refused {len(refused)} N's: {sorted(refused)[:20]}"
            f"{'...' if len(refused) > 20 else ''}; first reason: {refused[min(refused)]}")
        problems += [f"N={n}: refused: {why}" for n, why in sorted(refused.items())]
        ns = [n for n in ns if n in times]
    if not ns:
        say("no N was planned")
        return 1
    foreign = max(0.0, (busy_seconds() - busy0 - cpu) / (wall * (os.cpu_count() or 1)))
    values = list(times.values())
    worst_n = max(times, key=times.get)
    over = [n for n in ns if times[n] > args.limit]
    user_cost = {n: cold_s + times[n] for n in ns}
    user_over = [n for n in ns if user_cost[n] > args.limit]
    say(f"loop: {wall:.1f} s wall, this process {cpu / wall:.2f} CPU/wall, other processes "
        f"{foreign:.0%} of the CPUs, load average after: {loadavg()}")
    say(f"instantiate: median {ms(statistics.median(values))} ms | p95 {ms(quantile(values, 0.95))} ms "
        f"| max {ms(max(values))} ms at N = {worst_n} | N's over {args.limit:g} s: {len(over)}"
        + (f" (first {over[0]}, {over[:5]}...)" if over else ""))
    say(f"construction (cold) + instantiate, per N: median {ms(statistics.median(user_cost.values()))} ms "
        f"| max {ms(max(user_cost.values()))} ms at N = {max(user_cost, key=user_cost.get)} "
        f"| N's over {args.limit:g} s: {len(user_over)}")
    say(f"plans checked: {len(ns)}; problems: {len(problems)}")
    for line in problems[:20]:
        say(f"  {line}")
    # The search alone (multiset and split, no Plan built): private methods, so skipped
    # if the planner no longer has them.
    search: dict[int, float] = {}
    if hasattr(planner, "_best_multiset") and hasattr(planner, "_split"):
        for n in ns:
            t0 = time.perf_counter()
            planner._split(planner._best_multiset(n)[0])
            search[n] = time.perf_counter() - t0
        svalues = list(search.values())
        say(f"of which the search alone (Planner._best_multiset + _split, timed in a second pass): "
            f"median {ms(statistics.median(svalues))} ms | p95 {ms(quantile(svalues, 0.95))} ms | "
            f"max {ms(max(svalues))} ms at N = {max(search, key=search.get)}")
    buckets = []
    for lo, hi in ((first, 64), (65, 256), (257, 512), (513, args.max_nodes)):
        part = [n for n in ns if lo <= n <= hi]
        if part:
            t = [times[n] for n in part]
            row = [f"{lo}-{hi}", str(len(part)), ms(statistics.median(t)), ms(quantile(t, 0.95)),
                   ms(max(t)), str(sum(x > args.limit for x in t))]
            if search:
                row += [ms(statistics.median(search[n] for n in part)), ms(max(search[n] for n in part))]
            buckets.append(row)
    say(table(buckets, ["N range", "N's", "median (ms)", "p95 (ms)", "max (ms)", f"over {args.limit:g} s",
                        *(["search median (ms)", "search max (ms)"] if search else [])]))
    result["instantiate"] = {
        "n_values": len(ns), "median_s": statistics.median(values), "p95_s": quantile(values, 0.95),
        "max_s": max(values), "max_at": worst_n, "over_limit": over, "limit_s": args.limit,
        "loop_wall_s": wall, "cpu_per_wall": cpu / wall, "other_processes_cpu_share": foreign,
        "per_n": {str(n): times[n] for n in ns},
        "user_cost_max_s": max(user_cost.values()), "user_cost_over_limit": user_over,
        "problems": problems, "refused": {str(n): why for n, why in refused.items()},
        "search_per_n": {str(n): search[n] for n in search},
    }

    # 3. sample plans and the per-N cost without a cached planner ------------------
    flops_token = model_flops_per_token(SHAPE)
    tokens = args.global_batch * SHAPE.seq_len
    sample_ns = [n for n in samples if n in choices]
    say(f"\nsample plans (tokens/s = {args.global_batch} x {SHAPE.seq_len} / iteration; MFU = "
        f"{flops_token:.4g} FLOP/token x tokens / (iteration x N·G x {hw.peak_flops:.3g} FLOP/s))")
    rows, sample_info = [], []
    for n in sample_ns:
        c = choices[n]
        psizes = [len(p.stages) for p in c.plan.pipelines]
        counts = [p.num_microbatches for p in c.plan.pipelines]
        tps = tokens / c.iteration_time_s
        mfu = flops_token * tokens / (c.iteration_time_s * n * g * hw.peak_flops)
        rows.append([str(n), shape_summary(psizes), split_summary(psizes, counts),
                     f"{c.iteration_time_s:.2f}", f"{tps:,.0f}", f"{mfu:.1%}",
                     "yes" if c.degraded else "", ms(times[n])])
        sample_info.append({"n": n, "pipelines": psizes, "microbatches": counts,
                            "iteration_time_s": c.iteration_time_s, "tokens_per_s": tps, "mfu": mfu,
                            "degraded": c.degraded, "instantiate_s": times[n]})
    say(table(rows, ["N", "pipelines × stages", "microbatches per pipeline", "iteration (s)",
                     "tokens/s", "MFU", "degraded", "instantiate (ms)"], right={0, 3, 4, 5, 7}))

    say("\nper-N cost without a cached planner, measured at the sample N's:")
    rows = []
    plan_job_fn = cfg = None
    try:
        from planaria.runtime.config.loading import load_config
        from planaria.runtime.config.sections import model_shape
        from planaria.runtime.planning.job_plans import cost_model as cost_model_fn, plan_job as plan_job_fn

        cfg = load_config(CONFIG, [f"train.global_batch={args.global_batch}",
                                   f"train.micro_batch={MICRO_BATCH}", f"train.dtype={DTYPE}",
                                   f"train.recompute={str(RECOMPUTE).lower()}",
                                   f"parallel.schedule={args.schedule}",
                                   f"parallel.virtual_stages={args.virtual_stages}"])
        if model_shape(cfg.model) != SHAPE:
            problems.append(f"{CONFIG.name} describes {model_shape(cfg.model)}, not {SHAPE}")
    except ImportError as err:
        say(f"  (plan_job skipped: {err})")
    for n in sample_ns:
        t0 = time.perf_counter()
        fresh = Planner(costs, settings)
        built = time.perf_counter() - t0
        c = fresh.instantiate(n)
        fresh_s = time.perf_counter() - t0
        if abs(c.iteration_time_s - choices[n].iteration_time_s) > 1e-9 * choices[n].iteration_time_s:
            problems.append(f"N={n}: a fresh planner chose {c.iteration_time_s} s, the cached one "
                            f"{choices[n].iteration_time_s} s")
        row = [str(n), ms(built), ms(fresh_s - built), ms(fresh_s)]
        info = {"n": n, "construct_s": built, "instantiate_s": fresh_s - built, "total_s": fresh_s}
        if plan_job_fn is not None:
            t0 = time.perf_counter()
            # What `planaria plan` runs: the cost model, then the planner.
            costs = cost_model_fn(cfg, hardware_name=args.hardware, gpus_per_node=g)
            report = plan_job_fn(cfg, costs, nodes=n, fault_tolerance=f)
            job_s = time.perf_counter() - t0
            if abs(report.choice.iteration_time_s - choices[n].iteration_time_s) > \
                    1e-9 * choices[n].iteration_time_s:
                problems.append(f"N={n}: plan_job's iteration time {report.choice.iteration_time_s} "
                                f"differs from this benchmark's {choices[n].iteration_time_s}")
            row.append(ms(job_s))
            info["plan_job_s"] = job_s
        rows.append(row)
        sample_info[[s["n"] for s in sample_info].index(n)]["fresh"] = info
    header = ["N", "Planner() (ms)", "instantiate (ms)", "together (ms)"]
    if plan_job_fn is not None:
        header.append("plan_job in-process (ms)")
    say(table(rows, header))
    result["samples"] = sample_info

    if not args.no_cli and plan_job_fn is not None:
        n = args.max_nodes
        cli = ["planaria", "plan", os.path.relpath(CONFIG, REPO), f"train.global_batch={args.global_batch}",
               f"parallel.schedule={args.schedule}", f"parallel.virtual_stages={args.virtual_stages}",
               "--nodes", str(n), "--gpus-per-node", str(g), "--hardware", args.hardware,
               "--fault-tolerance", str(f), "--json"]
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "planaria.cli", *cli[1:]], check=False, cwd=REPO,
                              capture_output=True, text=True, timeout=600)
        cli_s = time.perf_counter() - t0
        if proc.returncode == 0:
            planned = json.loads(proc.stdout)["planning_time_s"]
            say(f"`{shlex.join(cli)}`: {cli_s:.2f} s wall in a fresh process, of which the planner "
                f"(construction + instantiate, its planning_time_s) {planned:.3f} s")
            result["cli"] = {"command": shlex.join(cli), "wall_s": cli_s, "planning_time_s": planned}
        else:
            problems.append(f"`{shlex.join(cli)}` exited {proc.returncode}: {proc.stderr[-500:]}")

    # 4. re-plan after a failure ---------------------------------------------------
    replan_times: dict[int, float] = {}
    replan_over: list[int] = []
    if args.replan_step and "current" in inspect.signature(planner.instantiate).parameters:
        rns = [n for n in ns if n % args.replan_step == 0 or n in samples]
        say(f"\nre-plan after one failure, for {len(rns)} N's (every {args.replan_step}th and the "
            "samples): instantiate(N, survivors, current=plan for N+1 nodes), the middle node "
            "of the N+1 lost")
        replan = []
        for n in rns:
            try:
                old, survivors = failure_case(planner, n)
                t0 = time.perf_counter()
                c = planner.instantiate(n, survivors, current=old)
            except ValueError as err:
                problems.append(f"N={n}: re-plan refused: {err}")
                continue
            replan_times[n] = time.perf_counter() - t0
            problems += check_plan(planner, c, n, survivors)
            replan.append({"n": n, "time_s": replan_times[n], "moved_bytes": getattr(c, "moved_bytes", None),
                           "pipelines": sorted((len(p.stages) for p in c.plan.pipelines), reverse=True),
                           "iteration_time_s": c.iteration_time_s})
            del old, c
        replan_over = [n for n in replan_times if replan_times[n] > args.limit]
        rvalues = list(replan_times.values()) or [float("nan")]
        worst_replan = max(replan_times, key=replan_times.get, default=None)
        say(f"re-plan: median {ms(statistics.median(rvalues))} ms | p95 {ms(quantile(rvalues, 0.95))} ms "
            f"| max {ms(max(rvalues))} ms at N = {worst_replan} | N's over {args.limit:g} s: "
            f"{len(replan_over)}" + (f" (from N = {replan_over[0]})" if replan_over else ""))
        rows = []
        for r in replan:
            if r["n"] in samples:
                moved = r["moved_bytes"]
                rows.append([str(r["n"]), ms(r["time_s"]), shape_summary(r["pipelines"]),
                             f"{r['iteration_time_s']:.2f}",
                             "" if moved is None else f"{moved / 1e9:,.1f}"])
        say(table(rows, ["N", "re-plan (ms)", "pipelines × stages", "iteration (s)",
                         "state moved (GB)"], right={0, 1, 3, 4}))
        result["replan"] = {"per_n": replan, "over_limit": replan_over, "max_s": max(rvalues),
                            "max_at": worst_replan, "median_s": statistics.median(rvalues)}

    # 5. naive baseline --------------------------------------------------------------
    naive_ns = [n for n in ns if n <= args.naive_max_nodes]
    if naive_ns:
        result["naive"] = compare_with_naive(planner, naive_ns, sizes, picked, times, findings,
                                             args.naive_max_nodes, say)

    if sample_ns and hasattr(planner, "_best_multiset") and hasattr(planner, "_sync_time"):
        result["sync_aware"] = compare_with_sync_aware(RestrictedPlanner(costs, settings), sample_ns, choices,
                                                       findings, say)

    # 6. profile ------------------------------------------------------------------------
    if over or user_over or args.profile:
        say(f"\nslowest N = {worst_n} ({times[worst_n]:.3f} s):")
        text = profile_call(f"instantiate({worst_n})", lambda: planner.instantiate(worst_n))
        say(text)
        result["profile"] = text
    if replan_times and (replan_over or args.profile):
        target = max(replan_times, key=replan_times.get)
        old, survivors = failure_case(planner, target)
        say(f"\nslowest re-plan, N = {target} ({replan_times[target]:.3f} s):")
        text = profile_call(f"instantiate({target}, survivors, current=plan for {target + 1})",
                            lambda: planner.instantiate(target, survivors, current=old))
        say(text)
        result["profile_replan"] = text

    result["problems"] = problems
    result["findings"] = findings
    ok = not problems and not over and not user_over and not replan_over
    say(f"\nverdict: {'PASS' if ok else 'FAIL'}: {len(ns)} N's planned; over {args.limit:g} s: "
        f"{len(over)} (instantiate), {len(user_over)} (with a cold construction), "
        f"{len(replan_over)} of {len(replan_times)} (re-plan after a failure); "
        f"{len(problems)} problem(s); {len(findings)} finding(s) of a faster iteration than "
        "the planner's (naive baseline or sync-aware reference)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        say(f"figures written to {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
