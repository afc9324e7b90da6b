"""Step time of Planaria's runtime against the same model trained with plain PyTorch.

    python benchmarks/step_time.py [--steps N] [--warmup W] [--repeats R]
                                   [--config YAML] [--set section.key=value ...]
                                   [--json out.json] [--breakdown]

Four runs of one training job (same layers from `LayerModel.build_layer`, same data,
same AdamW(foreach=False), same microbatching), measured side by side in one call:

  (a) plain PyTorch, one process: `planaria.runtime.parallel.reference.train_reference`;
  (b) Planaria, one process, no pipeline: `python -m planaria.train`, step_time_s
      from metrics.jsonl;
  (c) `torch.distributed.pipelining` used directly, 2 stages under torchrun:
      PipelineStage + Schedule1F1B (loss / n_microbatches, scale_grads=False), no
      collective besides the pipeline's sends and receives, clip_grad_norm_ per
      stage (a hair cheaper than Planaria's global clip, which needs one all-reduce);
  (d) Planaria, pp=2 with the 1f1b schedule, under torchrun.

Every process runs with OMP_NUM_THREADS=1 (one and two process runs alike), so a
2-process run uses two cores and a 1-process run one. Each run discards its first
W steps and takes the median of the next N; with R > 1 the four runs are repeated,
alternating their order, and the median of the per-run medians is reported. The
ratios Planaria / plain (1 process) and Planaria pp2 / direct pp2 minus one are
Planaria's bookkeeping overhead.

Step times are what each side times around one optimizer step: for Planaria the
step_time_s of Engine.train_step on rank 0 (data slice, schedule, gradient sync,
commit all-reduce, clip, optimizer step; the trainer's metrics line and progress
print are outside it), for the baselines the same span in their own loop (rank 0
for direct pp).

Before each run the script waits (up to --wait-quiet s) for other processes to use
under --quiet of the CPUs, measures how much they used during the run, and runs it
again (up to --retries times) if that was more.

`--breakdown` adds, after the table:
  - where one step's time goes, Planaria's Engine.train_step next to train_reference,
    one process each, sections timed by wrapping methods in this file's own worker
    processes (nothing in the runtime is changed);
  - each pair measured inside the same process(es), alternating blocks of steps:
    Engine (pp=1) against train_reference in one process, and Engine (pp=2) against
    the direct pipeline in the same two torchrun processes. Separate processes of the
    same job differ by a few percent on a noisy VM; this comparison does not.

Worker modes (`--worker-*`) are how this file runs itself in subprocesses; they are
not meant to be called by hand. What they run is in step_time_workers.py beside it, and
how busy the machine is (measured around every run) in machine_load.py.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import step_time_workers as workers  # beside this file (the script's folder is first on sys.path)
from machine_load import busy_seconds, children_seconds, cpu_name, wait_quiet

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "tiny.yaml"

# On top of the YAML: a model big enough that compute dominates process noise on a
# CPU core (about 0.3 s a step on one core of a 2-core EPYC VM), synthetic data.
BENCH_OVERRIDES = [
    "model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.vocab_size=256",
    "model.seq_len=128", "data.source=synthetic", "train.global_batch=8",
    "train.micro_batch=2", "train.dtype=float32", "train.grad_clip=1.0",
    "train.recompute=false", "parallel.tp=1", "parallel.dp=1", "parallel.schedule=1f1b",
    "parallel.virtual_stages=1", "comm.backend=gloo", "output.save_final=false",
]

RUNS = {
    "plain": "plain PyTorch, 1 process",
    "planaria": "Planaria, 1 process",
    "direct_pp2": "torch pipelining direct, pp=2 1F1B",
    "planaria_pp2": "Planaria, pp=2 1f1b",
}


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def _run(cmd: list[str], timeout: float, log: list[str]) -> float:
    """Run cmd with OMP_NUM_THREADS=1; return the share of the machine's CPU time that
    processes other than cmd's used meanwhile (another job on the machine skews a run)."""
    log.append(shlex.join(cmd))
    busy0, ours0, t0 = busy_seconds(), children_seconds(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO)
    wall = time.perf_counter() - t0
    foreign = (busy_seconds() - busy0 - (children_seconds() - ours0)) / (wall * (os.cpu_count() or 1))
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}\n--- stdout\n"
                           f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return max(0.0, foreign)


# ------------------------------------------------------------------ driver
def _median_after(times: list[float], warmup: int) -> float:
    kept = times[warmup:]
    if not kept:
        raise ValueError(f"no steps left after discarding {warmup} warm-up steps")
    return statistics.median(kept)


def measure(name: str, config: str, overrides: list[str], warmup: int, tmp: Path,
            timeout: float, log: list[str]) -> dict:
    me = [str(Path(__file__).resolve())]
    out = tmp / f"{name}.json"
    if name == "plain":
        foreign = _run([sys.executable, *me, "--worker-reference", str(out), "--config", config,
              *_sets(overrides)], timeout, log)
        data = json.loads(out.read_text())
        times = data["step_times_s"]
    elif name in ("planaria", "planaria_pp2"):
        run_dir = tmp / name
        extra = ["parallel.pp=1"] if name == "planaria" else ["parallel.pp=2"]
        launcher = [sys.executable] if name == "planaria" else _torchrun(2)
        foreign = _run([*launcher, "-m", "planaria.train", config, *overrides, *extra,
              f"output.dir={run_dir}"], timeout, log)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        times = [r["step_time_s"] for r in records]
        data = {"final_loss": records[-1]["loss"]}
    elif name == "direct_pp2":
        foreign = _run([*_torchrun(2), *me, "--worker-direct-pp", str(out), "--config", config,
              *_sets(overrides)], timeout, log)
        ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
        times = ranks[0]["step_times_s"]
        data = {"final_loss": ranks[1]["final_loss"],
                "rank1_median_s": _median_after(ranks[1]["step_times_s"], warmup)}
    else:
        raise ValueError(name)
    return {"median_s": _median_after(times, warmup), "step_times_s": times, "foreign_cpu": foreign,
            **{k: v for k, v in data.items() if k != "step_times_s"}}


def _sets(overrides: list[str]) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="steps discarded at the start of each run")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the four runs, order alternating")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default configs/tiny.yaml)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override on top of the benchmark's model (repeatable)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per subprocess")
    parser.add_argument("--quiet", type=float, default=0.10,
                        help="a run during which other processes used more than this share of the "
                             "CPUs counts as busy and is run again (default 0.10)")
    parser.add_argument("--retries", type=int, default=2, help="reruns of a busy run (default 2)")
    parser.add_argument("--wait-quiet", type=float, default=60,
                        help="before each run, wait up to this many seconds for a quiet machine")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the sections of Planaria's Engine.train_step (1 process)")
    parser.add_argument("--only", nargs="+", choices=list(RUNS), help=argparse.SUPPRESS)
    parser.add_argument("--worker-reference", help=argparse.SUPPRESS)
    parser.add_argument("--worker-direct-pp", help=argparse.SUPPRESS)
    parser.add_argument("--worker-breakdown", help=argparse.SUPPRESS)
    parser.add_argument("--worker-breakdown-reference", help=argparse.SUPPRESS)
    parser.add_argument("--worker-paired-pp2", help=argparse.SUPPRESS)
    parser.add_argument("--worker-paired-single", help=argparse.SUPPRESS)
    parser.add_argument("--paired-rounds", type=int, default=6,
                        help="with --breakdown: alternating blocks per paired run (default 6)")
    args = parser.parse_args(argv)

    if (args.worker_reference or args.worker_direct_pp or args.worker_breakdown
            or args.worker_breakdown_reference or args.worker_paired_pp2
            or args.worker_paired_single):
        args.overrides = args.sets  # workers get the complete override list
        if args.worker_reference:
            args.worker_out = args.worker_reference
            workers.worker_reference(args)
        elif args.worker_direct_pp:
            args.worker_out = args.worker_direct_pp
            workers.worker_direct_pp(args)
        elif args.worker_breakdown:
            args.worker_out = args.worker_breakdown
            workers.worker_breakdown(args)
        elif args.worker_paired_pp2:
            args.worker_out = args.worker_paired_pp2
            workers.worker_paired_pp2(args)
        elif args.worker_paired_single:
            args.worker_out = args.worker_paired_single
            workers.worker_paired_single(args)
        else:
            args.worker_out = args.worker_breakdown_reference
            workers.worker_breakdown_reference(args)
        return 0
    return drive(args)


def drive(args) -> int:
    import platform

    import torch
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
    command = shlex.join([sys.executable, *sys.argv])
    console.print(f"[bold]command:[/] {command}")
    overrides = [*BENCH_OVERRIDES, *args.sets, f"train.steps={args.warmup + args.steps}",
                 "train.log_every=1000000"]
    cfg = workers.load(args.config, overrides)  # fail early on a bad config
    m, t = cfg.model, cfg.train
    tokens = t.global_batch * m.seq_len
    console.print(f"torch {torch.__version__} | python {platform.python_version()} | "
                  f"{cpu_name()} | {os.cpu_count()} logical CPUs")
    console.print(f"model: {m.n_layers} blocks, d_model {m.d_model}, {m.n_heads} heads, vocab "
                  f"{m.vocab_size}, seq_len {m.seq_len}, ffn {m.ffn_dim} | batch {t.global_batch} = "
                  f"{t.global_batch // t.micro_batch} x {t.micro_batch}, {t.dtype}, data {cfg.data.source} | "
                  f"{args.warmup} warm-up + {args.steps} measured steps, {args.repeats} repeat(s)")
    console.print("every process runs with OMP_NUM_THREADS=1 (1-process runs use one core, "
                  "2-process runs two); step time = median over measured steps, median of "
                  "medians over repeats")
    with contextlib.suppress(OSError):
        console.print(f"load average before the runs: {Path('/proc/loadavg').read_text().split()[0]} "
                      "(another job on the machine skews the runs; each run below reports it)")
    console.print("direct pp clips each stage's gradients by that stage's own norm (no all-reduce): "
                  "a hair cheaper than Planaria's global clip")

    names = args.only or list(RUNS)
    rounds: list[dict[str, dict]] = []
    log: list[str] = []
    commands: dict[str, str] = {}  # the first command line of each run
    with tempfile.TemporaryDirectory(prefix="planaria-bench-") as tmp:
        for r in range(args.repeats):
            order = names if r % 2 == 0 else names[::-1]
            results = {}
            for name in order:
                for attempt in range(args.retries + 1):
                    waited = wait_quiet(args.quiet, args.wait_quiet)
                    rdir = Path(tmp) / f"r{r}a{attempt}"
                    rdir.mkdir(exist_ok=True)
                    result = measure(name, args.config, overrides, args.warmup, rdir,
                                     args.timeout, log)
                    commands.setdefault(name, log[-1])
                    busy = result["foreign_cpu"] > args.quiet
                    verdict = ("busy, run again" if busy and attempt < args.retries
                               else "busy, kept" if busy else "")
                    console.print(f"  repeat {r + 1}/{args.repeats}: {RUNS[name]:<36} "
                                  f"{result['median_s'] * 1000:8.1f} ms   (other processes: "
                                  f"{result['foreign_cpu'] * 100:4.1f}% of the CPUs"
                                  f"{f'; waited {waited:.0f} s for quiet' if waited >= 2 else ''})"
                                  f"{'  ' + verdict if verdict else ''}")
                    if not busy:
                        break
                results[name] = result
            rounds.append(results)
        breakdown = None
        if args.breakdown:
            breakdown = {}
            for which, flag in (("planaria", "--worker-breakdown"), ("plain", "--worker-breakdown-reference")):
                out = Path(tmp) / f"breakdown-{which}.json"
                wait_quiet(args.quiet, args.wait_quiet)
                foreign = _run([sys.executable, str(Path(__file__).resolve()), flag, str(out),
                                "--config", args.config, *_sets([*overrides, "parallel.pp=1"])],
                               args.timeout, log)
                breakdown[which] = {**json.loads(out.read_text()), "foreign_cpu": foreign}
                commands[f"breakdown {which}"] = log[-1]
            for key, launcher, flag, pp in (
                    ("paired_single", [sys.executable], "--worker-paired-single", 1),
                    ("paired_pp2", _torchrun(2), "--worker-paired-pp2", 2)):
                out = Path(tmp) / f"{key}.json"
                wait_quiet(args.quiet, args.wait_quiet)
                foreign = _run([*launcher, str(Path(__file__).resolve()), flag, str(out),
                                "--paired-rounds", str(args.paired_rounds),
                                "--config", args.config, *_sets([*overrides, f"parallel.pp={pp}"])],
                               args.timeout * 2, log)
                breakdown[key] = {"blocks": json.loads(Path(f"{out}.rank0").read_text())["blocks"],
                                  "foreign_cpu": foreign}
                commands[key.replace("_", " ")] = log[-1]

    console.print("[bold]subprocess commands (first repeat; temporary paths vary):[/]")
    for name, line in commands.items():
        console.print(f"  {name}: {line}")

    summary = {n: statistics.median(r[n]["median_s"] for r in rounds) for n in names}
    pairs = [("planaria", "plain"), ("planaria_pp2", "direct_pp2")]
    ratios = {}
    for ours, theirs in pairs:
        if ours in summary and theirs in summary:
            ratios[f"{ours}/{theirs}"] = {
                "ratio": summary[ours] / summary[theirs],
                "per_repeat": [r[ours]["median_s"] / r[theirs]["median_s"] for r in rounds],
            }
            ratios[f"{ours}/{theirs}"]["median_paired"] = statistics.median(
                ratios[f"{ours}/{theirs}"]["per_repeat"])

    table = Table(title="Step time, median of per-run medians")
    for col, justify in (("run", "left"), ("processes", "right"), ("step (ms)", "right"),
                         ("tokens/s", "right"), ("per-run medians (ms)", "left"),
                         ("Planaria / baseline", "right"), ("overhead", "right")):
        table.add_column(col, justify=justify)
    for name in names:
        ratio_cell = overhead_cell = ""
        for ours, theirs in pairs:
            key = f"{ours}/{theirs}"
            if name == ours and key in ratios:
                ratio = ratios[key]["ratio"]
                ratio_cell = f"{ratio:.3f}"
                colour = "green" if ratio - 1 < 0.05 else "red"
                overhead_cell = f"[{colour}]{(ratio - 1) * 100:+.1f}%[/]"
        table.add_row(RUNS[name], "2" if "pp2" in name else "1", f"{summary[name] * 1000:.1f}",
                      f"{tokens / summary[name]:,.0f}",
                      ", ".join(f"{r[name]['median_s'] * 1000:.1f}" for r in rounds),
                      ratio_cell, overhead_cell)
    console.print(table)
    for key, value in ratios.items():
        console.print(f"{key}: ratio {value['ratio']:.3f} (per repeat: "
                      f"{', '.join(f'{x:.3f}' for x in value['per_repeat'])}; their median "
                      f"{value['median_paired']:.3f}), "
                      f"bookkeeping overhead {(value['ratio'] - 1) * 100:+.1f}%")

    if breakdown is not None:
        _print_breakdown(console, breakdown, args.warmup)
        _print_paired(console, breakdown, args.warmup)

    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": command, "torch": torch.__version__, "cpu": cpu_name(),
            "cpus": os.cpu_count(), "omp_num_threads": 1, "config": args.config,
            "overrides": overrides, "steps": args.steps, "warmup": args.warmup,
            "repeats": args.repeats, "tokens_per_step": tokens,
            "median_step_s": summary, "tokens_per_s": {n: tokens / s for n, s in summary.items()},
            "ratios": ratios, "rounds": rounds, "breakdown": breakdown,
            "subprocess_commands": commands,
        }, indent=2))
        console.print(f"wrote {args.json}")
    return 0


# Rows of the side-by-side breakdown: (label, Planaria formula, plain formula), each a
# sum of timed sections (a leading "-" subtracts); "total" is the step time.
_BREAKDOWN_ROWS = [
    ("data batch", "data batch", "data batch"),
    ("zero_grad", "zero_grad", "zero_grad"),
    ("model forward (4 microbatches)", "model forward", "model forward"),
    ("loss", "loss", "loss"),
    ("backward (stage.backward_one_chunk / loss.backward)", "backward", "backward"),
    ("pipelining runtime around them (rest of schedule.step)",
     "schedule.step -zero_grad -model forward -loss -backward", ""),
    ("loss.item() per microbatch", "", "loss.item"),
    ("layer-wise gradient sync", "sync", ""),
    ("grad norm: commit (foreach norm + world all-reduce) / clip_grad_norm_", "commit", "clip_grad_norm_"),
    ("clip: clip_grads_with_norm_ (global norm)", "clip and step -optimizer.step", ""),
    ("optimizer.step (AdamW, foreach=False)", "optimizer.step", "optimizer.step"),
    ("other (loop, timing, lr)", "total -data batch -schedule.step -sync -commit -clip and step",
     "total -data batch -zero_grad -model forward -loss -backward -loss.item -clip_grad_norm_ "
     "-optimizer.step"),
    ("step total", "total", "total"),
]


def _breakdown_rows(data: dict, column: int, warmup: int) -> list[float | None]:
    """Each row's formula evaluated per step, then the median over the measured steps."""
    n = len(data["step_times_s"])
    sections = {**data["sections"], "total": data["step_times_s"]}
    out: list[float | None] = []
    for row in _BREAKDOWN_ROWS:
        formula = row[column]
        if not formula:
            out.append(None)
            continue
        first, *minus = formula.split(" -")
        per_step = list(sections.get(first, [0.0] * n))
        for term in minus:
            per_step = [a - b for a, b in zip(per_step, sections.get(term, [0.0] * n))]
        out.append(statistics.median(per_step[warmup:]))
    return out


def _print_breakdown(console, breakdown: dict, warmup: int) -> None:
    """Sections of one step, median over the measured steps, Planaria and plain side by side."""
    from rich.table import Table

    planaria = _breakdown_rows(breakdown["planaria"], 1, warmup)
    plain = _breakdown_rows(breakdown["plain"], 2, warmup)
    table = Table(title="Where a step's time goes, 1 process: median ms per step "
                        "(sections timed by wrapping, in separate runs)")
    for col, justify in (("section", "left"), ("Planaria", "right"), ("plain", "right"),
                         ("Planaria - plain", "right")):
        table.add_column(col, justify=justify)
    for (label, _, _), ours, theirs in zip(_BREAKDOWN_ROWS, planaria, plain):
        fmt = lambda v: "" if v is None else f"{v * 1000:.2f}"  # noqa: E731
        diff = (ours or 0.0) - (theirs or 0.0)
        table.add_row(label, fmt(ours), fmt(theirs), f"{diff * 1000:+.2f}")
    console.print(table)
    breakdown["rows_ms"] = {label: {"planaria": None if a is None else a * 1000,
                                    "plain": None if b is None else b * 1000}
                            for (label, _, _), a, b in zip(_BREAKDOWN_ROWS, planaria, plain)}


def _print_paired(console, breakdown: dict, warmup: int) -> None:
    """Planaria against its baseline inside the same process(es), blocks of steps alternating."""
    for key, ours_name, theirs_name, where in (
            ("paired_single", "planaria", "plain", "the same process"),
            ("paired_pp2", "planaria_pp2", "direct_pp2", "the same two processes (rank 0)")):
        blocks = breakdown[key]["blocks"]
        ours = [_median_after(b, warmup) for b in blocks[ours_name]]
        theirs = [_median_after(b, warmup) for b in blocks[theirs_name]]
        ratios = [a / b for a, b in zip(ours, theirs)]
        median = statistics.median(ratios)
        breakdown[key]["summary"] = {f"{ours_name}_ms": [x * 1000 for x in ours],
                                     f"{theirs_name}_ms": [x * 1000 for x in theirs],
                                     "ratios": ratios, "median_ratio": median}
        console.print(
            f"{RUNS[ours_name]} vs {RUNS[theirs_name]} inside {where}, {len(ratios)} alternating "
            f"blocks of {len(blocks[ours_name][0])} steps, median per block: Planaria "
            f"{', '.join(f'{x * 1000:.1f}' for x in ours)} ms; baseline "
            f"{', '.join(f'{x * 1000:.1f}' for x in theirs)} ms; ratio per block "
            f"{', '.join(f'{x:.3f}' for x in ratios)}; median {median:.3f} "
            f"-> overhead {(median - 1) * 100:+.1f}%")


if __name__ == "__main__":
    sys.exit(main())
