"""Accuracy of the profiled cost model: its predicted iteration time against the step
time measured by training the same plan with torchrun on this machine.

    python benchmarks/cost_model_accuracy.py [--steps 25] [--warmup 5] [--repeats 3]
                                             [--cases NAME,...] [--json out.json]

Cases (every one 2 processes, pp=2, synthetic data, float32, OMP_NUM_THREADS=1):
  tiny 1f1b, tiny interleaved v=2     configs/tiny.yaml (4 blocks, d_model 64, seq 64,
                                      batch 8 = 4 microbatches of 2)
  larger 1f1b, larger interleaved v=2 8 blocks, d_model 256, seq 128, batch 16 = 8
                                      microbatches of 2

For every case and repeat:
  (i)   the plan, exactly as the trainer builds it: `plan_from_config(cfg, world_size=2)`;
  (ii)  a fresh profile: `profile_model(cfg, num_threads=1, concurrent_workers=2)` (the
        trainer's workers run with OMP_NUM_THREADS=1, two of them on this machine's two
        cores: the layers are timed beside a process computing a block), which also
        measures gloo between two processes;
  (iii) the prediction: the plan's own layer ranges (not a fresh partition) evaluated by
        `evaluate_partition` into a `StagePartition`; its schedule replayed 200 times
        with message costs drawn from their measured spread (`replay_iteration_time`),
        the mean. Also reported: the closed form the planner ranks plans by
        (`StagePartition.iteration_time(m)`: the schedule's formula over stage times,
        layers plus the per-microbatch message work at every boundary, the sends on the
        first microbatch's path, the slowest stage's parameter update and the commit);
  (iv)  the measurement: `torchrun --standalone --nproc-per-node=2 -m planaria.train`,
        step_time_s from metrics.jsonl, the median of the steps after the warm-up.
Reported per case: the median over repeats of the measurements and of the predictions,
the error (predicted - measured) / measured, the median of the per-repeat errors, and
what the cost model predicted before it counted anything but layer compute ("before":
`profile_model(..., statistic="median", measure_links=False)`, update and messages
left out, the "cpu" preset's raw-TCP link), and the prediction's parts.

The machine is shared: before each run the script waits (up to --wait-quiet s) for the
other processes to use under --quiet of the CPUs, measures how much they used during the
run, and runs it again (up to --retries times) when that was more.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from planaria.chaos.report import write_json_atomically

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine_load import busy_seconds, children_seconds, cpu_name, wait_quiet  # noqa: E402

CONFIG = REPO / "configs" / "tiny.yaml"
COMMON = ["data.source=synthetic", "train.dtype=float32", "train.recompute=false",
          "parallel.tp=1", "parallel.pp=2", "comm.backend=gloo",
          "output.save_final=false", "train.log_every=1000000"]
LARGER = ["model.n_layers=8", "model.d_model=256", "model.n_heads=4", "model.seq_len=128",
          "train.global_batch=16", "train.micro_batch=2"]
ONE_F_ONE_B = ["parallel.schedule=1f1b", "parallel.virtual_stages=1"]
INTERLEAVED = ["parallel.schedule=interleaved", "parallel.virtual_stages=2"]
CASES = {
    "tiny 1f1b": [*COMMON, *ONE_F_ONE_B],
    "tiny interleaved v=2": [*COMMON, *INTERLEAVED],
    "larger 1f1b": [*COMMON, *LARGER, *ONE_F_ONE_B],
    "larger interleaved v=2": [*COMMON, *LARGER, *INTERLEAVED],
}
WORLD = 2


@dataclass
class Prediction:
    total_s: float
    """The expected iteration time: the schedule replayed with message costs drawn from
    their measured spread (`planaria.templates.replay`)."""
    formula_s: float
    """`StagePartition.iteration_time`, the planner's closed form (mean message costs)."""
    layers_s: float
    """The schedule's formula over layer compute and the sends of the first path."""
    messages_s: float
    """Added by the per-microbatch message work at the boundaries."""
    runtime_s: float
    """Added by the pipeline runtime's own work per action (`Hardware.action_overhead_s`)."""
    update_s: float
    commit_s: float
    stage_times_s: tuple[float, ...]


def predict(plan, costs) -> Prediction:
    """The plan's iteration time from the cost model, through StagePartition.iteration_time."""
    from planaria.templates.costs import CostModel
    from planaria.templates.partition_cost import evaluate_partition
    from planaria.templates.replay import replay_iteration_time

    if len(plan.pipelines) != 1:
        raise ValueError("the benchmark's cases have one pipeline; several would add the "
                         "planner's gradient sync across pipelines")
    pipeline = plan.pipelines[0]
    S, v, m = len(pipeline.stages), plan.virtual_stages, pipeline.num_microbatches
    ranges = [pipeline.stages[j % S].chunks[j // S] for j in range(S * v)]

    def time_with(model: CostModel):
        part = evaluate_partition(model, ranges, S, num_microbatches=m, schedule=plan.schedule,
                                  virtual_stages=v)
        return part, part.iteration_time(m)

    hw = costs.hardware
    bare_layers = tuple(replace(layer, optimizer_s=0.0) for layer in costs.layers)
    bare_hw = replace(hw, message_overhead_s=0.0, collective_latency_s=0.0, action_overhead_s=0.0)
    _, layers = time_with(replace(costs, layers=bare_layers, hardware=bare_hw))
    _, with_messages = time_with(replace(costs, layers=bare_layers, hardware=replace(
        hw, collective_latency_s=0.0, action_overhead_s=0.0)))
    _, with_runtime = time_with(replace(costs, layers=bare_layers,
                                        hardware=replace(hw, collective_latency_s=0.0)))
    part, formula = time_with(costs)
    update = max(part.update_times, default=0.0)
    replayed = replay_iteration_time(costs, part, m).mean_s
    return Prediction(total_s=replayed, formula_s=formula, layers_s=layers, messages_s=with_messages - layers,
                      runtime_s=with_runtime - with_messages,
                      update_s=update, commit_s=part.fixed_time_s, stage_times_s=part.stage_times)


def predict_before(plan, costs_before) -> float:
    """What the cost model predicted before it counted updates, messages and the commit."""
    bare = replace(costs_before, layers=tuple(replace(l, optimizer_s=0.0) for l in costs_before.layers),
                   hardware=replace(costs_before.hardware, message_overhead_s=0.0,
                                    collective_latency_s=0.0, action_overhead_s=0.0))
    return predict(plan, bare).formula_s


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def train_command(overrides: list[str], steps: int, out_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={WORLD}", "-m", "planaria.train", str(CONFIG), *overrides,
            f"train.steps={steps}", f"output.dir={out_dir}"]


def measure(overrides: list[str], steps: int, warmup: int, out_dir: Path,
            timeout: float) -> tuple[float, float, list[float]]:
    """(median step time after the warm-up, share of the CPUs others used, all step times)."""
    cmd = train_command(overrides, steps, out_dir)
    busy0, ours0, t0 = busy_seconds(), children_seconds(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(),
                          cwd=REPO)
    wall = time.perf_counter() - t0
    foreign = (busy_seconds() - busy0 - (children_seconds() - ours0)) / (wall * (os.cpu_count() or 1))
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}\n--- stdout\n"
                           f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records]
    if len(times) <= warmup:
        raise RuntimeError(f"only {len(times)} steps recorded, warm-up is {warmup}")
    return statistics.median(times[warmup:]), max(0.0, foreign), times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=25, help="training steps per run (default 25)")
    parser.add_argument("--warmup", type=int, default=5, help="steps dropped before the median (default 5)")
    parser.add_argument("--repeats", type=int, default=3, help="profile + run pairs per case (default 3)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated subset of: {', '.join(CASES)}")
    parser.add_argument("--quiet", type=float, default=0.10,
                        help="a run during which other processes used more than this share of "
                             "the CPUs is run again (default 0.10)")
    parser.add_argument("--retries", type=int, default=2, help="reruns of a busy or failed run (default 2)")
    parser.add_argument("--wait-quiet", type=float, default=60,
                        help="before each profile and run, wait up to this many seconds for a quiet machine")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per training run (default 600)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; valid: {list(CASES)}")
    return drive(args, names)


def drive(args, names: list[str]) -> int:
    import platform

    import torch

    from planaria.runtime.config.loading import load_config
    from planaria.runtime.config.validation import plan_from_config

    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"torch {torch.__version__} | python {platform.python_version()} | {cpu_name()} | "
          f"{os.cpu_count()} logical CPUs | every worker OMP_NUM_THREADS=1")
    cases = {}
    for name in names:
        cfg = load_config(CONFIG, CASES[name])
        plan = plan_from_config(cfg, world_size=WORLD)
        pipeline = plan.pipelines[0]
        layout = " / ".join(",".join(f"{a}-{b - 1}" for a, b in s.chunks) for s in pipeline.stages)
        cases[name] = (cfg, plan, layout)
        print(f"[{name}] plan: stages {layout} (layers), {pipeline.num_microbatches} "
              f"microbatches, schedule {plan.schedule} v={plan.virtual_stages}")
        print(f"  run: OMP_NUM_THREADS=1 "
              f"{shlex.join(train_command(CASES[name], args.steps, Path('OUT')))}")
    rows: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="planaria-costacc-") as tmp:
        # Round-robin over the cases, so a slow spell of the machine hits all of them.
        for r in range(args.repeats):
            for name in names:
                cfg, plan, _ = cases[name]
                rows[name].append(one_repeat(args, name, cfg, plan, r, Path(tmp)))
    results = {}
    for name in names:
        _, plan, layout = cases[name]
        med = {k: statistics.median(row[k] for row in rows[name])
               for k in ("measured_s", "predicted_s", "formula_s", "before_s", "layers_s", "messages_s",
                         "runtime_s", "update_s", "commit_s")}
        med["error"] = med["predicted_s"] / med["measured_s"] - 1
        med["before_error"] = med["before_s"] / med["measured_s"] - 1
        med["formula_error"] = med["formula_s"] / med["measured_s"] - 1
        med["paired_error"] = statistics.median(row["predicted_s"] / row["measured_s"] - 1
                                                for row in rows[name])
        results[name] = {"plan": layout, "microbatches": plan.pipelines[0].num_microbatches,
                         "median": med, "repeats": rows[name]}
    print_table(results)
    if args.json:
        write_json_atomically(Path(args.json), results)
    return 0 if all(abs(r["median"]["error"]) <= 0.15 for r in results.values()) else 1


def one_repeat(args, name: str, cfg, plan, r: int, tmp: Path) -> dict:
    """Profile, predict, then train and measure (again if the machine was busy)."""
    from planaria.runtime.planning.measured_costs import profile_model
    from planaria.runtime.planning import pipeline_probe

    wait_quiet(args.quiet, args.wait_quiet)
    pipeline_probe.forget_measurements()  # fresh links for every repeat
    costs = profile_model(cfg, num_threads=1, concurrent_workers=WORLD)
    before = predict_before(plan, profile_model(cfg, num_threads=1, statistic="median",
                                                repeats=5, measure_links=False))
    pred = predict(plan, costs)
    for attempt in range(args.retries + 1):
        waited = wait_quiet(args.quiet, args.wait_quiet)
        out_dir = tmp / f"{name.replace(' ', '_')}-{r}-{attempt}"
        try:
            measured, foreign, times = measure(CASES[name], args.steps, args.warmup, out_dir,
                                               args.timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            tail = [line for line in str(err).splitlines() if line.strip()][-3:]
            print(f"  [{name}] repeat {r + 1}: run failed; "
                  f"{'again' if attempt < args.retries else 'giving up'}: " + " / ".join(tail))
            if attempt == args.retries:
                raise
            continue
        busy = foreign > args.quiet
        print(f"  [{name}] repeat {r + 1}: measured {measured * 1e3:8.2f} ms, predicted "
              f"{pred.total_s * 1e3:8.2f} ms ({(pred.total_s / measured - 1) * 100:+.1f}%), "
              f"before {before * 1e3:8.2f} ms | others used {foreign * 100:.1f}% of the CPUs"
              f"{f'; waited {waited:.0f} s' if waited >= 2 else ''}"
              f"{' (busy, run again)' if busy and attempt < args.retries else ''}", flush=True)
        if not busy or attempt == args.retries:
            break
    hw = costs.hardware
    return {"measured_s": measured, "foreign_cpu": foreign, "step_times_s": times,
            "predicted_s": pred.total_s, "formula_s": pred.formula_s, "before_s": before, "layers_s": pred.layers_s,
            "messages_s": pred.messages_s, "runtime_s": pred.runtime_s, "update_s": pred.update_s, "commit_s": pred.commit_s,
            "stage_times_s": list(pred.stage_times_s),
            "link": {"latency_s": hw.link_latency_s, "bandwidth": hw.inter_node_bandwidth,
                     "message_overhead_s": hw.message_overhead_s,
                     "collective_latency_s": hw.collective_latency_s,
                     "action_overhead_s": hw.action_overhead_s}}


def print_table(results: dict[str, dict]) -> None:
    print("\n| case | stages (layers) | m | measured (ms) | predicted (ms) | error | "
          "per-repeat error (median) | formula (ms) | formula error | before (ms) | "
          "before error | layers + sends | messages | runtime | update | commit |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        m = r["median"]
        print(f"| {name} | {r['plan']} | {r['microbatches']} | {m['measured_s'] * 1e3:.1f} | "
              f"{m['predicted_s'] * 1e3:.1f} | {m['error'] * 100:+.1f}% | "
              f"{m['paired_error'] * 100:+.1f}% | {m['formula_s'] * 1e3:.1f} | "
              f"{m['formula_error'] * 100:+.1f}% | {m['before_s'] * 1e3:.1f} | "
              f"{m['before_error'] * 100:+.1f}% | {m['layers_s'] * 1e3:.1f} | "
              f"{m['messages_s'] * 1e3:.1f} | {m['runtime_s'] * 1e3:.1f} | {m['update_s'] * 1e3:.2f} | {m['commit_s'] * 1e3:.2f} |")
    for name, r in results.items():
        times = ", ".join(f"{row['measured_s'] * 1e3:.1f}/{row['predicted_s'] * 1e3:.1f}"
                          for row in r["repeats"])
        print(f"{name}: measured/predicted per repeat (ms): {times}")
    print("predicted: the schedule replayed with message costs drawn from their measured "
          "spread (planaria.templates.replay); formula: StagePartition.iteration_time")


if __name__ == "__main__":
    sys.exit(main())
