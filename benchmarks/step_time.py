"""Step time of Planaria's runtime against the same model trained with plain PyTorch.

    python benchmarks/step_time.py [--steps N] [--warmup W] [--repeats R]
                                   [--config YAML] [--set section.key=value ...]
                                   [--json out.json] [--breakdown]

Four runs of one training job (same layers from `LayerModel.build_layer`, same data,
same AdamW(foreach=False), same microbatching), measured side by side in one call:

  (a) plain PyTorch, one process: `planaria.runtime.reference.train_reference`;
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

`--breakdown` adds a single-process run of Planaria's Engine in this process's
child with its sections (data, zero_grad, schedule, sync, commit, clip, optimizer)
timed by wrapping Engine methods here; nothing in the runtime is changed.

Worker modes (`--worker-*`) are how this file runs itself in subprocesses; they are
not meant to be called by hand.
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

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "tiny.yaml"

# On top of the YAML: a model big enough that compute dominates process noise on a
# CPU core (about 0.3 s a step on one core of a 2-core EPYC VM), synthetic data.
BENCH_OVERRIDES = [
    "model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.vocab_size=256",
    "model.seq_len=128", "data.source=synthetic", "train.global_batch=8",
    "train.micro_batch=2", "train.dtype=float32", "train.grad_clip=1.0",
    "train.recompute=false", "parallel.tp=1", "parallel.dp=1", "parallel.schedule=1f1b",
    "parallel.virtual_stages=1", "parallel.backend=gloo", "output.save_final=false",
]

RUNS = {
    "plain": "plain PyTorch, 1 process",
    "planaria": "Planaria, 1 process",
    "direct_pp2": "torch pipelining direct, pp=2 1F1B",
    "planaria_pp2": "Planaria, pp=2 1f1b",
}


# ------------------------------------------------------------------ shared helpers
def _load(config: str, overrides: list[str]):
    from planaria.runtime.config import load_config

    return load_config(config, overrides)


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def _run(cmd: list[str], timeout: float, log: list[str]) -> float:
    """Run cmd with OMP_NUM_THREADS=1; return the share of the machine's CPU time that
    processes other than cmd's used meanwhile (another job on the machine skews a run)."""
    log.append(shlex.join(cmd))
    busy0, ours0, t0 = _busy_seconds(), _children_seconds(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO)
    wall = time.perf_counter() - t0
    foreign = (_busy_seconds() - busy0 - (_children_seconds() - ours0)) / (wall * (os.cpu_count() or 1))
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}\n--- stdout\n"
                           f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return max(0.0, foreign)


def _busy_seconds() -> float:
    """CPU seconds all of the machine's CPUs have spent busy since boot (from /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return float("nan")
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _write_times(path: str, times: list[float], **extra) -> None:
    Path(path).write_text(json.dumps({"step_times_s": times, **extra}))


# ------------------------------------------------------------------ workers
def worker_reference(args) -> None:
    """(a): plain single-process PyTorch, the exactness tests' oracle."""
    import torch

    from planaria.runtime.data import build_dataset
    from planaria.runtime.model import LayerModel
    from planaria.runtime.reference import train_reference
    from planaria.runtime.trainer import dtypes, optimizer_settings

    cfg = _load(args.config, args.overrides)
    dataset = build_dataset(cfg.data.source, seq_len=cfg.model.seq_len,
                            vocab_size=cfg.model.vocab_size, seed=cfg.data.seed)
    param_dtype, autocast_dtype = dtypes(cfg.train.dtype)
    run = train_reference(LayerModel(cfg.model, seed=cfg.train.seed), optimizer_settings(cfg), dataset,
                          steps=cfg.train.steps, global_batch=cfg.train.global_batch,
                          micro_batch=cfg.train.micro_batch, data_seed=cfg.data.seed,
                          grad_clip=cfg.train.grad_clip, dtype=param_dtype,
                          autocast_dtype=autocast_dtype)
    _write_times(args.worker_out, run.step_times_s, threads=torch.get_num_threads(),
                 final_loss=run.losses[-1])


def stage_ranges(n_blocks: int, pp: int) -> list[tuple[int, int]]:
    """Layer ranges of `pp` stages, the split Planaria's even layout makes (extra blocks
    go first; the embedding joins the first stage, the head the last)."""
    base, extra = divmod(n_blocks, pp)
    ranges, start = [], 0
    for j in range(pp):
        stop = start + base + (1 if j < extra else 0) + (j == 0) + (j == pp - 1)
        ranges.append((start, stop))
        start = stop
    return ranges


def worker_direct_pp(args) -> None:
    """(c): torch.distributed.pipelining used directly, one stage per rank, under torchrun."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from planaria.runtime.data import build_dataset
    from planaria.runtime.model import LayerModel
    from planaria.runtime.optim import learning_rate
    from planaria.runtime.tensor_parallel import TensorParallel
    from planaria.runtime.trainer import dtypes, optimizer_settings

    cfg = _load(args.config, args.overrides)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.parallel.timeout_s))
    try:
        device = torch.device("cpu")
        param_dtype, autocast_dtype = dtypes(cfg.train.dtype)
        model = LayerModel(cfg.model, seed=cfg.train.seed)
        start, stop = stage_ranges(cfg.model.n_layers, world)[rank]
        single = TensorParallel()  # tp = 1
        module = nn.Sequential(*(model.build_layer(i, single, param_dtype, device)
                                 for i in range(start, stop)))
        stage = PipelineStage(module, rank, world, device)
        n_micro = cfg.train.global_batch // cfg.train.micro_batch

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            logits = logits.flatten(0, 1)
            if autocast_dtype is not None:
                logits = logits.float()
            return F.cross_entropy(logits, target.flatten()) / n_micro

        schedule = Schedule1F1B(stage, n_micro, loss_fn=loss_fn, scale_grads=False)
        optim = optimizer_settings(cfg)
        params = list(module.parameters())
        optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=optim.lr, betas=optim.betas, eps=optim.eps, foreach=False)
        dataset = build_dataset(cfg.data.source, seq_len=cfg.model.seq_len,
                                vocab_size=cfg.model.vocab_size, seed=cfg.data.seed)
        is_first, is_last = rank == 0, rank == world - 1
        autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype
                    else contextlib.nullcontext())
        times, last_loss = [], None
        for iteration in range(cfg.train.steps):
            t0 = time.perf_counter()
            inputs, targets = dataset.batch(iteration, cfg.train.global_batch, cfg.data.seed)
            optimizer.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            with autocast:
                schedule.step(*((inputs,) if is_first else ()), target=targets if is_last else None,
                              losses=losses if is_last else None, return_outputs=False)
            if cfg.train.grad_clip > 0:  # local to the stage: no all-reduce of the norm
                torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(iteration, optim)
            optimizer.step()
            if is_last:
                last_loss = float(sum(l.detach() for l in losses))
            times.append(time.perf_counter() - t0)
        _write_times(f"{args.worker_out}.rank{rank}", times, threads=torch.get_num_threads(),
                     final_loss=last_loss)
    finally:
        dist.destroy_process_group()


def worker_breakdown(args) -> None:
    """Planaria's Engine on one process, its sections timed by wrapping its methods."""
    import torch
    import torch.distributed as dist

    from planaria.runtime import engine as engine_mod
    from planaria.runtime import trainer
    from planaria.runtime.config import plan_from_config
    from planaria.runtime.data import build_dataset
    from planaria.runtime.model import LayerModel

    cfg = _load(args.config, args.overrides)
    plan = plan_from_config(cfg, world_size=1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(trainer._free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    sections: dict[str, dict[int, float]] = {}  # section -> iteration -> seconds
    current = [0]

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                per_iter = sections.setdefault(name, {})
                per_iter[current[0]] = per_iter.get(current[0], 0.0) + time.perf_counter() - t0
        return wrapper

    E = engine_mod.Engine
    E._forward_backward = timed("forward/backward (schedule.step)", E._forward_backward)
    E._sync_gradients = timed("sync gradients", E._sync_gradients)
    E._commit = timed("commit (grad norm + all-reduce)", E._commit)
    E._clip_and_step = timed("clip + optimizer step", E._clip_and_step)
    try:
        dataset = build_dataset(cfg.data.source, seq_len=cfg.model.seq_len,
                                vocab_size=cfg.model.vocab_size, seed=cfg.data.seed)
        dataset.batch = timed("data batch", dataset.batch)
        param_dtype, autocast_dtype = trainer.dtypes(cfg.train.dtype)
        model = LayerModel(cfg.model, seed=cfg.train.seed)
        engine = E(plan, model, trainer.optimizer_settings(cfg), rank=0, device=torch.device("cpu"),
                   param_dtype=param_dtype, autocast_dtype=autocast_dtype,
                   grad_clip=cfg.train.grad_clip)
        # Inside the schedule: the stage's forward and backward chunks, the model's own
        # forward within them, and the loss; the rest of schedule.step is the runtime's.
        for stage in engine.stages:
            stage.forward_one_chunk = timed("  stage.forward_one_chunk", stage.forward_one_chunk)
            stage.backward_one_chunk = timed("  stage.backward_one_chunk", stage.backward_one_chunk)
            stage.submod.forward = timed("    model forward", stage.submod.forward)
        engine.schedule._loss_fn = timed("    loss", engine.schedule._loss_fn)
        for state in engine.layers.values():
            state.optimizer.zero_grad = timed("  zero_grad", state.optimizer.zero_grad)
            state.optimizer.step = timed("  optimizer.step", state.optimizer.step)
        totals = []
        for iteration in range(cfg.train.steps):
            current[0] = iteration
            totals.append(engine.train_step(iteration, dataset, cfg.data.seed).step_time_s)
        engine.destroy()
    finally:
        dist.destroy_process_group()
    sections = {name: [per_iter.get(i, 0.0) for i in range(len(totals))]
                for name, per_iter in sections.items()}
    Path(args.worker_out).write_text(json.dumps({"step_times_s": totals, "sections": sections,
                                                 "threads": torch.get_num_threads()}))


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
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the four runs, order alternating")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default configs/tiny.yaml)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override on top of the benchmark's model (repeatable)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per subprocess")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the sections of Planaria's Engine.train_step (1 process)")
    parser.add_argument("--only", nargs="+", choices=list(RUNS), help=argparse.SUPPRESS)
    parser.add_argument("--worker-reference", help=argparse.SUPPRESS)
    parser.add_argument("--worker-direct-pp", help=argparse.SUPPRESS)
    parser.add_argument("--worker-breakdown", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker_reference or args.worker_direct_pp or args.worker_breakdown:
        args.overrides = args.sets  # workers get the complete override list
        if args.worker_reference:
            args.worker_out = args.worker_reference
            worker_reference(args)
        elif args.worker_direct_pp:
            args.worker_out = args.worker_direct_pp
            worker_direct_pp(args)
        else:
            args.worker_out = args.worker_breakdown
            worker_breakdown(args)
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
    cfg = _load(args.config, overrides)  # fail early on a bad config
    m, t = cfg.model, cfg.train
    tokens = t.global_batch * m.seq_len
    console.print(f"torch {torch.__version__} | python {platform.python_version()} | "
                  f"{_cpu_name()} | {os.cpu_count()} logical CPUs")
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
    with tempfile.TemporaryDirectory(prefix="planaria-bench-") as tmp:
        for r in range(args.repeats):
            order = names if r % 2 == 0 else names[::-1]
            results = {}
            for name in order:
                rdir = Path(tmp) / f"r{r}"
                rdir.mkdir(exist_ok=True)
                results[name] = measure(name, args.config, overrides, args.warmup, rdir,
                                        args.timeout, log)
                console.print(f"  repeat {r + 1}/{args.repeats}: {RUNS[name]:<36} "
                              f"{results[name]['median_s'] * 1000:8.1f} ms   (other processes: "
                              f"{results[name]['foreign_cpu'] * 100:4.1f}% of the CPUs)")
            rounds.append(results)
        breakdown = None
        if args.breakdown:
            out = Path(tmp) / "breakdown.json"
            _run([sys.executable, str(Path(__file__).resolve()), "--worker-breakdown", str(out),
                  "--config", args.config, *_sets([*overrides, "parallel.pp=1"])], args.timeout, log)
            breakdown = json.loads(out.read_text())

    console.print("[bold]subprocess commands (first repeat):[/]")
    for line in log[:len(names) + (1 if args.breakdown else 0)]:
        console.print(f"  {line}")

    summary = {n: statistics.median(r[n]["median_s"] for r in rounds) for n in names}
    pairs = [("planaria", "plain"), ("planaria_pp2", "direct_pp2")]
    ratios = {}
    for ours, theirs in pairs:
        if ours in summary and theirs in summary:
            ratios[f"{ours}/{theirs}"] = {
                "ratio": summary[ours] / summary[theirs],
                "per_repeat": [r[ours]["median_s"] / r[theirs]["median_s"] for r in rounds],
            }

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
                      f"{', '.join(f'{x:.3f}' for x in value['per_repeat'])}), "
                      f"bookkeeping overhead {(value['ratio'] - 1) * 100:+.1f}%")

    if breakdown is not None:
        _print_breakdown(console, breakdown, args.warmup)

    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": command, "torch": torch.__version__, "cpu": _cpu_name(),
            "cpus": os.cpu_count(), "omp_num_threads": 1, "config": args.config,
            "overrides": overrides, "steps": args.steps, "warmup": args.warmup,
            "repeats": args.repeats, "tokens_per_step": tokens,
            "median_step_s": summary, "tokens_per_s": {n: tokens / s for n, s in summary.items()},
            "ratios": ratios, "rounds": rounds, "breakdown": breakdown,
            "subprocess_commands": log[:len(names)],
        }, indent=2))
        console.print(f"wrote {args.json}")
    return 0


def _print_breakdown(console, breakdown: dict, warmup: int) -> None:
    from rich.table import Table

    steps = breakdown["step_times_s"][warmup:]
    total = statistics.median(steps)
    table = Table(title=f"Planaria Engine.train_step, 1 process: median per step over {len(steps)} steps")
    table.add_column("section")
    table.add_column("ms / step", justify="right")
    table.add_column("share", justify="right")
    order = ["data batch", "forward/backward (schedule.step)", "  zero_grad",
             "  stage.forward_one_chunk", "    model forward", "    loss", "  stage.backward_one_chunk",
             "sync gradients", "commit (grad norm + all-reduce)", "clip + optimizer step",
             "  optimizer.step"]
    names = [n for n in order if n in breakdown["sections"]]
    names += [n for n in breakdown["sections"] if n not in names]
    for name in names:
        value = statistics.median(breakdown["sections"][name][warmup:])
        table.add_row(name, f"{value * 1000:.2f}", f"{value / total * 100:.1f}%")
    table.add_row("train_step total", f"{total * 1000:.2f}", "100%")
    console.print(table)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
