"""Compile every fused kernel for a GPU architecture, on a machine without a GPU.

    python -m planaria.kernels.compile_check [--arch 90 80] [--dtype bfloat16 float32]
                                             [--model llama-7b llama3-70b ...] [--json FILE]

Triton's interpreter (the CPU tests) runs a kernel's Python, not Triton's compiler: a
kernel can pass every interpreted test and still fail to compile for a GPU, or spill
registers there. This check runs each operation's real forward and backward on CPU
tensors of a model's sizes with a compile-only Triton driver installed: every launch
they make is compiled by Triton's own pipeline for the target (TTIR, TTGIR, LLVM IR, PTX,
then a cubin through the ptxas Triton ships), with the signature, specialisation, block
sizes and options that launch would have on that GPU, and is not run. The report gives
each kernel's registers per thread, local memory (spills) and shared memory, read from
the cubin by the cuobjdump Triton ships. It says nothing of speed or of the values the
kernels compute: `benchmarks/kernels.py` and `tests/kernels` do, on a GPU.

The kernels are decorated compiled or interpreted when their module is imported, from
`TRITON_INTERPRET`; `planaria.kernels.dispatch` asks for the interpreter on a machine
without a GPU, so the command re-executes itself with `TRITON_INTERPRET=0` when it finds
the kernels interpreted.

Written here because Triton has no public "compile this launch for another machine"
call: it takes the launch as Triton's JIT builds it (through `knobs.runtime.jit_cache_hook`,
before the driver would load the kernel) and compiles it with `triton.compile`.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch

from planaria.kernels import dispatch

ENV = {"TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}


@dataclass(frozen=True)
class ModelShapes:
    """The sizes the kernels see in one transformer layer and the output head."""
    hidden: int
    ffn: int
    heads: int
    head_dim: int
    vocab: int


MODELS = {
    "llama-7b": ModelShapes(hidden=4096, ffn=11008, heads=32, head_dim=128, vocab=32000),
    "llama3-8b": ModelShapes(hidden=4096, ffn=14336, heads=32, head_dim=128, vocab=128256),
    "llama3-70b": ModelShapes(hidden=8192, ffn=28672, heads=64, head_dim=128, vocab=128256),
    # Nothing a power of two: the masks on every block edge.
    "odd": ModelShapes(hidden=1000, ffn=2731, heads=5, head_dim=40, vocab=50257),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class CompiledKernel:
    """One launch compiled for `arch`: what the cubin asks of each thread and block."""
    op: str
    kernel: str
    arch: int
    dtype: str
    model: str
    constants: str
    num_warps: int
    registers: int
    local_bytes: int  # per thread: register spills and stack arrays; 0 in a healthy kernel
    shared_bytes: int
    wide_accesses: int  # global loads and stores in the code moving 16 bytes a thread at once
    narrow_accesses: int  # and those moving less: one element at a time where rows are strided


    def line(self) -> str:
        return (f"sm_{self.arch} {self.model:<11} {self.dtype:<8} {self.op:<13} {self.kernel:<17} "
                f"warps {self.num_warps:>2}  regs {self.registers:>3}  local {self.local_bytes:>5} B  "
                f"shared {self.shared_bytes:>6} B  16-byte accesses {self.wide_accesses:>2} of "
                f"{self.wide_accesses + self.narrow_accesses:>2}  {self.constants}")


class _CompileOnlyDriver:
    """A Triton driver that names a target and a device but can launch nothing: Triton's
    JIT asks it which machine it compiles for, and our hook stops every launch before it
    would load the kernel."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def compiling_for(arch: int, found: list):
    """Within it, every kernel launch is compiled for sm_`arch` and appended to `found` as
    (kernel name, options, constants, compiled kernel), never run."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.driver import driver

    target = GPUTarget("cuda", arch, 32)

    def hook(*, fn, compile, **_):
        # The launch's own options, as the JIT serialises them for its hooks (JSON: lists
        # back to the tuples the options hold).
        options = {k: _tuples(v) for k, v in json.loads(compile["specialization_data"])["options"].items()}
        source = ASTSource(fn.jit_function, compile["signature"], compile["constants"], compile["configs"][0])
        compiled = triton.compile(source, target=target, options=options)
        names = fn.jit_function.arg_names  # Triton keys constants by position
        # The block sizes and switches; lower-case ones are Triton's value specialisations.
        constants = {names[key[0]]: value for key, value in compile["constants"].items()
                     if names[key[0]].isupper()}
        found.append((fn.name, options, constants, compiled))
        seen.add(fn.jit_function)
        return True  # handled: the JIT returns without loading or launching it

    seen: set = set()
    saved_hook = knobs.runtime.jit_cache_hook
    driver.set_active(_CompileOnlyDriver(target))
    knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = saved_hook
        driver.set_active(None)  # back to the machine's own driver, found again when next asked for
        for kernel in seen:
            # Each kernel keeps, per device, the target its launches compile for: forget
            # ours, so that a later real launch in this process compiles for the real GPU.
            kernel.device_caches.clear()


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _run_ops(shapes: ModelShapes, dtype: torch.dtype, tokens: int):
    """Forward and backward of every operation at `shapes`, yielding each operation's name
    once its launches are made."""
    # By module: the package exports functions of the same names.
    rms_norm, swiglu, rotary, cross_entropy = (importlib.import_module(f"planaria.kernels.{name}") for name in
                                               ("rms_norm", "swiglu", "rotary", "cross_entropy"))

    def leaf(*shape):
        return torch.zeros(*shape, dtype=dtype, requires_grad=True)

    def forward_backward(out):
        out.backward(torch.zeros_like(out))

    forward_backward(rms_norm._RMSNorm.apply(leaf(tokens, shapes.hidden), leaf(shapes.hidden), 1e-6))
    yield "rms_norm"
    forward_backward(swiglu._SwiGLU.apply(leaf(tokens, shapes.ffn), leaf(tokens, shapes.ffn)))
    yield "swiglu"
    seq = max(1, tokens // 2)
    cos, sin = rotary.rotary_tables(seq, shapes.head_dim, 10000.0, dtype)
    forward_backward(rotary._Rotary.apply(leaf(2, seq, shapes.heads, shapes.head_dim), cos, sin))
    yield "apply_rotary"
    # The fused head (linear_cross_entropy) launches these same two kernels on each chunk.
    target = torch.zeros(tokens, dtype=torch.long)
    forward_backward(cross_entropy._CrossEntropy.apply(leaf(tokens, shapes.vocab), target, None,
                                                       cross_entropy.IGNORE_INDEX, True))
    yield "cross_entropy"


def _resources(cubin: bytes, name: str) -> dict[str, int]:
    """REG, LOCAL and SHARED of kernel `name` in a cubin, as cuobjdump reports them."""
    from triton import knobs
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                                check=True, capture_output=True, text=True).stdout
    line = report[report.index(f"Function {name}"):].splitlines()[1]
    fields = dict(re.findall(r"(\w+):(\d+)", line))
    return {"registers": int(fields["REG"]), "local_bytes": int(fields["LOCAL"]),
            "shared_bytes": int(fields["SHARED"])}


def _global_accesses(ptx: str) -> dict[str, int]:
    """Global loads and stores in the PTX, by how many bytes each moves for a thread
    (`ld.global.v4.b32`: 16; `ld.global.b16`: 2). Counted in the code, not executed."""
    wide = narrow = 0
    for vector, bits in re.findall(r"\b(?:ld|st)\.global(?:\.[a-z]+)*?(?:\.v(\d))?\.[a-z](\d+)\b", ptx):
        if int(vector or 1) * int(bits) >= 128:
            wide += 1
        else:
            narrow += 1
    return {"wide_accesses": wide, "narrow_accesses": narrow}


def check(arch: int, dtype: str, model: str, tokens: int = 64) -> list[CompiledKernel]:
    """Compile every launch of every operation at `model`'s sizes for sm_`arch`."""
    if dispatch.triton is None:
        raise RuntimeError("Triton is not installed: pip install 'planaria[kernels]'")
    if dispatch.interpreting():
        raise RuntimeError("the kernels were decorated for Triton's interpreter: run the check in a "
                           "process started with TRITON_INTERPRET=0 (the command line does that itself)")
    found: list = []
    ops: list[str] = []
    with compiling_for(arch, found):
        for op in _run_ops(MODELS[model], DTYPES[dtype], tokens):
            ops.extend([op] * (len(found) - len(ops)))
    return [CompiledKernel(op=op, kernel=name, arch=arch, dtype=dtype, model=model,
                           constants=" ".join(f"{k}={v}" for k, v in constants.items()),
                           num_warps=options["num_warps"],
                           **_resources(compiled.asm["cubin"], compiled.metadata.name),
                           **_global_accesses(compiled.asm["ptx"]))
            for op, (name, options, constants, compiled) in zip(ops, found)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90],
                        help="compute capabilities to compile for, e.g. 80 (A100) 90 (H100)")
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bfloat16"])
    parser.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["llama-7b"])
    parser.add_argument("--tokens", type=int, default=64, help="rows of tokens the launches are sized for")
    parser.add_argument("--json", help="write the report to this file as well")
    args = parser.parse_args(argv)
    if dispatch.interpreting():  # the child, started with TRITON_INTERPRET=0, compiles
        env = {**os.environ, **ENV}
        return subprocess.run([sys.executable, "-m", "planaria.kernels.compile_check",
                               *(sys.argv[1:] if argv is None else argv)], env=env).returncode
    results = [r for arch in args.arch for dtype in args.dtype for model in args.model
               for r in check(arch, dtype, model, args.tokens)]
    for r in results:
        print(r.line())
    spilled = [r for r in results if r.local_bytes]
    print(f"{len(results)} kernels compiled; {len(spilled)} use local memory (spills)")
    if args.json:
        _write_json(args.json, [asdict(r) for r in results])
    return 1 if spilled else 0


def _write_json(path: str, payload) -> None:
    # Atomic, as chaos.report.write_json_atomically; planaria.kernels imports nothing else of Planaria.
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
