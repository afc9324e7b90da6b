"""Which implementation of a fused operation runs: the Triton kernel or its PyTorch reference.

The decision, per call, in this order:

1. the caller's flag (`model.kernels` in a config): "reference" always takes the
   reference; "auto" (the default) and "triton" go on;
2. `PLANARIA_KERNELS=reference` takes the reference too; otherwise the kernel runs when
   Triton is installed and the tensors are on a GPU, or when `PLANARIA_KERNELS=triton`
   asks for it on CPU, where the kernel runs through Triton's interpreter (slow: for
   tests and debugging only);
3. the operation's own check of the shapes and dtypes (`unsupported`, a reason or None).

When Triton was asked for (the flag or the environment) but cannot run, or the shape is
not supported, the reference runs and a warning says why, once per operation and reason.
One such reason is an interpreter that cannot run in this environment
(`interpreter_problem`: Triton before 3.7 with numpy 2.4 or later).
"auto" on a machine without a GPU takes the reference silently: that is the CPU path.

Triton decides at decoration time whether a kernel is compiled or interpreted, from
`TRITON_INTERPRET`. Without a GPU no kernel can be compiled, so this module sets
`TRITON_INTERPRET=1` before importing Triton when no GPU is present (unless the
environment already says otherwise); the kernels are then decorated as interpreted
functions, which run only when `PLANARIA_KERNELS=triton` selects them.
"""
from __future__ import annotations

import os
import re
import warnings

import numpy
import torch

MODES = ("auto", "triton", "reference")
ENV = "PLANARIA_KERNELS"

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
except ImportError:  # the references still work; the dispatcher says so when asked for Triton
    triton = None
    tl = None

_warned: set[tuple[str, str]] = set()


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {MODES}, got {mode!r}")
    return mode


def _env_mode() -> str | None:
    value = os.environ.get(ENV, "").strip().lower()
    if value and value not in ("triton", "reference"):
        raise ValueError(f"{ENV}={value!r}: set it to 'triton' or 'reference', or unset it")
    return value or None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _release(version: str) -> tuple[int, int]:
    major, minor = (int(part) for part in re.findall(r"\d+", version)[:2])
    return major, minor


def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run the kernels in this environment, or None.

    Before Triton 3.7 the interpreter turns a kernel's scalar arguments into arrays of
    one element and calls `int()` on them for loop bounds; numpy 2.4 made that an error,
    so every kernel with a loop (RMSNorm's backward, the cross-entropies) fails deep
    inside Triton with "only 0-dimensional arrays can be converted to Python scalars".
    Compiled kernels (on a GPU) are not affected."""
    if triton is None:
        return None
    if _release(triton.__version__) < (3, 7) and _release(numpy.__version__) >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter cannot run with numpy {numpy.__version__} "
                "(loops over scalar arguments fail); Triton 3.7 or later, or numpy below 2.4, runs it")
    return None


def _imported_compiled() -> bool:
    """Triton was imported before this module could ask for its interpreter: its own
    library (tl.sum, ...) is then compiled-only and no kernel can run on CPU."""
    return type(tl.sum).__name__ != "InterpretedFunction"


def use_triton(op: str, mode: str, *tensors: torch.Tensor, unsupported: str | None = None) -> bool:
    """Whether `op` runs its Triton kernel on `tensors` (see the module docstring)."""
    if check_mode(mode) == "reference":
        return False
    env = _env_mode()
    if env == "reference":
        return False
    asked = mode == "triton" or env == "triton"
    on_gpu = all(t.is_cuda for t in tensors)
    if triton is None:
        reason = "Triton is not installed (pip install 'planaria[kernels]')"
    elif on_gpu and interpreting():
        reason = "TRITON_INTERPRET=1 is set on a machine with a GPU; unset it to compile the kernels"
    elif not on_gpu and not (env == "triton" and interpreting()):
        reason = ("the tensors are not on a GPU (PLANARIA_KERNELS=triton runs the kernels through "
                  "Triton's interpreter on CPU, for testing)")
    elif not on_gpu and (problem := interpreter_problem()) is not None:
        reason = problem
    elif not on_gpu and _imported_compiled():
        reason = ("Triton was imported before planaria.kernels, without TRITON_INTERPRET=1: set "
                  "TRITON_INTERPRET=1 in the environment, or import planaria first")
    elif unsupported is not None:
        _warn_once(op, unsupported)  # Triton would run: the shape is why it does not
        return False
    else:
        return True
    if asked or on_gpu:
        _warn_once(op, reason)
    return False


def describe(mode: str) -> str:
    """What `mode` runs on this machine, for a job's start-up line (GPU tensors assumed
    where a GPU is present)."""
    env = _env_mode()
    if check_mode(mode) == "reference" or env == "reference":
        return "PyTorch references"
    if triton is None:
        return "PyTorch references (Triton is not installed)"
    if torch.cuda.is_available() and not interpreting():
        return "Triton"
    if env == "triton" and interpreting() and not _imported_compiled():
        problem = interpreter_problem()
        return ("Triton through its interpreter (slow: for tests)" if problem is None
                else f"PyTorch references ({problem})")
    return "PyTorch references (no GPU)"


def _warn_once(op: str, reason: str) -> None:
    if (op, reason) not in _warned:
        _warned.add((op, reason))
        warnings.warn(f"planaria.kernels: {op} runs its PyTorch reference: {reason}", stacklevel=3)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def program_count(device: torch.device, blocks: int) -> int:
    """Programs for a kernel that loops over blocks of rows and keeps per-program partial
    sums: one per streaming multiprocessor on a GPU, a few in the interpreter."""
    if device.type == "cuda":
        return max(1, min(blocks, torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(blocks, 4))


def rows_per_block(width: int) -> int:
    """Rows one program takes at once, for rows `width` elements wide (a power of two).

    Compiled (for a GPU), a few rows only when they are narrow (one row of a 7B model's
    4096 fills a program's registers). In the interpreter every operation of a program
    costs the same Python overhead whatever its size, so a block holds as many rows as fit
    16k elements: without that, training even the tiny model through it takes minutes a
    step. The choice follows how the kernels run, not where the tensors are, so that
    `planaria.kernels.compile_check` compiles, on a machine without a GPU, the blocks a
    GPU would launch."""
    budget, limit = (16384, 1024) if interpreting() else (2048, 16)
    rows = max(1, min(limit, budget // max(1, width)))
    return 1 << (rows.bit_length() - 1)  # the largest power of two not above it


def elementwise_block() -> int:
    """Elements one program of an elementwise kernel takes: larger in the interpreter,
    where each program's operations cost the same whatever their size (see
    `rows_per_block`)."""
    return 16384 if interpreting() else 1024


def warps(elements: int) -> int:
    """Warps for a program holding `elements` values at once: more threads for wider
    blocks, so that each keeps a few dozen values in registers. The thresholds are
    Liger-Kernel's; with one fewer step (8 warps for 8192), `compile_check` shows the
    RMSNorm backward of a 70B model's rows at 224 registers a thread, one block per SM."""
    return 4 if elements < 2048 else 8 if elements < 8192 else 16 if elements < 32768 else 32
