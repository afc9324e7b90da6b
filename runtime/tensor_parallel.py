"""Megatron-style tensor parallelism across the workers of one stage.

Small explicit layers rather than DTensor: a layer's state is then a plain tensor
shard per tp rank, which is what replica transfer and checkpoints move around.

- `TensorParallel`: the group a stage's workers share. Layers hold a reference to
  one such object owned by the engine; reconfiguration swaps its group in place.
- `copy_to_tp` / `reduce_from_tp`: the conjugate pair `f` / `g` of Megatron-LM
  (identity forward and all-reduce backward, and the reverse).
- `ColumnParallelLinear` splits the output features, `RowParallelLinear` the input
  features; a column-parallel layer followed by a row-parallel one needs one
  all-reduce forward and one backward.
- `VocabParallelEmbedding` and `vocab_parallel_cross_entropy` split the vocabulary.

This module does no initialisation of its own: layers are created with full-size
tensors from a seeded generator and then sharded (see `shard`), so every tp degree
starts from bit-identical parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from planaria.kernels import cross_entropy


@dataclass
class TensorParallel:
    """The tensor-parallel group of one stage. `group=None` means tp = 1."""

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor


def shard(full: torch.Tensor, dim: int, tp: TensorParallel) -> torch.Tensor:
    """This tp rank's contiguous slice of `full` along `dim`."""
    if full.shape[dim] % tp.size:
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not split into tp={tp.size}")
    return full.chunk(tp.size, dim=dim)[tp.rank].clone()


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce(grad.contiguous()), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return tp.all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x, tp) if tp.size > 1 else x


def reduce_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(x, tp) if tp.size > 1 else x


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local^T, W split by output features; the input is replicated."""

    def __init__(self, full_weight: torch.Tensor, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(shard(full_weight, 0, tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.tp), self.weight)


class RowParallelLinear(nn.Module):
    """y = sum over tp ranks of x_local @ W_local^T, W split by input features."""

    def __init__(self, full_weight: torch.Tensor, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(shard(full_weight, 1, tp))

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x_local, self.weight), self.tp)


class VocabParallelEmbedding(nn.Module):
    """Each tp rank holds a contiguous slice of the vocabulary's rows."""

    def __init__(self, full_weight: torch.Tensor, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(shard(full_weight, 0, tp))
        self.vocab_start = tp.rank * self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight)
        embedded = embedded.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(embedded, self.tp)


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, target: torch.Tensor,
                                 tp: TensorParallel, kernels: str = "auto") -> torch.Tensor:
    """Mean token cross-entropy. logits_local: (..., V/tp), target: (...): the ranks
    exchange two numbers per token, never logits (planaria.kernels.cross_entropy)."""
    return cross_entropy(logits_local, target, tp.group if tp.size > 1 else None, kernels=kernels)
