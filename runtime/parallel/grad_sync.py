"""The gradient sync of one step: each layer's gradient summed over the workers that
share its weights, so that every replica takes the same step.

Three kinds of sharing, summed in this order once per step (the sums commute, since
gradients are linear in the microbatches, so none runs per microbatch):

1. a layer's replicas in other pipelines: one all-reduce per bucket of layers with the
   same replica group (`EpochGroups.buckets`);
2. key/value heads replicated across tensor-parallel ranks (tp above the key/value
   heads): each holder computed only its own query heads' part;
3. a tied weight (the embedding's and the head's copies, often on different stages):
   summed over every rank holding either copy.

With wide sums (`train.exact_reduction`), gradients accumulate in `main_grad` in a wider
dtype (`accumulate_wide`) and are rounded into `grad` once, after the sync, so that the
sum does not depend on the plan's split of the batch.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from planaria.runtime.models.llama import LayerModel
from planaria.runtime.models.tensor_parallel import TensorParallel, sum_over_head_replicas
from planaria.runtime.parallel.groups import EpochGroups, TiedGroup


def accumulate_wide(module: nn.Module, dtype: torch.dtype) -> None:
    """Sum `module`'s gradients over microbatches in `dtype`, in each parameter's
    `main_grad` (None until the first microbatch's gradient arrives).

    A post-accumulate hook moves each microbatch's gradient there as soon as autograd
    has put it in `p.grad`, which is left empty for the next microbatch. The profiler
    registers the same hook, so that the cost model times backward as training runs it.
    """
    def move(p: torch.Tensor) -> None:
        if p.main_grad is None:
            p.main_grad = p.grad.to(dtype)
        else:
            p.main_grad.add_(p.grad)
        p.grad = None

    for p in module.parameters():
        p.main_grad = None
        p.register_post_accumulate_grad_hook(move)


def local_grad(p: torch.Tensor, wide: torch.dtype | None) -> torch.Tensor:
    """A parameter's gradient as summed so far: `main_grad` when gradients accumulate
    wide, else `grad` (zeros for a parameter this iteration did not reach)."""
    if wide is not None:
        if p.main_grad is None:
            p.main_grad = torch.zeros_like(p, dtype=wide)
        return p.main_grad
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def sync_gradients(layers: Mapping[int, nn.Module], groups: EpochGroups, *, model: LayerModel,
                   tp: TensorParallel, tied: Mapping[int, str], wide: torch.dtype | None) -> None:
    """Sum the gradients of this worker's `layers` (index -> its tp shard's module) over
    their replica groups, one bucket per distinct group, then replicated key/value heads'
    over the tp ranks holding them, and the tied weight's (`tied`: layer -> the name of
    its copy) over its own group; then, when gradients accumulate `wide`, round them
    into `grad` once."""
    for bucket in groups.buckets:
        if bucket.group is None:
            continue
        grads = [local_grad(p, wide) for layer in bucket.layers
                 for name, p in layers[layer].named_parameters()
                 if name != tied.get(layer)]  # summed over the tied group instead
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=bucket.group)
        for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)
    _sync_kv_head_replicas(layers, model, tp, wide)
    if groups.tied is not None:
        _sync_tied(layers, groups.tied, tied, wide)
    if wide is not None:
        for module in layers.values():
            for p in module.parameters():
                p.grad = local_grad(p, wide).to(p.dtype)


def _sync_kv_head_replicas(layers: Mapping[int, nn.Module], model: LayerModel, tp: TensorParallel,
                           wide: torch.dtype | None) -> None:
    """Where tp exceeds the key/value heads, each tp rank holding a head computed only
    its own query heads' part of wk's and wv's gradients: sum those over the head's
    replicas, for all of this rank's layers at once (`sum_over_head_replicas`).

    One collective over the stage's tp group per step, after the replica-group buckets.
    It cannot deadlock: the tp peers of a stage hold the same layers, so they all call
    it (or all skip it) at the same point of the same sequence, and none waits in it
    for a collective of another group, since every rank has finished its buckets (whose
    order is consistent across replica groups already) before entering it. After the
    buckets, a head's replicas in every pipeline hold the same per-tp-rank sums, and
    the gathered, fixed-order sum then gives every holder the same bits."""
    grads = [local_grad(layers[index].get_parameter(name), wide)
             for index in sorted(layers)
             for name in model.replicated_kv_heads(index, tp.size)]
    sum_over_head_replicas(grads, model.cfg.kv_heads, tp)


def _sync_tied(layers: Mapping[int, nn.Module], group: TiedGroup, tied: Mapping[int, str],
               wide: torch.dtype | None) -> None:
    """The tied weight's gradient: each rank of the tied group adds its local copies'
    gradients (both, on a rank holding the embedding and the head), one all-reduce sums
    those over the group, and every copy takes the total. The copies then see the same
    gradient, clip coefficient and update as one shared weight: they stay bit-identical."""
    copies = [local_grad(layers[layer].get_parameter(name), wide)
              for layer, name in tied.items() if layer in layers]
    # Usually the rank holds one copy, summed in place; a rank holding both (the
    # embedding and the head in one stage) adds the second into the first.
    total = copies[0]
    for grad in copies[1:]:
        total.add_(grad)
    if group.group is not None:
        dist.all_reduce(total, group=group.group)
    for grad in copies[1:]:
        grad.copy_(total)
