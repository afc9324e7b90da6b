"""A joiner's cold start taken before it is planned in, not in the join's first step.

A process's first iterations cost more than its later ones: the allocator's first
blocks, autograd's first graph, each operator's first dispatch (on a GPU also cuBLAS's
and cuDNN's handles and workspaces, SDPA's choice of kernel, a compiled block's
compilation). Measured on CPU for the tiny config (two ranks): a new process's first
step took 1.5-2x the CPU of a steady one, and the next four about 1.3x. A joiner's first
steps are the join's epoch's first steps, and in a pipeline every rank waits for the
slowest: the whole job pays for the joiner's cold start at the switch. On CPU with the
tiny config that is milliseconds, lost in the noise of the join's pause
(docs/benchmarks.md); on a GPU it is cuBLAS's and the compiler's seconds.

`warm_up` runs the iterations a joiner's rank will run, on throwaway copies of the
layers it is planned to hold, with synthetic data and no collective: each of its
stage's chunks forward and backward on one microbatch, and an optimizer step of the
same settings, `iterations` times. It is called while the job still trains (the joiner
is planned in; its groups are not yet connected: `ElasticWorker._planned_in`), so the
job pays nothing for it. The layers are built with no tensor-parallel group (their
forward's all-reduce needs the epoch's): with tp > 1 it is skipped.
"""
from __future__ import annotations

import contextlib
import time

import torch

from planaria.runtime.models.llama import LayerModel
from planaria.runtime.models.tensor_parallel import TensorParallel
from planaria.runtime.parallel.grad_sync import accumulate_wide, local_grad
from planaria.runtime.parallel.optim import OptimizerSettings, build_optimizer
from planaria.runtime.parallel.precision import compute_params
from planaria.templates.plan import Plan

ITERATIONS = 3
"""The first iteration carries most of a cold start, the next few the rest (above); three
took 0.13 s in a new process for the tiny config on CPU, most of it the first."""


def warm_up(model: LayerModel, optim: OptimizerSettings, settings, plan: Plan, rank: int,
            iterations: int = ITERATIONS, budget_s: float | None = None) -> float | None:
    """Run `iterations` of rank `rank`'s computation of `plan` on throwaway layers
    (module docstring); the seconds it took, or None when it was skipped (tp > 1).
    `settings`: the engine's (`EngineSettings`): dtypes, device, wide gradient sums.
    `budget_s`: no iteration after the first starts once this much has passed (the
    job's other workers wait for this one's connection meanwhile, up to their connect
    timeout)."""
    if plan.tp > 1:
        return None
    started = time.perf_counter()
    tp = TensorParallel()
    chunks = plan.stage_of(rank).chunks
    layers = {index: _layer(model, settings, index, tp) for start, stop in chunks for index in range(start, stop)}
    optimizers = [build_optimizer(layer, optim) for layer in layers.values()]
    for iteration in range(iterations):
        if iteration and budget_s is not None and time.perf_counter() - started > budget_s:
            break
        for start, stop in chunks:
            _forward_backward(model, settings, [layers[i] for i in range(start, stop)], start, stop,
                              plan.micro_batch, tp)
        for layer, optimizer in zip(layers.values(), optimizers):
            _step(layer, optimizer, settings.wide_sums)
    if settings.device.type == "cuda":
        torch.cuda.synchronize(settings.device)
    return time.perf_counter() - started


def _layer(model: LayerModel, settings, index: int, tp: TensorParallel) -> torch.nn.Module:
    """Layer `index` as the engine builds it, its values neither drawn nor read (a
    large model's seeded init costs as much as a checkpoint read) but zeroed (what was
    in the memory could be anything)."""
    layer = model.build_layer(index, tp, settings.param_dtype, settings.device, pretrained=False,
                              initialised=False)
    with torch.no_grad():
        for p in layer.parameters():
            p.zero_()
    if settings.wide_sums is not None:
        accumulate_wide(layer, settings.wide_sums)
    return layer


def _step(layer: torch.nn.Module, optimizer: torch.optim.Optimizer, wide: torch.dtype | None) -> None:
    """The optimizer's step as the engine takes it: with gradients summed wide, each
    rounded into `grad` first (`grad_sync.sync_gradients`; without it the step would
    skip every parameter, their `grad` empty)."""
    if wide is not None:
        for p in layer.parameters():
            p.grad = local_grad(p, wide).to(p.dtype)
            p.main_grad = None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _forward_backward(model: LayerModel, settings, layers: list[torch.nn.Module], start: int, stop: int,
                      micro_batch: int, tp: TensorParallel) -> None:
    """One microbatch through layers start..stop-1 and back, as a pipeline stage runs them:
    the stage's input made as `stage_examples` describes it, the loss where the last
    layer is the head, else the output's gradient taken as ones."""
    example, _ = model.stage_examples(start, stop, micro_batch, tp.size, settings.read_dtype,
                                      settings.autocast_dtype, requires_grad=True)
    shape, device = tuple(example.shape), settings.device
    # Its own generator: the process's random state is the job's, untouched here.
    gen = torch.Generator().manual_seed(start)
    if example.dtype == torch.int64:
        x = torch.randint(0, model.cfg.vocab_size, shape, generator=gen).to(device)
    else:
        x = torch.randn(shape, generator=gen).to(device=device, dtype=example.dtype).requires_grad_()
    autocast = (contextlib.nullcontext() if settings.autocast_dtype is None
                else torch.autocast(device.type, dtype=settings.autocast_dtype))
    with autocast, compute_params(layers, settings.compute_dtype):
        out = x
        for layer in layers:
            out = layer(out)
        if stop == model.num_layers:
            targets = torch.randint(0, model.cfg.vocab_size, shape[:2], generator=gen).to(device)
            out = model.loss(out, targets, tp, head=layers[-1] if model.cfg.fused_head_loss else None)
    if out.dim() == 0:
        out.backward()
    else:
        out.backward(torch.ones_like(out))
