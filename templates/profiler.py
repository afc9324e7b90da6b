"""The profiler: per-layer costs measured on the real layers and the real device, cached.

Owns `profile_layers`, which times the forward and backward of real layers, measures
what autograd keeps for backward, and caches the measurements as JSON
(`templates/profile_cache.py`). It and the two modules it uses, `profile_cache.py` and
`gloo_links.py` (the links between two worker processes), are the only modules of
`planaria.templates` that import torch; nothing else in the package imports them, so
plans can still be made without torch. It knows nothing of Planaria's model:
the caller passes a `build_layer` and a `make_input` (see
`planaria.runtime.planning.measured_costs.profile_model`).

What is measured, for one microbatch at tp = 1 in this process:
- forward and backward time: the mean of `repeats` runs after `warmup` discarded
  ones (`statistic="median"` for the median), with the thread count the process has
  (record: `torch.get_num_threads()`, part of the cache key). The trainer's workers run
  under torchrun with OMP_NUM_THREADS=1; pass `num_threads=1` to profile as they run.
  The mean, because an iteration is a sum of many layer runs and so costs the sum of
  their means: on a shared machine a layer's times are skewed to the right (a
  preempted core, a busy neighbour), and the median leaves that out.
- the parameter update, once per iteration (`optimizer_s`): the layer's gradient norm,
  clipping with it, the optimizer's step (`make_optimizer(layer)`, default
  `AdamW(foreach=False)`; Planaria's profile passes its engine's, one optimizer per layer) and
  zeroing the gradients, on the gradients the backward runs left.
- activation bytes: the unique storages autograd saves for backward
  (`saved_tensors_hooks`), minus parameters, buffers and autocast's casts of them,
  which live for the whole step, not per microbatch.
- output bytes: the output's numel x element size (0 for the head: nothing follows).
State bytes (master weights, gradients, Adam moments) are counted, not measured:
parameters x bytes per parameter, as in the analytic model.

With `measure_links=True` (CPU jobs, whose workers talk through gloo over loopback
TCP) the links are measured too (`templates/gloo_links.py`), and replace the hardware's
link figures.

All blocks have the same shape, so the embedding, one block and the head are
profiled, and the block's costs are reused for every block.

tp > 1 cannot be measured in one process. Its costs are the tp = 1 measurements with
compute time divided by tp, activations scaled by the analytic model's tp-ratio
(Korthikanti's replicated terms do not shrink), sharded parameters divided by tp, and
the analytic tensor-parallel all-reduce times added. The cache holds the raw tp = 1
measurements, so one profile serves every tp.
"""
from __future__ import annotations

import statistics
import time
import warnings
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Callable

import torch

from planaria.templates.analytic import (
    bytes_per_parameter,
    gradient_element_bytes,
    check_job,
    layer_activation_bytes,
    tp_communication_times,
)
from planaria.templates.costs import CostModel, Hardware, LayerCost, ModelShape
from planaria.templates.gloo_links import GlooLinks, measure_gloo_links
from planaria.templates.profile_cache import (
    Measurement,
    cache_file,
    measurement_key,
    read_cache,
    write_cache,
)

STATISTICS = ("mean", "median")
_AUTOCAST = {"bfloat16": torch.bfloat16}


def profile_layers(build_layer: Callable[[int], torch.nn.Module],
                   make_input: Callable[[int], torch.Tensor], shape: ModelShape, hw: Hardware, *,
                   tp: int = 1, micro_batch: int, dtype: str, recompute: bool = False,
                   wide_gradients: bool = False,
                   repeats: int = 5, warmup: int = 2, cache_dir: Path | None = None,
                   cache_key: dict | None = None,
                   loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   num_threads: int | None = None,
                   make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
                   statistic: str = "mean", measure_links: bool = False,
                   background: Callable[[], AbstractContextManager] | None = None,
                   link_measurer: Callable[[int], GlooLinks] | None = None) -> CostModel:
    """Measure layers 0, 1 and the head of a model and return its profiled `CostModel`.

    `build_layer(i)` builds layer i at tp = 1 in the parameter dtype on the device to
    profile; `make_input(i)` gives its input for one microbatch (token ids for layer 0,
    hidden states otherwise). `loss_fn(logits)`, if given, is included in the head's
    forward and its backward starts from the loss, as in training; otherwise the head's
    backward starts from a random output gradient. `dtype` is `train.dtype`:
    "bfloat16" runs the layers under autocast. `recompute` must match how
    `build_layer` builds blocks. `num_threads` sets torch's thread count for the
    measurement (restored afterwards). `cache_key` adds whatever else distinguishes
    the layers (model family, kernel choice) to the cache key. `make_optimizer(layer)`
    builds the optimizer whose step is timed (default `AdamW(foreach=False)`).
    `statistic` ("mean" or "median") summarises the timed repeats. `measure_links`
    also measures gloo links between two processes and puts them into the hardware
    (for CPU jobs; see `measure_gloo_links`). `background()`, when given, is entered
    around the layer measurements (not the links'): the caller's way to measure under
    the load the job's other workers put on the same machine; name it in `cache_key`.
    `link_measurer(message_bytes)`, used with `measure_links` instead of
    `measure_gloo_links`, lets the caller measure more in the same pair of processes
    (the runtime's pipeline probe: `Hardware.action_overhead_s`, which this module
    cannot import; name it in `cache_key` too). See the module docstring for what is
    measured and how tp > 1 is derived.
    """
    check_job(shape, tp=tp, micro_batch=micro_batch, dtype=dtype)
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be at least 1 and warmup at least 0, got {repeats}, {warmup}")
    if statistic not in STATISTICS:
        raise ValueError(f"statistic {statistic!r} is unknown; use one of {list(STATISTICS)}")
    with _threads(num_threads):
        key = measurement_key(shape, micro_batch, dtype, recompute, make_input(0).device,
                              {**(cache_key or {}), "statistic": statistic, "links": measure_links})
        path = None if cache_dir is None else cache_file(cache_dir, key)
        cached = read_cache(path, key) if path is not None else None
        if cached is None:
            measured = {}
            with (background or nullcontext)():
                for kind, index in (("embedding", 0), ("block", 1), ("head", shape.num_layers - 1)):
                    layer_loss = loss_fn if kind == "head" else None
                    measured[kind] = measure_layer(build_layer(index), make_input(index), dtype=dtype,
                                                   repeats=repeats, warmup=warmup, loss_fn=layer_loss,
                                                   is_last=kind == "head", make_optimizer=make_optimizer,
                                                   statistic=statistic)
            links = None
            if measure_links:
                try:
                    links = (link_measurer or measure_gloo_links)(
                        max(measured["block"].output_bytes, 1))
                except RuntimeError as err:  # plan on with the preset's links, and say so
                    warnings.warn(f"could not measure gloo links ({err}); using the "
                                  f"{hw.name!r} preset's", stacklevel=2)
            if path is not None and (links is not None or not measure_links):  # else: retry next time
                write_cache(path, key, measured, links)
        else:
            measured, links = cached
    if links is not None:
        hw = links.apply(hw)
    return _assemble(measured, shape, hw, tp=tp, micro_batch=micro_batch, dtype=dtype,
                     recompute=recompute, wide_gradients=wide_gradients)


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
                  is_last: bool = False,
                  make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
                  statistic: str = "mean") -> Measurement:
    """Time one layer's forward and backward and its parameter update (`statistic` of
    the repeats) and measure what it saves.

    Gradients accumulate into `.grad` across runs as they do across microbatches. The
    update is timed last, on those gradients; it changes the layer's parameters.
    """
    summary = {"mean": statistics.fmean, "median": statistics.median}[statistic]
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
    activation = saved_activation_bytes(layer, forward)
    update = measure_update(layer, make_optimizer, repeats=repeats, warmup=warmup,
                            summary=summary)
    return Measurement(forward_s=summary(forward_times), backward_s=summary(backward_times),
                       activation_bytes=activation, output_bytes=output_bytes,
                       sharded_parameters=sharded, replicated_parameters=replicated,
                       optimizer_s=update)


def measure_update(layer: torch.nn.Module,
                   make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None, *,
                   repeats: int = 5, warmup: int = 2, summary=statistics.fmean) -> float:
    """Seconds of one layer's once-per-iteration parameter update, as a training step
    does it per layer: gradient norm, clip by it, optimizer step, zero the gradients.

    Runs on the gradients the layer holds (zeros where it has none), restored before
    every repeat; the first step creates the optimizer's state and is a warm-up. When a
    hook summed them wide, in `p.main_grad` (the runtime's `train.exact_reduction`), the
    timed update also rounds them into `p.grad` and takes the norm of the wide sums, as
    the trainer does.
    """
    params = [p for p in layer.parameters() if p.requires_grad]
    if not params:
        return 0.0
    optimizer = (make_optimizer(layer) if make_optimizer is not None
                 else torch.optim.AdamW(params, foreach=False))
    wide = next((p.main_grad.dtype for p in params
                 if getattr(p, "main_grad", None) is not None), None)
    grads = [_held_gradient(p, wide) for p in params]
    device = params[0].device
    times = []
    for i in range(max(warmup, 1) + repeats):
        for p, g in zip(params, grads):
            if wide is not None:
                p.main_grad = g.clone()
            else:
                p.grad = g.clone()
        _sync(device)
        start = time.perf_counter()
        if wide is not None:
            for p in params:
                p.grad = p.main_grad.to(p.dtype)
        summed = [p.main_grad if wide is not None else p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(summed, foreach=True)
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm.to(params[0].dtype), foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if i >= max(warmup, 1):
            times.append(time.perf_counter() - start)
    return summary(times)


def _held_gradient(p: torch.Tensor, wide: torch.dtype | None) -> torch.Tensor:
    """`p`'s summed gradient (`main_grad` in dtype `wide` when summed wide), or zeros
    for a parameter no backward reached, as the trainer gives it."""
    held = getattr(p, "main_grad", None) if wide is not None else p.grad
    if held is not None:
        return held.detach().clone()
    return torch.zeros_like(p, dtype=wide or p.dtype)


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
              micro_batch: int, dtype: str, recompute: bool, wide_gradients: bool = False) -> CostModel:
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
        parameters = m.sharded_parameters // tp + m.replicated_parameters
        state = parameters * bytes_per_parameter(dtype, wide_gradients)
        # The update's work is per element, so its time shrinks with this worker's share.
        total = m.sharded_parameters + m.replicated_parameters
        share = (m.sharded_parameters / tp + m.replicated_parameters) / total if total else 1.0
        layers.append(LayerCost(forward_s=m.forward_s / tp + comm_f,
                                backward_s=m.backward_s / tp + comm_b,
                                state_bytes=state, activation_bytes=activation,
                                gradient_bytes=parameters * gradient_element_bytes(dtype, wide_gradients),
                                wide_sum_bytes=state - parameters * bytes_per_parameter(dtype),
                                output_bytes=m.output_bytes, optimizer_s=m.optimizer_s * share))
    return CostModel(shape=shape, hardware=hw, tp=tp, micro_batch=micro_batch,
                     layers=tuple(layers), source="profiled")
