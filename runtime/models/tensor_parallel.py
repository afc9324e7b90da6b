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
- `HeadParallelLinear` splits whole attention heads, or replicates them where tp
  exceeds them (grouped-query attention's key/value heads): the rule is
  `planaria.templates.costs.kv_heads_of_rank`. The replicas' gradients are summed once
  per step, after the microbatches (`sum_over_head_replicas`, called by the engine).
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
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from planaria.kernels import cross_entropy
from planaria.templates.costs import kv_heads_of_rank


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
    return split(full, dim, tp.rank, tp.size)


def split(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Tp rank `tp_rank`'s contiguous slice of `full` along `dim`, of `tp_size` equal ones."""
    if full.shape[dim] % tp_size:
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not split into tp={tp_size}")
    return full.chunk(tp_size, dim=dim)[tp_rank].clone()


def shard_heads(full: torch.Tensor, n_heads: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The rows of `full` (n_heads * head_dim, ...) of the heads tp rank `tp_rank` holds."""
    heads, rows = kv_heads_of_rank(n_heads, tp_rank, tp_size), full.shape[0] // n_heads
    return full[heads.start * rows: heads.stop * rows].clone()


def unshard_heads(shards: list[torch.Tensor], n_heads: int) -> torch.Tensor:
    """The full tensor from `shard_heads`'s pieces of tp ranks 0..tp-1: one copy of each head."""
    tp_size = len(shards)
    if n_heads % tp_size == 0:
        return torch.cat(shards)
    return torch.cat([shards[head * tp_size // n_heads] for head in range(n_heads)])


def first_head_replica(n_heads: int, tp_rank: int, tp_size: int) -> bool:
    """Whether tp rank `tp_rank` is the first of the ranks that hold its heads (all are,
    unless heads are replicated: more ranks than heads)."""
    return n_heads % tp_size == 0 or tp_rank % (tp_size // n_heads) == 0


def head_replicas(n_heads: int, tp_rank: int, tp_size: int) -> range:
    """The tp ranks holding the same heads as `tp_rank` (only itself unless heads are
    replicated: more ranks than heads)."""
    if n_heads % tp_size == 0:
        return range(tp_rank, tp_rank + 1)
    per_head = tp_size // n_heads
    first = tp_rank // per_head * per_head
    return range(first, first + per_head)


def sum_over_head_replicas(grads: list[torch.Tensor], n_heads: int, tp: TensorParallel) -> None:
    """Replace each of `grads` (this rank's gradients of replicated heads' weights) by its
    sum over the tp ranks holding the same head: one all-gather over the tp group of all
    of them flattened, then each rank adds its replicas' pieces in tp-rank order.

    Gathering moves the pieces unchanged and the sum's order is fixed, so every holder of
    a head computes the same bits whatever the buffer's layout (pipelines of one plan may
    split the layers into stages differently) and whichever group's all-reduce came
    before; an all-reduce's rounding would depend on the ranks and the element's offset."""
    if tp.size == 1 or not grads or n_heads % tp.size == 0:
        return
    flat = _flatten_dense_tensors(grads)
    pieces = flat.new_empty((tp.size, flat.numel()))
    dist.all_gather(list(pieces.unbind(0)), flat, group=tp.group)
    replicas = head_replicas(n_heads, tp.rank, tp.size)
    flat.copy_(pieces[replicas[0]])
    for rank in replicas[1:]:
        flat.add_(pieces[rank])
    for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(summed)


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
    return _copy_to_tp(x, tp) if tp.size > 1 else x


def reduce_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _reduce_from_tp(x, tp) if tp.size > 1 else x


# Outside any compiled graph (`train.compile`): each epoch's tensor-parallel group is a
# new object, and a graph that called a collective on it would be guarded on it, so
# every epoch would compile the blocks again (measured with tp = 2: one compilation per
# epoch). The compiler runs a block in pieces around these calls instead.
@torch.compiler.disable
def _copy_to_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x, tp)


@torch.compiler.disable
def _reduce_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(x, tp)


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


class HeadParallelLinear(nn.Module):
    """Column-parallel by whole attention heads: tp rank r computes the heads
    `kv_heads_of_rank(n_heads, r, tp)`. With more ranks than heads each head is replicated
    on tp/n_heads ranks, each of which computes only its own query heads' part of the
    weight's gradient; the engine sums those once per step (`sum_over_head_replicas`)."""

    def __init__(self, full_weight: torch.Tensor, n_heads: int, tp: TensorParallel):
        super().__init__()
        self.tp, self.n_heads = tp, n_heads
        self.weight = nn.Parameter(shard_heads(full_weight, n_heads, tp.rank, tp.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.tp), self.weight)


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
