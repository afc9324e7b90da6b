"""Tokens per second on one GPU: Planaria's trainer against torchtitan's and a plain
compiled PyTorch loop, on the same job, side by side in one run.

    python benchmarks/gpu_throughput.py [--shape 1b|8b] [--layers N] [--batch B] [--seq T]
                                        [--steps S] [--warmup W] [--sides plain,planaria,...]
                                        [--planaria-variant NAME=key=value,key=value ...]
                                        [--launches] [--device cuda|cpu] [--json out.json]
                                        [--log out.log] [--timeout-s 300]

The job: a LLaMA 3.2 1B shape (16 blocks, d_model 2048, 32 heads, 8 key/value heads,
FFN 8192, vocabulary 128,256, rotary base 500,000; embeddings tied, as in torchtitan's
"1B" flavor) or the LLaMA 3 8B shape (untied) with `--layers` of its 32 blocks; `--batch`
sequences of `--seq` tokens per step, one microbatch (no gradient accumulation), no
activation recomputation, bf16 compute over float32 parameters (autocast: the recipe
torchtitan itself runs on one GPU, where it applies no FSDP), AdamW, clipping at 1.0,
random tokens. The sides, each in a fresh process, one after another:

  plain     `runtime/parallel/reference.py`'s model (PyTorch's operations), each block
            under torch.compile, fused AdamW, the loss summed on the device: the loop a
            PyTorch user writes;
  planaria  `python -m planaria.train` on a generated config, as a user runs it; each
            `--planaria-variant` adds a run with those `--set` overrides (default
            variants: as configured by default, and with `train.compile`,
            `train.optimizer_impl=fused`, without `train.exact_reduction`, and
            with `train.mixed_precision=bf16-params`: the two mixed-precision recipes
            side by side);
  torchtitan  torchtitan's own Llama 3 trainer under torchrun, `compile` on, its
            `--model.flavor` built from the same shape (`benchmarks/gpu_torchtitan.py`);
            skipped with the reason when torchtitan is not importable.

Each side discards its first `--warmup` steps (compilation, the allocator's growth) and
reports the median step time of the rest (Planaria's and the plain loop's from the wall
clock between steps, torchtitan's from its own tokens/s lines), tokens/s from it, MFU, and
peak memory reserved by the caching allocator (what torchtitan reports). `--launches`
adds, for each Planaria variant, the kernels one step launches (a profiled step in a
process of its own; the plain loop's is counted after its timed steps); on CPU the
count is a proxy (`count_launches`).
MFU's formula is torchtitan 0.3.0's (the anchors' published MFU use it): FLOPs per token
= 6 N + 12 L H Q T, N the parameters the matrix products use (all of them, a tied weight
once; an untied embedding's left out), L blocks, H heads, Q head dim, T sequence length
(attention counted as if not causal), over 989 TFLOP/s, the H100 SXM's dense BF16 peak
(the H200 has the same compute), whatever the GPU; the GPU's own name is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEAK_FLOPS = 989e12  # H100 SXM dense BF16; the H200's compute is the same part's

SHAPES = {
    "1b": dict(n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, ffn_hidden=8192, vocab_size=128256,
               rope_theta=500000.0, tie_embeddings=True),
    # The 1B shape's blocks, heads and vocabulary at a quarter of its widths: as many
    # kernels per step (none depends on a width), in a CPU's memory (`--launches` on CPU).
    "1b-narrow": dict(n_layers=16, d_model=512, n_heads=32, n_kv_heads=8, ffn_hidden=2048, vocab_size=128256,
                      rope_theta=500000.0, tie_embeddings=True),
    "tiny": dict(n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, ffn_hidden=256, vocab_size=512,
                 rope_theta=500000.0),  # a smoke test of the script itself, on CPU
    "8b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=128256,
               rope_theta=500000.0, tie_embeddings=False),
}

DEFAULT_VARIANTS = [
    "default=",
    "compiled=train.compile=true,train.optimizer_impl=fused",
    "compiled-no-f64=train.compile=true,train.optimizer_impl=fused,train.exact_reduction=false",
    "compiled-no-f64-bf16-params=train.compile=true,train.optimizer_impl=fused,train.exact_reduction=false,"
    "train.mixed_precision=bf16-params",
]


@dataclass
class Job:
    shape: dict
    batch: int
    seq: int
    steps: int
    warmup: int
    device: str = "cuda"

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq

    def flops_per_token(self) -> float:
        """torchtitan's: 6 N + 12 L H Q T, N the parameters of the matrix products: the
        blocks, the final norm and the head (tied: the embedding's weight, counted once;
        untied: the embedding's own left out)."""
        s = self.shape
        d, ffn, v, layers = s["d_model"], s["ffn_hidden"], s["vocab_size"], s["n_layers"]
        kv = d // s["n_heads"] * s["n_kv_heads"]
        block = 2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d  # q, o; k, v; SwiGLU; two norm gains
        parameters = layers * block + d + v * d
        return 6 * parameters + 12 * layers * s["n_heads"] * (d // s["n_heads"]) * self.seq


def _median_after(times: list[float], warmup: int) -> float | None:
    kept = times[warmup:]
    return statistics.median(kept) if kept else None


# --------------------------------------------------------------------- plain
def run_plain(job: Job) -> dict:
    """The plain loop, in this process (`--worker plain`)."""
    import torch
    import torch.nn.functional as F

    _profile_generated_kernels(job)
    from planaria.runtime.config.sections import ModelConfig
    from planaria.runtime.models.llama import Block, LayerModel
    from planaria.runtime.parallel.reference import build_reference_model

    device = torch.device(job.device)
    cfg = ModelConfig(**job.shape, seq_len=job.seq, kernels="reference")
    net = build_reference_model(LayerModel(cfg, seed=0), torch.float32, device)
    for index, layer in enumerate(net):
        if isinstance(layer, Block):
            net[index] = torch.compile(layer)  # regional: one graph for every block
    params = list(net.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    gen = torch.Generator(device=device).manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (job.batch, job.seq + 1), device=device, generator=gen)
               for _ in range(4)]
    times, losses = [], []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def train_step(step: int) -> None:
        tokens = batches[step % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = net(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        losses.append(loss.detach())
        sync()

    for step in range(job.steps):
        sync()
        start = time.perf_counter()
        train_step(step)
        times.append(time.perf_counter() - start)
    launches = count_launches(lambda: train_step(job.steps), device.type)
    return {"step_times_s": times, "losses": [float(l) for l in losses[:job.steps]], "launches": launches,
            "peak_memory_gib": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None}


# ------------------------------------------------------------ kernel launches
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def count_launches(step, device_type: str) -> int:
    """Kernels one call of `step` launches: on a GPU the CUDA runtime's launch calls the
    profiler records; on CPU (the proxy) the operations that do the work: the profiled
    aten operations with no aten operation under them, and each kernel the compiler
    generated (profiled with `cpp.enable_kernel_profile`, set before compiling)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
    events = prof.events()
    if device_type == "cuda":
        return sum(1 for e in events if e.name in LAUNCHES)
    leaves = [e for e in events if e.name.startswith("aten::")
              and not any(c.name.startswith("aten::") for c in e.cpu_children)]
    generated = [e for e in events if e.name.startswith(("cpp_fused", "graph_")) and "cpp_fused" in e.name]
    return len(leaves) + len(generated)


def _profile_generated_kernels(job: Job) -> None:
    """On CPU, have the compiler's generated kernels show in the profiler (the launch
    count's proxy counts them); set before anything compiles."""
    if job.device == "cpu":
        import torch._inductor.config

        torch._inductor.config.cpp.enable_kernel_profile = True


def launches_of_planaria(job: Job, overrides: list[str]) -> int:
    """Kernels of one step of Planaria's engine (the trainer's own `start_engine`), in this
    process, after `job.warmup` steps (`--worker launches`)."""
    import torch
    import torch.distributed as dist

    from planaria.runtime.config.loading import load_config
    from planaria.runtime.config.validation import plan_from_config
    from planaria.runtime.data.token_datasets import build_dataset
    from planaria.runtime.worker.build import start_engine

    _profile_generated_kernels(job)
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-") as tmp:
        config = Path(tmp) / "job.yaml"
        config.write_text(planaria_config(job, Path(tmp) / "run"))
        cfg = load_config(str(config), overrides)
    device = torch.device(job.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.HashStore()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
    try:
        engine = start_engine(cfg, plan_from_config(cfg, world_size=1), 0, device)
        dataset = build_dataset(cfg.data.source, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size,
                                seed=cfg.data.seed)
        for i in range(job.warmup):
            engine.train_step(i, dataset, cfg.data.seed)
        step = lambda: engine.train_step(job.warmup, dataset, cfg.data.seed)  # noqa: E731
        count = count_launches(lambda: (step(), _sync(device)), device.type)
        engine.destroy()
        return count
    finally:
        dist.destroy_process_group()


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------- planaria
def planaria_config(job: Job, out_dir: Path) -> str:
    model = "\n".join(f"  {k}: {v}" for k, v in job.shape.items())
    return f"""model:
{model}
  seq_len: {job.seq}
data:
  source: synthetic
train:
  steps: {job.steps}
  global_batch: {job.batch}
  micro_batch: {job.batch}
  dtype: bfloat16
  lr: 3.0e-4
  warmup_steps: 2
  grad_clip: 1.0
parallel:
  tp: 1
  pp: 1
comm:
  backend: {"nccl" if job.device == "cuda" else "gloo"}
fault_tolerance:
  f: 0
output:
  dir: {out_dir}
  save_final: false
"""


def run_planaria(job: Job, overrides: list[str], timeout_s: float, log) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-") as tmp:
        out = Path(tmp) / "run"
        config = Path(tmp) / "job.yaml"
        config.write_text(planaria_config(job, out))
        cmd = [sys.executable, "-m", "planaria.train", str(config), *overrides]
        text = _run(cmd, timeout_s, log)
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    peak = re.search(r"peak GPU memory: [\d.]+ GiB allocated, ([\d.]+) GiB reserved", text)
    # Step times from the wall clock between metrics lines, as torchtitan's tokens/s: the
    # engine's own step_time_s ends at the optimizer's launch, before its kernels ran.
    times = [m["time"] for m in metrics]
    return {"step_times_s": [b - a for a, b in zip(times, times[1:])], "losses": [m["loss"] for m in metrics],
            "peak_memory_gib": float(peak[1]) if peak else None}


# ----------------------------------------------------------------- torchtitan
def run_torchtitan(job: Job, timeout_s: float, log) -> dict:
    import importlib.util

    if importlib.util.find_spec("torchtitan") is None:
        return {"skipped": "torchtitan is not installed here"}
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-tt-") as tmp:
        cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_torchtitan.py"), "--out", tmp,
               "--shape", json.dumps(job.shape), "--batch", str(job.batch), "--seq", str(job.seq),
               "--steps", str(job.steps), *(["--cpu-smoke"] if job.device == "cpu" else [])]
        text = _run(cmd, timeout_s, log)
    return parse_torchtitan_log(text)


def parse_torchtitan_log(text: str) -> dict:
    """Step times from torchtitan's metric lines (tps per step), memory from the same."""
    tps, memory = [], []
    for line in text.splitlines():
        m = re.search(r"step:\s*(\d+).*?memory:\s*([-\d.]+)GiB.*?tps:\s*([\d,]+)", line)
        if m:
            memory.append(float(m[2]))
            tps.append(float(m[3].replace(",", "")))
    return {"tps": tps, "peak_memory_gib": max(memory) if memory else None}


# -------------------------------------------------------------------- driver
def _run(cmd: list[str], timeout_s: float, log) -> str:
    log(f"$ {' '.join(cmd)}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    text = proc.stdout + proc.stderr
    log(text[-4000:])
    if proc.returncode != 0:
        raise RuntimeError(f"exit status {proc.returncode}: {text[-1500:]}")
    return text


def summarise(name: str, job: Job, result: dict, wall_s: float) -> dict:
    if "skipped" in result or "error" in result:
        return {"side": name, **{k: result[k] for k in ("skipped", "error") if k in result}, "wall_s": wall_s}
    if "tps" in result:  # torchtitan reports tokens/s per step
        tps = _median_after(result["tps"], job.warmup)
        step = job.tokens_per_step / tps if tps else None
    else:
        step = _median_after(result["step_times_s"], job.warmup)
        tps = job.tokens_per_step / step if step else None
    mfu = tps * job.flops_per_token() / PEAK_FLOPS if tps else None
    return {"side": name, "step_s": step, "tokens_per_s": tps, "mfu": mfu,
            "peak_memory_gib": result.get("peak_memory_gib"), "launches": result.get("launches"), "wall_s": wall_s,
            "losses": result.get("losses", [])[:3] + result.get("losses", [])[-2:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--layers", type=int, default=0, help="blocks of the shape (default: all)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--sides", default="torchtitan,plain,planaria")
    parser.add_argument("--planaria-variant", action="append", default=None, metavar="NAME=k=v,k=v")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (with --shape tiny)")
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--json", default="")
    parser.add_argument("--log", default="", help="append every side's output to this file")
    parser.add_argument("--launches", action="store_true",
                        help="also count the kernels one step of each Planaria variant launches (a process each)")
    parser.add_argument("--worker", choices=["plain", "launches"], help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        job = Job(**json.loads(args.job))
        result = run_plain(job) if args.worker == "plain" else launches_of_planaria(job, json.loads(args.overrides))
        print("RESULT " + json.dumps(result))
        return 0

    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["n_layers"] = args.layers
    job = Job(shape, args.batch, args.seq, args.steps, args.warmup, args.device)
    log_file = open(args.log, "a") if args.log else None

    def log(text: str) -> None:
        if log_file:
            log_file.write(text + "\n")
            log_file.flush()

    import torch

    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"device: {device_name}; torch {torch.__version__}; shape {args.shape} {shape}; "
          f"batch {job.batch} x {job.seq} tokens; {job.flops_per_token() / 1e9:.3f} GFLOP per token", flush=True)
    rows = []
    for side in args.sides.split(","):
        runs = []
        if side == "plain":
            runs = [("plain (compiled loop)", lambda: _worker("plain", job, args.timeout_s, log))]
        elif side == "torchtitan":
            runs = [("torchtitan", lambda: run_torchtitan(job, args.timeout_s, log))]
        elif side == "planaria":
            for variant in args.planaria_variant or DEFAULT_VARIANTS:
                name, _, sets = variant.partition("=")
                overrides = [s for s in sets.split(",") if s]
                runs.append((f"planaria {name}", lambda o=overrides: _planaria_side(job, o, args, log)))
        else:
            parser.error(f"unknown side {side!r}")
        for name, run in runs:
            start = time.perf_counter()
            try:
                result = run()
            except Exception as err:  # one side's failure must not cost the others' figures
                result = {"error": str(err)[-600:]}
            row = summarise(name, job, result, time.perf_counter() - start)
            rows.append(row)
            print(json.dumps(row), flush=True)
    _print_table(rows, device_name, job)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device_name, "job": job.__dict__, "rows": rows}, indent=1))
    return 0


def _planaria_side(job: Job, overrides: list[str], args, log) -> dict:
    result = run_planaria(job, overrides, args.timeout_s, log)
    if args.launches:
        result["launches"] = _worker("launches", job, args.timeout_s, log, overrides)
    return result


def _worker(mode: str, job: Job, timeout_s: float, log, overrides: list[str] = ()):
    cmd = [sys.executable, __file__, "--worker", mode, "--job", json.dumps(job.__dict__),
           "--overrides", json.dumps(list(overrides))]
    text = _run(cmd, timeout_s, log)
    line = next(l for l in text.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _print_table(rows: list[dict], device_name: str, job: Job) -> None:
    base = next((r for r in rows if r["side"] == "torchtitan" and r.get("tokens_per_s")), None)
    print(f"\n{device_name}: {job.batch} x {job.seq} tokens per step, median of steps {job.warmup + 1}-{job.steps}")
    print("| side | step (ms) | tokens/s | MFU | peak memory reserved (GiB) | kernels per step | vs torchtitan |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if not r.get("tokens_per_s"):
            print(f"| {r['side']} | {r.get('skipped') or r.get('error', '')[:200]} | | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else ""
        memory = f"{r['peak_memory_gib']:.1f}" if r.get("peak_memory_gib") else ""
        launches = f"{r['launches']:,}" if r.get("launches") else ""
        print(f"| {r['side']} | {r['step_s'] * 1000:.1f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
              f"{memory} | {launches} | {ratio} |")


if __name__ == "__main__":
    sys.exit(main())
