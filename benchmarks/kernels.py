"""Planaria's Triton kernels against PyTorch eager, torch.compile and Liger-Kernel, on a GPU.

    python benchmarks/kernels.py [--dtype bfloat16] [--tokens 8192] [--repeats 100] [--json FILE]

Sizes are a 7B-class LLaMA's (hidden 4096, SwiGLU 11008, 32 heads of 128, vocabulary
32000), `--tokens` tokens at once (4 sequences of 2048 by default). For each operation,
forward and forward + backward are timed with CUDA events, the median of `--repeats`
runs after warm-up, for: the PyTorch reference in eager mode, the same compiled with
`torch.compile`, Liger-Kernel's kernel when it is installed, and Planaria's kernel. The
ratio column is the best other implementation's time over Planaria's (above 1: Planaria
is faster). The cross-entropy rows also report the peak memory of forward + backward
above the inputs, which is what computing it in chunks saves.

Liger's rotary embedding rotates halves (Hugging Face's layout) where Planaria's rotates
interleaved pairs (LLaMA's original): the same work, a different pairing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from planaria import kernels as K


def time_ms(fn, repeats: int, warmup: int = 10) -> float:
    """Median milliseconds of `fn()` over `repeats` runs, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mib(fn) -> float:
    """Peak memory fn() allocates above what was allocated before it, MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def forward_backward(fn, inputs):
    """A closure running fn(*inputs) forward and backward (a fixed random output gradient)."""
    leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    grad = torch.randn_like(out)

    def run():
        for x in leaves:
            x.grad = None
        fn(*leaves).backward(grad)
    return run


def forward_only(fn, inputs):
    def run():
        with torch.no_grad():
            fn(*inputs)
    return run


def liger():
    try:
        from liger_kernel.transformers import functional
        return functional
    except ImportError:
        return None


def cases(tokens: int, dtype: torch.dtype):
    """(name, {implementation: fn}, inputs) per operation."""
    dev = "cuda"
    hidden, ffn, heads, head_dim, vocab = 4096, 11008, 32, 128, 32000
    seqs = max(1, tokens // 2048)
    seq = tokens // seqs
    x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    w = torch.randn(hidden, device=dev, dtype=dtype)
    gate, up = (torch.randn(tokens, ffn, device=dev, dtype=dtype) for _ in range(2))
    q = torch.randn(seqs, seq, heads, head_dim, device=dev, dtype=dtype)
    cos, sin = K.rotary_tables(seq, head_dim, 10000.0, torch.float32, dev)
    logits = torch.randn(tokens, vocab, device=dev, dtype=dtype)
    target = torch.randint(vocab, (tokens,), device=dev)
    head = torch.randn(vocab, hidden, device=dev, dtype=dtype) * hidden ** -0.5
    lk = liger()

    def compiled(fn):
        return torch.compile(fn, dynamic=False)

    rms_ref = lambda x, w: K.rms_norm_reference(x, w, 1e-5)  # noqa: E731
    rope_ref = lambda q: K.apply_rotary_reference(q, cos, sin)  # noqa: E731
    ce_ref = lambda logits: F.cross_entropy(logits.float(), target)  # noqa: E731
    lce_ref = lambda x, head: F.cross_entropy((x @ head.T).float(), target)  # noqa: E731
    out = [
        ("rms_norm", {"eager": rms_ref, "compile": compiled(rms_ref),
                      "liger": (lambda x, w: lk.liger_rms_norm(x, w, 1e-5)) if lk else None,
                      "planaria": lambda x, w: K.rms_norm(x, w, 1e-5)}, [x, w]),
        ("swiglu", {"eager": K.swiglu_reference, "compile": compiled(K.swiglu_reference),
                    "liger": (lambda a, b: lk.liger_swiglu(a, b)) if lk else None,
                    "planaria": K.swiglu}, [gate, up]),
        ("apply_rotary", {"eager": rope_ref, "compile": compiled(rope_ref),
                          "liger": _liger_rope(lk, cos, sin) if lk else None,
                          "planaria": lambda q: K.apply_rotary(q, cos, sin)}, [q]),
        ("cross_entropy", {"eager": ce_ref, "compile": compiled(ce_ref),
                           "liger": (lambda logits: lk.liger_cross_entropy(logits, target)) if lk else None,
                           "planaria": lambda logits: K.cross_entropy(logits, target)}, [logits]),
        ("linear_cross_entropy", {"eager": lce_ref, "compile": compiled(lce_ref),
                                  "liger": (lambda x, head: lk.liger_fused_linear_cross_entropy(x, head, target))
                                  if lk else None,
                                  "planaria": lambda x, head: K.linear_cross_entropy(x, head, target)},
         [x, head]),
    ]
    return out


def _liger_rope(lk, cos, sin):
    """Liger's rotary on q and k of the same shape, in its (batch, heads, seq, dim) layout,
    with half-rotation tables of the full head size; the time of one tensor is half."""
    full_cos, full_sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]

    def rope(q):
        qt = q.transpose(1, 2)
        out_q, out_k = lk.liger_rope(qt, qt, full_cos.to(q.dtype), full_sin.to(q.dtype))
        return out_q + out_k  # one output to take the backward from
    return rope


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available() or K.dispatch.triton is None:
        print("benchmarks/kernels.py needs a CUDA GPU and Triton; the CPU tests cover correctness "
              "(pytest tests/kernels)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
          f"{K.dispatch.triton.__version__} | liger {'installed' if liger() else 'not installed'} | "
          f"{args.dtype}, {args.tokens} tokens, median of {args.repeats}")
    print("\n| operation | pass | eager ms | compile ms | liger ms | planaria ms | best other / planaria |")
    print("|---|---|---:|---:|---:|---:|---:|")
    rows = []
    for name, impls, inputs in cases(args.tokens, dtype):
        for pass_name, wrap in (("forward", forward_only), ("forward+backward", forward_backward)):
            times = {impl: (time_ms(wrap(fn, inputs), args.repeats) if fn is not None else None)
                     for impl, fn in impls.items()}
            others = [t for impl, t in times.items() if impl != "planaria" and t is not None]
            ratio = min(others) / times["planaria"]
            rows.append({"operation": name, "pass": pass_name, **{f"{k}_ms": v for k, v in times.items()},
                         "ratio": ratio})
            cells = " | ".join("n/a" if times[k] is None else f"{times[k]:.3f}"
                               for k in ("eager", "compile", "liger", "planaria"))
            print(f"| {name} | {pass_name} | {cells} | {ratio:.2f} |")
        if "cross_entropy" in name:
            memory = {impl: peak_mib(forward_backward(fn, inputs)) for impl, fn in impls.items() if fn}
            rows.append({"operation": name, "pass": "peak MiB", **memory})
            print(f"| {name} | peak memory above the inputs (MiB) | "
                  + " | ".join(f"{memory[k]:.0f}" if k in memory else "n/a"
                               for k in ("eager", "compile", "liger", "planaria")) + " | |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "dtype": args.dtype,
                                               "tokens": args.tokens, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
