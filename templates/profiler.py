"""The profiler: per-layer costs measured on the real layers and the real device, cached.

Owns `profile_layers`, which times the forward and backward of real layers, measures
what autograd keeps for backward, and caches the measurements as JSON. It is the one
module of `planaria.templates` that imports torch; nothing else in the package imports
it, so plans can still be made without torch. It knows nothing of Planaria's model:
the caller passes a `build_layer` and a `make_input` (see
`planaria.runtime.profile.profile_model`).

What is measured, for one microbatch at tp = 1 in this process:
- forward and backward time: the median of `repeats` runs after `warmup` discarded
  ones, with the thread count the process has (record: `torch.get_num_threads()`, part
  of the cache key). The trainer's workers run under torchrun with OMP_NUM_THREADS=1;
  pass `num_threads=1` to profile as they run.
- activation bytes: the unique storages autograd saves for backward
  (`saved_tensors_hooks`), minus parameters, buffers and autocast's casts of them,
  which live for the whole step, not per microbatch.
- output bytes: the output's numel x element size (0 for the head: nothing follows).
State bytes (master weights, gradients, Adam moments) are counted, not measured:
parameters x bytes per parameter, as in the analytic model.

All blocks have the same shape, so the embedding, one block and the head are
profiled, and the block's costs are reused for every block.

tp > 1 cannot be measured in one process. Its costs are the tp = 1 measurements with
compute time divided by tp, activations scaled by the analytic model's tp-ratio
(Korthikanti's replicated terms do not shrink), sharded parameters divided by tp, and
the analytic tensor-parallel all-reduce times added. The cache holds the raw tp = 1
measurements, so one profile serves every tp.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from planaria.templates.analytic import (
    bytes_per_parameter,
    check_job,
    layer_activation_bytes,
    tp_communication_times,
)
from planaria.templates.costs import CostModel, Hardware, LayerCost, ModelShape

CACHE_VERSION = 1
_AUTOCAST = {"bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Measurement:
    """One layer measured at tp = 1 for one microbatch; what the cache stores."""

    forward_s: float
    backward_s: float
    activation_bytes: int
    output_bytes: int
    sharded_parameters: int
    """Matrices (dim >= 2), which tensor parallelism splits."""
    replicated_parameters: int
    """Vectors such as norm gains, which every tp worker holds whole."""


def profile_layers(build_layer: Callable[[int], torch.nn.Module],
                   make_input: Callable[[int], torch.Tensor], shape: ModelShape, hw: Hardware, *,
                   tp: int = 1, micro_batch: int, dtype: str, recompute: bool = False,
                   repeats: int = 5, warmup: int = 2, cache_dir: Path | None = None,
                   cache_key: dict | None = None,
                   loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   num_threads: int | None = None) -> CostModel:
    """Measure layers 0, 1 and the head of a model and return its profiled `CostModel`.

    `build_layer(i)` builds layer i at tp = 1 in the parameter dtype on the device to
    profile; `make_input(i)` gives its input for one microbatch (token ids for layer 0,
    hidden states otherwise). `loss_fn(logits)`, if given, is included in the head's
    forward and its backward starts from the loss, as in training; otherwise the head's
    backward starts from a random output gradient. `dtype` is `train.dtype`:
    "bfloat16" runs the layers under autocast. `recompute` must match how
    `build_layer` builds blocks. `num_threads` sets torch's thread count for the
    measurement (restored afterwards). `cache_key` adds whatever else distinguishes
    the layers (model family, kernel choice) to the cache key.
    See the module docstring for what is measured and how tp > 1 is derived.
    """
    check_job(shape, tp=tp, micro_batch=micro_batch, dtype=dtype)
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be at least 1 and warmup at least 0, got {repeats}, {warmup}")
    with _threads(num_threads):
        key = _cache_key(shape, micro_batch, dtype, recompute, make_input(0).device, cache_key)
        path = None if cache_dir is None else Path(cache_dir) / f"profile-{_digest(key)}.json"
        measured = _read_cache(path, key) if path is not None else None
        if measured is None:
            measured = {}
            for kind, index in (("embedding", 0), ("block", 1), ("head", shape.num_layers - 1)):
                layer_loss = loss_fn if kind == "head" else None
                measured[kind] = measure_layer(build_layer(index), make_input(index), dtype=dtype,
                                               repeats=repeats, warmup=warmup, loss_fn=layer_loss,
                                               is_last=kind == "head")
            if path is not None:
                _write_cache(path, key, measured)
    return _assemble(measured, shape, hw, tp=tp, micro_batch=micro_batch, dtype=dtype,
                     recompute=recompute)


@contextmanager
def _threads(num_threads: int | None):
    before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_layer(layer: torch.nn.Module, x: torch.Tensor, *, dtype: str, repeats: int = 5,
                  warmup: int = 2, loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  is_last: bool = False) -> Measurement:
    """Time one layer's forward and backward (medians) and measure what it saves.

    Gradients accumulate into `.grad` across runs as they do across microbatches.
    """
    device = x.device
    if x.is_floating_point():
        x = x.detach().requires_grad_(True)
    autocast = (torch.autocast(device.type, dtype=_AUTOCAST[dtype]) if dtype in _AUTOCAST
                else nullcontext())

    def forward() -> torch.Tensor:
        with autocast:
            out = layer(x)
            return loss_fn(out) if loss_fn is not None else out

    out = forward()
    grad = None if out.dim() == 0 else torch.randn(
        out.shape, dtype=out.dtype, device=device, generator=_generator(device))
    output_bytes = 0 if is_last else out.numel() * out.element_size()
    out.backward(grad)
    forward_times, backward_times = [], []
    for i in range(warmup + repeats):
        _sync(device)
        start = time.perf_counter()
        out = forward()
        _sync(device)
        middle = time.perf_counter()
        out.backward(grad)
        _sync(device)
        if i >= warmup:
            forward_times.append(middle - start)
            backward_times.append(time.perf_counter() - middle)
    sharded = sum(p.numel() for p in layer.parameters() if p.dim() >= 2)
    replicated = sum(p.numel() for p in layer.parameters() if p.dim() < 2)
    return Measurement(forward_s=statistics.median(forward_times),
                       backward_s=statistics.median(backward_times),
                       activation_bytes=saved_activation_bytes(layer, forward),
                       output_bytes=output_bytes, sharded_parameters=sharded,
                       replicated_parameters=replicated)


def saved_activation_bytes(layer: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Bytes of the unique storages autograd saves during `forward()`, state excluded.

    Parameters and buffers (and views of them) live for the whole run; autocast's
    low-precision copies of parameters are cached for the whole autocast region, which
    the engine opens once per step. Neither is per-microbatch activation memory.
    """
    state = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}
    parameters = {id(p) for p in layer.parameters()}
    saved: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in state and not _is_parameter_cast(t, parameters):
            saved[(str(t.device), ptr)] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out  # drop the graph without running backward
    return sum(saved.values())


def _is_parameter_cast(t: torch.Tensor, parameters: set[int]) -> bool:
    """True for autocast's dtype copy of a parameter, or a view of one (F.linear saves W.t()).

    Walks back a chain of one-input autograd nodes (views, the cast) and asks whether
    it ends at a parameter's AccumulateGrad after passing a ToCopy. Activations never
    do: their chains reach the layer input or a node with several inputs.
    """
    fn, cast = t.grad_fn, False
    for _ in range(8):
        if fn is None:
            return False
        if type(fn).__name__ == "AccumulateGrad":
            return cast and id(fn.variable) in parameters
        cast = cast or fn.name() == "ToCopyBackward0"
        inputs = [nxt for nxt, _ in fn.next_functions if nxt is not None]
        if len(inputs) != 1:
            return False
        fn = inputs[0]
    return False


def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _assemble(measured: dict[str, Measurement], shape: ModelShape, hw: Hardware, *, tp: int,
              micro_batch: int, dtype: str, recompute: bool) -> CostModel:
    """The CostModel for `tp` from tp = 1 measurements (see the module docstring)."""
    layers = []
    for index in range(shape.num_layers):
        m = measured[shape.layer_kind(index)]
        comm_f, comm_b = tp_communication_times(shape, index, hw, tp=tp, micro_batch=micro_batch,
                                                dtype=dtype, recompute=recompute)
        estimate = lambda t: layer_activation_bytes(  # noqa: E731
            shape, index, tp=t, micro_batch=micro_batch, dtype=dtype, recompute=recompute)
        activation = m.activation_bytes if tp == 1 else round(
            m.activation_bytes * estimate(tp) / max(estimate(1), 1))
        state = (m.sharded_parameters // tp + m.replicated_parameters) * bytes_per_parameter(dtype)
        layers.append(LayerCost(forward_s=m.forward_s / tp + comm_f,
                                backward_s=m.backward_s / tp + comm_b,
                                state_bytes=state, activation_bytes=activation,
                                output_bytes=m.output_bytes))
    return CostModel(shape=shape, hardware=hw, tp=tp, micro_batch=micro_batch,
                     layers=tuple(layers), source="profiled")


# ---- cache ------------------------------------------------------------------------------


def _cache_key(shape: ModelShape, micro_batch: int, dtype: str, recompute: bool,
               device: torch.device, extra: dict | None) -> dict:
    """Everything that changes the tp = 1 measurements (tp does not: see the module docstring)."""
    return {"version": CACHE_VERSION, "shape": asdict(shape), "micro_batch": micro_batch,
            "dtype": dtype, "recompute": recompute, "device": _device_name(device),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "extra": extra or {}}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{_cpu_name()}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def _read_cache(path: Path, key: dict) -> dict[str, Measurement] | None:
    """The cached measurements, or None when absent, stale, or corrupt (with a warning)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data["key"] != key:  # a hash collision or an older format: measure again
            return None
        return {kind: Measurement(**data["layers"][kind]) for kind in ("embedding", "block", "head")}
    except (OSError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"ignoring unreadable profile cache {path}: {err!r}; measuring again",
                      stacklevel=3)
        return None


def _write_cache(path: Path, key: dict, measured: dict[str, Measurement]) -> None:
    """Write atomically: a temporary file in the same folder, then os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"key": key, "layers": {kind: asdict(m) for kind, m in measured.items()}}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
