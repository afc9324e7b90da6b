"""Planaria's Triton kernels against PyTorch eager, torch.compile and Liger-Kernel, on a GPU.

    python benchmarks/kernels.py [--dtype bfloat16] [--tokens 8192] [--repeats 100] [--json FILE]
                                 [--ops rms_norm swiglu ...]
    python benchmarks/kernels.py --smoke     # the script itself, on CPU, in a few seconds

Sizes are a 7B-class LLaMA's (hidden 4096, SwiGLU 11008, 32 heads of 128, vocabulary
32000), `--tokens` tokens at once (4 sequences of 2048 by default). For each operation,
forward and forward + backward are timed with CUDA events, the median of `--repeats`
runs after warm-up, for: the PyTorch reference in eager mode, the same compiled with
`torch.compile`, Liger-Kernel's kernel when it is installed, and Planaria's kernel. The
ratio column is the best other implementation's time over Planaria's (above 1: Planaria
is faster). The cross-entropy rows also report the peak memory of forward + backward
above the inputs, which is what computing it in chunks saves.

Before timing an operation, Planaria's output and input gradients are compared with the
eager reference's (norm-wise relative error, reported beside the times): a fast wrong
kernel is no result. A Planaria kernel that falls back to its reference is an error, not
a row of reference timings. An implementation that fails (a Liger or torch.compile
version the script does not know) is reported as failed and the rest still run.

`--smoke` runs every case once at tiny sizes on CPU, the kernels through Triton's
interpreter and torch.compile with its eager backend: it checks the script, not speed,
so that a GPU session does not spend its time finding a bug here.
`tests/kernels/test_benchmark_smoke.py` runs it.

Liger's rotary embedding rotates halves (Hugging Face's layout) where Planaria's rotates
interleaved pairs (LLaMA's original): the same work, a different pairing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from planaria import kernels as K
from planaria.chaos.report import write_json_atomically


@dataclass(frozen=True)
class Sizes:
    hidden: int
    ffn: int
    heads: int
    head_dim: int
    vocab: int
    seq: int  # tokens per sequence


LLAMA_7B = Sizes(hidden=4096, ffn=11008, heads=32, head_dim=128, vocab=32000, seq=2048)
OPERATIONS = ("rms_norm", "swiglu", "apply_rotary", "cross_entropy", "linear_cross_entropy")
SMOKE = Sizes(hidden=48, ffn=80, heads=2, head_dim=16, vocab=300, seq=8)


def time_ms(fn, repeats: int, device: torch.device, warmup: int = 10) -> float:
    """Median milliseconds of `fn()` over `repeats` runs: between two CUDA events on a GPU,
    by the wall clock elsewhere (the smoke run).

    On a GPU the runs are queued back to back with one synchronisation at the end, so each
    pair of events times the GPU's work for one call while the host launches the next (as
    in training, where the host runs ahead). Synchronising before every call would add
    the host's launch latency to each time, and favour whichever implementation launches
    fewer kernels for reasons a training step does not see."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        torch.cuda.synchronize()
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def peak_mib(fn, device: torch.device) -> float | None:
    """Peak memory fn() allocates above what was allocated before it, MiB (GPU only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def _outputs(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def forward_backward(fn, inputs, unit: bool = False):
    """A closure running fn(*inputs) forward and backward (fixed random output gradients,
    or ones with `unit`; fn may return a tuple, as a rotary embedding of q and k does)."""
    leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    grads = [(torch.ones_like if unit else torch.randn_like)(o) for o in _outputs(fn(*leaves))]

    def run():
        for x in leaves:
            x.grad = None
        torch.autograd.backward(_outputs(fn(*leaves)), grads)
    return run


def forward_only(fn, inputs):
    def run():
        with torch.no_grad():
            fn(*inputs)
    return run


def relative_error(fn, reference, inputs) -> float:
    """The largest norm-wise relative error of fn against reference, over the output and
    every floating-point input's gradient."""
    results = []
    for f in (fn, reference):
        leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        outs = _outputs(f(*leaves))
        gen = torch.Generator().manual_seed(7)
        sum(((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in outs)).backward()
        results.append([*outs, *(x.grad for x in leaves if x.requires_grad)])
    return max(((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)).item()
               for got, want in zip(*results))


def liger():
    try:
        from liger_kernel.transformers import functional
        return functional
    except ImportError:
        return None


def cases(tokens: int, dtype: torch.dtype, device: torch.device, sizes: Sizes, compile_backend: str):
    """(name, {implementation: fn}, inputs) per operation."""
    s = sizes
    seqs = max(1, tokens // s.seq)
    seq = tokens // seqs
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    x, w = randn(tokens, s.hidden), randn(s.hidden)
    gate, up = randn(tokens, s.ffn), randn(tokens, s.ffn)
    q, k = randn(seqs, seq, s.heads, s.head_dim), randn(seqs, seq, s.heads, s.head_dim)
    cos, sin = K.rotary_tables(seq, s.head_dim, 10000.0, torch.float32, device)
    logits = randn(tokens, s.vocab)
    target = torch.randint(s.vocab, (tokens,), generator=gen, device=device)
    head = randn(s.vocab, s.hidden, scale=s.hidden ** -0.5)
    lk = liger() if device.type == "cuda" else None

    def compiled(fn):
        return torch.compile(fn, dynamic=False, backend=compile_backend)

    rms_ref = lambda x, w: K.rms_norm_reference(x, w, 1e-5)  # noqa: E731
    # q and k rotated, as attention does (Liger's kernel takes both at once).
    rope_ref = lambda q, k: (K.apply_rotary_reference(q, cos, sin),  # noqa: E731
                             K.apply_rotary_reference(k, cos, sin))
    ce_ref = lambda logits: F.cross_entropy(logits.float(), target)  # noqa: E731
    lce_ref = lambda x, head: F.cross_entropy((x @ head.T).float(), target)  # noqa: E731
    return [
        ("rms_norm", {"eager": rms_ref, "compile": compiled(rms_ref),
                      "liger": (lambda x, w: lk.liger_rms_norm(x, w, 1e-5)) if lk else None,
                      "planaria": lambda x, w: K.rms_norm(x, w, 1e-5)}, [x, w]),
        ("swiglu", {"eager": K.swiglu_reference, "compile": compiled(K.swiglu_reference),
                    "liger": (lambda a, b: lk.liger_swiglu(a, b)) if lk else None,
                    "planaria": K.swiglu}, [gate, up]),
        ("apply_rotary", {"eager": rope_ref, "compile": compiled(rope_ref),
                          "liger": _liger_rope(lk, cos, sin) if lk else None,
                          "planaria": lambda q, k: (K.apply_rotary(q, cos, sin), K.apply_rotary(k, cos, sin))},
         [q, k]),
        ("cross_entropy", {"eager": ce_ref, "compile": compiled(ce_ref),
                           "liger": (lambda logits: lk.liger_cross_entropy(logits, target)) if lk else None,
                           "planaria": lambda logits: K.cross_entropy(logits, target)}, [logits]),
        ("linear_cross_entropy", {"eager": lce_ref, "compile": compiled(lce_ref),
                                  "liger": (lambda x, head: lk.liger_fused_linear_cross_entropy(x, head, target))
                                  if lk else None,
                                  "planaria": lambda x, head: K.linear_cross_entropy(x, head, target)},
         [x, head]),
    ]


def _liger_rope(lk, cos, sin):
    """Liger's rotary on q and k, in its (batch, heads, seq, dim) layout (views of ours:
    it transposes them back before its kernel), with half-rotation tables of the full
    head size."""
    full_cos, full_sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]

    def rope(q, k):
        return tuple(lk.liger_rope(q.transpose(1, 2), k.transpose(1, 2), full_cos.to(q.dtype),
                                   full_sin.to(q.dtype)))
    return rope


def _attempt(what: str, fn, failures: dict):
    """fn(), or None with the reason kept in `failures` (one implementation failing does
    not lose the others' figures)."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - any failure of a third-party kernel is reported, not fatal
        failures[what] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        print(f"  {what} failed: {failures[what]}", file=sys.stderr)
        return None


def run(tokens: int, dtype: torch.dtype, device: torch.device, sizes: Sizes, repeats: int, warmup: int,
        compile_backend: str, ops: list[str]) -> tuple[list[dict], dict]:
    """Every case's rows (times, ratio, error, memory) and the failures, printing the table."""
    implementations = ("eager", "compile", "liger", "planaria")
    print("\n| operation | pass | eager ms | compile ms | liger ms | planaria ms | best other / planaria "
          "| planaria rel. error |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    rows, failures = [], {}
    for name, impls, inputs in cases(tokens, dtype, device, sizes, compile_backend):
        if name not in ops:
            continue
        error = _attempt(f"{name} check", lambda: relative_error(impls["planaria"], impls["eager"], inputs),
                         failures)
        for pass_name, wrap in passes(name):
            times = {impl: _attempt(f"{name} {pass_name} {impl}",
                                    lambda fn=fn: time_ms(wrap(fn, inputs), repeats, device, warmup), failures)
                     if fn is not None else None for impl, fn in impls.items()}
            others = [t for impl, t in times.items() if impl != "planaria" and t is not None]
            ratio = min(others) / times["planaria"] if others and times["planaria"] else None
            rows.append({"operation": name, "pass": pass_name, **{f"{k}_ms": v for k, v in times.items()},
                         "ratio": ratio, "relative_error": error})
            cells = " | ".join("n/a" if times[k] is None else f"{times[k]:.3f}" for k in implementations)
            print(f"| {name} | {pass_name} | {cells} | {_fmt(ratio, '.2f')} | {_fmt(error, '.1e')} |")
        if "cross_entropy" in name and device.type == "cuda":
            memory = {impl: _attempt(f"{name} memory {impl}", lambda fn=fn: peak_mib(forward_backward(fn, inputs),
                                                                                    device), failures)
                      for impl, fn in impls.items() if fn}
            rows.append({"operation": name, "pass": "peak MiB", **memory})
            print(f"| {name} | peak memory above the inputs (MiB) | "
                  + " | ".join(_fmt(memory.get(k), ".0f") for k in implementations) + " | | |")
    return rows, failures


def passes(name: str) -> list[tuple[str, object]]:
    """What is timed of an operation. A loss is also timed with its gradient exactly 1 (a
    plain `loss.backward()`), the case Liger's cross-entropies skip their scaling pass
    for; inside Planaria's pipelines the loss is scaled by 1 / microbatches, as the
    random gradient of the other pass."""
    timed = [("forward", forward_only), ("forward+backward", forward_backward)]
    if name.endswith("cross_entropy"):
        timed.append(("forward+backward, gradient 1", lambda fn, inputs: forward_backward(fn, inputs, unit=True)))
    return timed


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--json", default=None)
    parser.add_argument("--ops", nargs="+", choices=OPERATIONS, default=list(OPERATIONS),
                        help="time only these operations (all by default)")
    parser.add_argument("--smoke", action="store_true",
                        help="run every case once at tiny sizes on CPU (checks the script, not speed)")
    args = parser.parse_args(argv)
    if K.dispatch.triton is None:
        print("benchmarks/kernels.py needs Triton (pip install 'planaria[kernels]')", file=sys.stderr)
        return 2
    if args.smoke and not K.dispatch.interpreting():
        # A machine with a GPU: Triton was imported to compile; the smoke run interprets.
        env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
        return subprocess.run([sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)],
                              env=env).returncode
    if args.smoke and (problem := K.dispatch.interpreter_problem()) is not None:
        print(f"benchmarks/kernels.py --smoke runs the kernels through Triton's interpreter: {problem}",
              file=sys.stderr)
        return 2
    if args.smoke:
        os.environ[K.dispatch.ENV] = "triton"  # the kernels through Triton's interpreter
        device, sizes, tokens, repeats, warmup, backend = torch.device("cpu"), SMOKE, 16, 1, 1, "eager"
    elif not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (--smoke checks the script on CPU; "
              "pytest tests/kernels checks the kernels)", file=sys.stderr)
        return 2
    else:
        device, sizes, tokens, repeats, warmup, backend = (torch.device("cuda"), LLAMA_7B, args.tokens,
                                                           args.repeats, 10, "inductor")
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke: times mean nothing)"
    print(f"device: {name} | torch {torch.__version__} | triton {K.dispatch.triton.__version__} | liger "
          f"{'installed' if liger() else 'not installed'} | {args.dtype}, {tokens} tokens, median of {repeats}")
    with warnings.catch_warnings():
        # A Planaria kernel falling back to its reference would time the reference.
        warnings.filterwarnings("error", message="planaria.kernels:")
        rows, failures = run(tokens, dtype, device, sizes, repeats, warmup, backend, args.ops)
    if args.json:
        write_json_atomically(Path(args.json), {"device": name, "dtype": args.dtype, "tokens": tokens, "rows": rows,
                                "failures": failures})
    planaria_failed = [what for what in failures if what.endswith("planaria") or what.endswith("check")]
    worst = max((r["relative_error"] for r in rows if r.get("relative_error") is not None), default=0.0)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-4
    if planaria_failed or worst > tolerance:
        print(f"Planaria's kernels failed ({', '.join(planaria_failed) or 'none'}) or disagree with the "
              f"reference (worst relative error {worst:.1e} > {tolerance:.0e})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
