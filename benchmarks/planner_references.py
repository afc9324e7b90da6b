"""What `planner_scale.py` checks the planner against: the invariants of every plan, a
naive planner that enumerates every multiset of template sizes (with the planner's own
split and gradient-sync estimate), and a sync-aware reference (the planner's own search
restricted to each class of gradient-sync cost); and the tables that compare them with
the planner's picks (the script's section 5, described in its docstring).

A module of the benchmark script, imported from the benchmarks folder as
`cost_model_accuracy.py` imports `step_time.py`.
"""
from __future__ import annotations

import math
import statistics
import time

from planaria.templates.planner import Planner
from planner_scale_report import ms, shape_summary, table

EXTRAPOLATE_AT = (64, 128, 256, 512, 1024)


def check_plan(planner: Planner, choice, n: int, node_ids: list[str] | None = None) -> list[str]:
    """What is wrong with the plan for n nodes, on top of Plan's own validation."""
    plan, settings = choice.plan, planner.settings
    f, n0, g = settings.fault_tolerance, planner.n0, planner.costs.tp
    node_ids = node_ids or [f"node{i}" for i in range(n)]
    problems = []
    nodes = [stage.node for p in plan.pipelines for stage in p.stages]
    if sorted(nodes) != sorted(node_ids) or len(set(nodes)) != n:
        problems.append(f"N={n}: plan uses {len(set(nodes))} distinct of {len(nodes)} stage nodes, "
                        f"not each of the {n} nodes once")
    if plan.world_size != n * g:
        problems.append(f"N={n}: world size {plan.world_size} != N·G = {n * g}")
    k = len(plan.pipelines)
    if n >= (f + 1) * n0 and k < f + 1:
        problems.append(f"N={n}: {k} pipelines < f+1 = {f + 1} although N ≥ (f+1)·n0 = {(f + 1) * n0}")
    if choice.replicas != k:
        problems.append(f"N={n}: choice.replicas {choice.replicas} != {k} pipelines")
    if choice.degraded != (n < (f + 1) * n0):
        problems.append(f"N={n}: degraded={choice.degraded} but N {'<' if n < (f + 1) * n0 else '≥'} "
                        f"(f+1)·n0 = {(f + 1) * n0}")
    total = sum(p.num_microbatches for p in plan.pipelines)
    if total != settings.total_microbatches:
        problems.append(f"N={n}: microbatches sum to {total}, not {settings.total_microbatches}")
    odd = sorted({len(p.stages) for p in plan.pipelines} - set(planner.templates))
    if odd:
        problems.append(f"N={n}: pipelines of {odd} stages are no template")
    if not (math.isfinite(choice.iteration_time_s) and choice.iteration_time_s > 0):
        problems.append(f"N={n}: iteration time {choice.iteration_time_s}")
    return problems


def multisets(n: int, sizes: list[int], min_parts: int):
    """Every multiset of `sizes` summing to n with at least min_parts parts, largest first."""
    sizes = sorted(sizes, reverse=True)

    def rec(left: int, start: int, acc: list[int]):
        if left == 0:
            if len(acc) >= min_parts:
                yield list(acc)
            return
        for i in range(start, len(sizes)):
            if sizes[i] <= left:
                acc.append(sizes[i])
                yield from rec(left - sizes[i], i, acc)
                acc.pop()

    yield from rec(n, 0, [])


def count_multisets(n: int, sizes: list[int], min_parts: int) -> int:
    """How many multisets `multisets` would enumerate (a DP over node counts)."""
    cap = max(1, min_parts)
    ways = [[0] * (cap + 1) for _ in range(n + 1)]  # ways[m][k]: k parts (capped) summing to m
    ways[0][0] = 1
    for s in sorted(sizes):  # one size at a time: multisets, not sequences
        for m in range(s, n + 1):
            for k in range(cap + 1):
                if ways[m - s][k]:
                    ways[m][min(k + 1, cap)] += ways[m - s][k]
    return sum(ways[n][k] for k in range(min_parts, cap + 1)) if min_parts else sum(ways[n])


def naive_plan(planner: Planner, n: int, sizes: list[int]) -> dict:
    """Exhaustive enumeration with the planner's split and sync.

    Keeps two winners: the multiset with the smallest iteration time (slowest pipeline
    plus gradient sync, what the planner reports) and the one with the smallest
    slowest pipeline alone (what the planner's deadline search minimises).
    """
    want = min(planner.settings.fault_tolerance + 1, n // planner.n0)
    best = fastest = None
    seen = 0
    started = time.perf_counter()
    for combo in multisets(n, [s for s in sizes if s <= n], want):
        seen += 1
        try:
            counts = planner._split(combo)
        except ValueError:  # no count per pipeline that the schedule accepts
            continue
        slowest = max(planner.template(s).iteration_time(m) for s, m in zip(combo, counts))
        t = slowest + planner._sync_time(combo)
        if best is None or t < best[0]:
            best = (t, combo, counts)
        if fastest is None or slowest < fastest[0]:
            fastest = (slowest, combo)
    elapsed = time.perf_counter() - started
    if best is None:
        return {"n": n, "multisets": 0, "time_s": elapsed, "iteration_time_s": None, "sizes": None,
                "slowest_pipeline_s": None}
    return {"n": n, "multisets": seen, "time_s": elapsed, "iteration_time_s": best[0],
            "sizes": best[1], "counts": best[2], "slowest_pipeline_s": fastest[0],
            "slowest_pipeline_sizes": fastest[1]}


class RestrictedPlanner(Planner):
    """The planner's own search over a subset of its template sizes (`allowed`)."""

    allowed: frozenset[int] | None = None

    def _sizes_for(self, num_nodes: int) -> list[int]:
        sizes = super()._sizes_for(num_nodes)
        return [s for s in sizes if self.allowed is None or s in self.allowed]


def sync_aware_plan(restricted: RestrictedPlanner, n: int) -> dict | None:
    """The best iteration time (slowest pipeline + sync) over sync classes.

    The planner's search minimises the slowest pipeline; the gradient sync it adds
    afterwards grows with the largest stage of the templates used (fewer nodes per
    pipeline, more layers per stage). For each template's sync cost w, search only the
    templates whose sync is at most w, then add the sync: the best of these is at
    least as good as the planner's pick (the last class is all templates).
    """
    sizes = sorted(restricted.templates)
    sync = {s: restricted._sync_time([s, s]) for s in sizes}  # proportional to the largest stage
    best = None
    for w in sorted(set(sync.values())):
        restricted.allowed = frozenset(s for s in sizes if sync[s] <= w)
        if min(restricted.allowed) > n:
            continue
        try:
            combo, _ = restricted._best_multiset(n)
            counts = restricted._split(combo)
        except ValueError:  # no multiset of these sizes uses n nodes, or no schedulable split
            continue
        slowest = max(restricted.template(s).iteration_time(m) for s, m in zip(combo, counts))
        t = slowest + restricted._sync_time(combo)
        if best is None or t < best["iteration_time_s"]:
            best = {"iteration_time_s": t, "sizes": combo, "slowest_pipeline_s": slowest}
    restricted.allowed = None
    return best


def compare_with_naive(planner: Planner, naive_ns: list[int], sizes: list[int], picked: dict[int, tuple],
                       times: dict[int, float], findings: list[str], naive_max_nodes: int, say) -> dict:
    """Section 5 of planner_scale.py: the naive baseline at every N of `naive_ns`, side by
    side with the planner's pick (`picked`: sizes, iteration time, slowest pipeline) and
    time (`times`), and the naive time extrapolated beyond `naive_max_nodes`. Appends to
    `findings` where the naive pick is faster; returns the figures."""
    f, n0 = planner.settings.fault_tolerance, planner.n0
    say(f"\nbaseline: every multiset of template sizes {sizes} summing to N, the planner's "
        f"greedy split and sync, fastest kept; N = {naive_ns[0]}..{naive_ns[-1]}")
    rows, naive = [], []
    per_multiset = []
    for n in naive_ns:
        b = naive_plan(planner, n, sizes)
        msizes, miter, mslow = picked[n]
        tol = 1e-9 * miter
        same_slowest = (b["slowest_pipeline_s"] is not None
                        and abs(b["slowest_pipeline_s"] - mslow) <= tol)
        same = (b["iteration_time_s"] is not None
                and abs(b["iteration_time_s"] - miter) <= tol)
        # Not a problem when they differ: the planner minimises the iteration with the
        # gradient sync, which may take a slightly slower slowest pipeline (N=21: 3×7
        # rather than 8+7+6, whose sync over more distinct cuts costs more).
        gap = (miter / b["iteration_time_s"] - 1 if b["iteration_time_s"]
               else float("nan"))
        if not same and b["sizes"]:
            bsync = planner._sync_time(b["sizes"])
            findings.append(
                f"N={n}: planner {shape_summary(msizes)} {miter:.4f} s = slowest "
                f"pipeline {mslow:.4f} + sync {miter - mslow:.4f}; naive "
                f"{shape_summary(b['sizes'])} {b['iteration_time_s']:.4f} s = "
                f"{b['iteration_time_s'] - bsync:.4f} + {bsync:.4f}; planner {gap:+.3%}")
        if b["multisets"]:
            per_multiset.append(b["time_s"] / b["multisets"])
        ratio = b["time_s"] / times[n]
        naive.append({**b, "planner_iteration_time_s": miter,
                      "planner_slowest_pipeline_s": mslow, "planner_sizes": msizes,
                      "planner_s": times[n], "equal": same, "equal_slowest_pipeline": same_slowest,
                      "planner_gap": gap, "ratio": ratio})
        rows.append([str(n), str(b["multisets"]), shape_summary(b["sizes"] or []),
                     f"{b['iteration_time_s']:.4f}" if b["iteration_time_s"] else "-",
                     shape_summary(msizes), f"{miter:.4f}",
                     "yes" if same else f"{gap:+.3%}", "yes" if same_slowest else "no",
                     ms(b["time_s"]), ms(times[n]), f"{ratio:.2f}"])
    say(table(rows, ["N", "multisets", "naive pick", "naive iter (s)", "planner pick",
                     "planner iter (s)", "iter equal", "slowest pipeline equal", "naive (ms)",
                     "planner (ms)", "naive/planner"],
              right={0, 1, 3, 5, 6, 8, 9, 10}))
    ratios = [r["ratio"] for r in naive]
    equal = sum(r["equal"] for r in naive)
    equal_slowest = sum(r["equal_slowest_pipeline"] for r in naive)
    say(f"equal iteration time at {equal} of {len(naive)} N's; equal slowest pipeline (without "
        f"the sync, not the objective) at {equal_slowest} of {len(naive)}; naive / planner time: "
        f"median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}x-{max(ratios):.2f}x")
    for line in findings:
        say(f"  {line}")
    cost = statistics.median(per_multiset) if per_multiset else float("nan")
    extrapolated = []
    for n in EXTRAPOLATE_AT:
        if n <= naive_max_nodes or n < n0:
            continue
        want = min(f + 1, n // n0)
        count = count_multisets(n, [s for s in sizes if s <= n], want)
        extrapolated.append({"n": n, "multisets": count, "naive_s_extrapolated": count * cost,
                             "planner_s": times.get(n)})
    if extrapolated:
        say(f"naive beyond N = {naive_max_nodes}, counted not run: multisets x "
            f"{ms(cost)} ms (its median cost per multiset above)")
        say(table([[str(e["n"]), f"{e['multisets']:,}", f"{e['naive_s_extrapolated']:,.1f}",
                    ms(e["planner_s"]) if e["planner_s"] is not None else "-"]
                   for e in extrapolated],
                  ["N", "multisets", "naive (s, extrapolated)", "planner (ms, measured)"]))
    return {"per_n": naive, "per_multiset_s": cost, "extrapolated": extrapolated}


def compare_with_sync_aware(restricted: RestrictedPlanner, sample_ns: list[int], choices: dict,
                            findings: list[str], say) -> list[dict]:
    """The sync-aware reference at the sample N's, side by side with the planner's choice
    (`choices`). Appends to `findings` where the reference is faster; returns the figures."""
    say("\nsync-aware reference at the sample N's: for each template's gradient-sync cost w, the "
        "planner's own search over the templates whose sync is ≤ w, plus the sync; the best kept")
    rows, aware = [], []
    for n in sample_ns:
        ref = sync_aware_plan(restricted, n)
        c = choices[n]
        if ref is None:
            continue
        gap = c.iteration_time_s / ref["iteration_time_s"] - 1
        psizes = [len(p.stages) for p in c.plan.pipelines]
        mslow = max(c.pipeline_times_s)
        rows.append([str(n), shape_summary(psizes), f"{mslow:.3f}", f"{c.iteration_time_s - mslow:.3f}",
                     f"{c.iteration_time_s:.3f}", shape_summary(ref["sizes"]),
                     f"{ref['slowest_pipeline_s']:.3f}",
                     f"{ref['iteration_time_s'] - ref['slowest_pipeline_s']:.3f}",
                     f"{ref['iteration_time_s']:.3f}", f"{gap:+.2%}"])
        aware.append({"n": n, **ref, "planner_iteration_time_s": c.iteration_time_s,
                      "planner_sizes": psizes, "planner_gap": gap})
        if gap > 1e-9:
            findings.append(f"N={n}: planner {shape_summary(psizes)} {c.iteration_time_s:.4f} s; "
                            f"sync-aware {shape_summary(ref['sizes'])} {ref['iteration_time_s']:.4f} s; "
                            f"planner {gap:+.3%}")
    say(table(rows, ["N", "planner pick", "slowest (s)", "sync (s)", "iteration (s)", "sync-aware pick",
                     "slowest (s)", "sync (s)", "iteration (s)", "planner slower by"],
              right={0, 2, 3, 4, 6, 7, 8, 9}))
    return aware
