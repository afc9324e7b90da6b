"""The cost model's accuracy with the profile and the training in the same seconds.

    python benchmarks/cost_model_paired.py [--rounds 15] [--steps 12] [--warmup 2]
                                           [--cases NAME,...] [--json out.json]

`cost_model_accuracy.py` profiles, then starts a training job, and compares medians
over a few such repeats. On a shared VM whose speed drifts by a third over tens of
seconds, a 30 ms step and a profile taken a minute apart need not see the same machine.
Here one torchrun job (2 processes, the cases of `cost_model_accuracy.py`) builds the
trainer's Engine (`build.build_engine`, via `start_engine`) and alternates, round after round:

  (i)  rank 0 profiles the config (`profile_model(cfg, num_threads=1,
       concurrent_workers=2)`: the layers timed beside one process computing a block,
       as the other worker does in training; gloo links and the pipeline runtime's
       work per action measured afresh by pairs of fresh processes) and predicts the
       plan's iteration time exactly as `cost_model_accuracy.predict` does (the
       schedule replayed with message costs drawn from their measured spread), while
       rank 1 waits. For comparison it also predicts from a profile with the other
       core idle ("idle neighbour", as before `concurrent_workers` existed) and from
       the same profile without the runtime's per-action work (as before
       `Hardware.action_overhead_s` existed);
  (ii) both ranks train `--steps` iterations; the measurement is the median of
       rank 0's `step_time_s` after the first `--warmup` of the round.

A round takes seconds, so each pair sees the same machine. Reported per case: the
median over rounds of the paired error (predicted / measured - 1) with its quartiles,
the medians of the measurements and predictions, and the share of the CPUs other
processes used during the job.

Worker mode (`--worker`) is how this file runs itself under torchrun.
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
from dataclasses import replace
from pathlib import Path

from planaria.chaos.report import write_json_atomically

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cost_model_accuracy import CASES, CONFIG, REPO, WORLD, predict  # noqa: E402
from machine_load import busy_seconds, children_seconds, cpu_name  # noqa: E402


def worker(args) -> None:
    """One rank of the job: alternate profile (rank 0) and training rounds."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from planaria.runtime.config.loading import load_config
    from planaria.runtime.config.validation import plan_from_config
    from planaria.runtime.data.token_datasets import build_dataset
    from planaria.runtime.planning.measured_costs import profile_model
    from planaria.runtime.worker.build import start_engine
    from planaria.runtime.planning import pipeline_probe

    cfg = load_config(CONFIG, CASES[args.case])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.comm.timeout_s))
    try:
        plan = plan_from_config(cfg, world_size=world)
        engine = start_engine(cfg, plan, rank, torch.device("cpu"))
        dataset = build_dataset(cfg.data.source, seq_len=cfg.model.seq_len,
                                vocab_size=cfg.model.vocab_size, seed=cfg.data.seed)
        rounds, iteration = [], 0
        for _ in range(args.rounds):
            dist.barrier()
            predicted = idle = bare = per_action = None
            if rank == 0:
                pipeline_probe.forget_measurements()  # fresh links every round
                costs = profile_model(cfg, num_threads=1, concurrent_workers=world)
                predicted = predict(plan, costs).total_s
                per_action = costs.hardware.action_overhead_s
                bare = predict(plan, replace(costs, hardware=replace(
                    costs.hardware, action_overhead_s=0.0))).total_s
                idle = predict(plan, profile_model(cfg, num_threads=1)).total_s  # same links
            dist.barrier()
            times = []
            for _ in range(args.steps):
                times.append(engine.train_step(iteration, dataset, cfg.data.seed).step_time_s)
                iteration += 1
            if rank == 0:
                rounds.append({"predicted_s": predicted, "predicted_idle_s": idle,
                               "predicted_without_runtime_s": bare,
                               "action_overhead_s": per_action,
                               "measured_s": statistics.median(times[args.warmup:]),
                               "step_times_s": times})
        engine.destroy()
        if rank == 0:
            Path(args.worker_out).write_text(json.dumps(rounds))
    finally:
        dist.destroy_process_group()


def run_case(args, name: str, tmp: Path) -> dict:
    out = tmp / f"{name.replace(' ', '_')}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={WORLD}", str(Path(__file__).resolve()), "--worker",
           "--case", name, "--rounds", str(args.rounds), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--worker-out", str(out)]
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    busy0, ours0, t0 = busy_seconds(), children_seconds(), time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env,
                          cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: the job exited {proc.returncode}\n{proc.stderr[-4000:]}")
    foreign = (busy_seconds() - busy0 - (children_seconds() - ours0)) / (wall * (os.cpu_count() or 1))
    rounds = json.loads(out.read_text())
    errors = sorted(r["predicted_s"] / r["measured_s"] - 1 for r in rounds)
    idle_errors = [r["predicted_idle_s"] / r["measured_s"] - 1 for r in rounds]
    bare_errors = [r["predicted_without_runtime_s"] / r["measured_s"] - 1 for r in rounds]
    result = {
        "rounds": rounds,
        "paired_error": statistics.median(errors),
        "paired_error_quartiles": statistics.quantiles(errors, n=4)[::2] if len(errors) > 1 else errors * 2,
        "measured_s": statistics.median(r["measured_s"] for r in rounds),
        "predicted_s": statistics.median(r["predicted_s"] for r in rounds),
        "idle_paired_error": statistics.median(idle_errors),
        "without_runtime_paired_error": statistics.median(bare_errors),
        "action_overhead_s": statistics.median(r["action_overhead_s"] for r in rounds),
        "foreign_cpu": max(0.0, foreign),
        "wall_s": wall,
    }
    print(f"[{name}] {len(rounds)} rounds in {wall:.0f} s: paired error {result['paired_error']:+.1%} "
          f"(quartiles {result['paired_error_quartiles'][0]:+.1%} .. "
          f"{result['paired_error_quartiles'][1]:+.1%}); idle neighbour "
          f"{result['idle_paired_error']:+.1%}; without the runtime's per-action work "
          f"{result['without_runtime_paired_error']:+.1%} (measured at "
          f"{result['action_overhead_s'] * 1e3:.2f} ms per action); others used {result['foreign_cpu']:.1%} of the CPUs",
          flush=True)
    return result


def print_table(results: dict[str, dict]) -> None:
    print("\n| case | rounds | measured (ms, median) | predicted (ms, median) | "
          "paired error: median (quartiles) | within 15% | idle neighbour: paired error | "
          "without the runtime's per-action work: paired error | per action (ms) |")
    print("|---|---:|---:|---:|---|---|---:|---:|---:|")
    for name, r in results.items():
        q = r["paired_error_quartiles"]
        print(f"| {name} | {len(r['rounds'])} | {r['measured_s'] * 1e3:.1f} | "
              f"{r['predicted_s'] * 1e3:.1f} | {r['paired_error']:+.1%} ({q[0]:+.1%} .. {q[1]:+.1%}) | "
              f"{'yes' if abs(r['paired_error']) <= 0.15 else 'no'} | {r['idle_paired_error']:+.1%} | "
              f"{r['without_runtime_paired_error']:+.1%} | {r['action_overhead_s'] * 1e3:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="profile + train rounds per case (default 15)")
    parser.add_argument("--steps", type=int, default=12, help="training steps per round (default 12)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="steps of each round left out of its median (default 2)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, from: {', '.join(CASES)}")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per case (default 1800)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    if args.rounds < 1 or args.steps <= args.warmup or args.warmup < 0:
        parser.error("need --rounds >= 1 and --steps > --warmup >= 0")
    import platform

    import torch

    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"torch {torch.__version__} | python {platform.python_version()} | {cpu_name()} | "
          f"{os.cpu_count()} logical CPUs | every worker OMP_NUM_THREADS=1")
    with tempfile.TemporaryDirectory(prefix="planaria-costpair-") as tmp:
        results = {name: run_case(args, name, Path(tmp)) for name in names}
    print_table(results)
    if args.json:
        write_json_atomically(Path(args.json), results)
    return 0 if all(abs(r["paired_error"]) <= 0.15 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
