"""The output head and its loss fused: cross_entropy(hidden @ weight.T, target) without the
full logits ever existing.

hidden: (N, d) or (..., d); weight: (V, d), or this rank's (V/size, d) slice of the
vocabulary with a process `group` (the vocabulary-parallel head); target: (N,) or (...).

The tokens are taken a chunk of rows at a time, sized so that a chunk's logits are about
as large as `hidden` itself: the chunk's logits are one matmul, the cross-entropy's
statistics and its gradient come from the kernels of `planaria.kernels.cross_entropy`
(written over the chunk's logits in place), and the chunk's share of the gradients of
`hidden` and `weight` are two more matmuls. The gradients are computed during the
forward, as Liger-Kernel's fused linear cross-entropy does, so the backward only scales
them by the loss's gradient: peak memory is one chunk of logits instead of N x V (for a
7B model's 32k vocabulary and 8k tokens, by arithmetic: 500 MiB of bf16 logits and as
much again for their gradient, against 62.5 MiB for one chunk of 1024 tokens;
benchmarks/kernels.py measures it).

With a `group`, the input's gradient is this rank's share: the caller's
copy-to-tensor-parallel (Megatron's `f`) sums the shares in its backward, as it does
for any column-parallel layer.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from planaria.kernels.cross_entropy import (DTYPES, IGNORE_INDEX, cross_entropy_reference,
                                            logits_gradient, token_stats)
from planaria.kernels.dispatch import use_triton


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                   group=None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The unfused head: the full logits, then the cross-entropy."""
    return cross_entropy_reference(F.linear(hidden.reshape(-1, hidden.shape[-1]), weight), target, group,
                                   ignore_index)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group=None, *,
                         ignore_index: int = IGNORE_INDEX, chunk_rows: int | None = None,
                         kernels: str = "auto") -> torch.Tensor:
    """Mean token cross-entropy of the logits `hidden @ weight.T`, in chunks of rows (see the
    module docstring). The chunked computation runs whichever kernels the dispatcher picks;
    the logits are never whole either way."""
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    target_1d = target.reshape(-1).contiguous()
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(hidden_2d.shape[0], weight.shape[0], hidden_2d.shape[1])
    use = use_triton("linear_cross_entropy", kernels, hidden_2d, weight, target_1d,
                     unsupported=_unsupported(hidden_2d, weight, target_1d))
    # Whether autograd records this call: inside forward grad mode is always off, and
    # ctx.needs_input_grad says only which inputs require grad, under no_grad too.
    recorded = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(hidden_2d, weight, target_1d, group, ignore_index, chunk_rows, use, recorded)


def _unsupported(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> str | None:
    if hidden.shape[0] != target.shape[0]:
        return f"{hidden.shape[0]} rows of hidden states for {target.shape[0]} targets"
    if hidden.dtype != weight.dtype or hidden.dtype not in DTYPES:
        return f"hidden {hidden.dtype} and weight {weight.dtype} (one of float32, bfloat16, float16)"
    return None


def default_chunk_rows(rows: int, vocab_local: int, hidden: int) -> int:
    """Rows per chunk so that a chunk's logits are about the size of the hidden states."""
    return max(1, min(rows, math.ceil(rows / math.ceil(vocab_local / hidden))))


def _accumulate_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc in float32 (the weight's gradient summed over the chunks).

    With a and b in a lower precision on a GPU, one cuBLAS call accumulates the product
    into acc in float32 (`out_dtype`): no chunk's product is rounded to bfloat16 first, and
    none is written out and read back (on an H100, a 7B head's chunk of 1024 tokens: 0.66
    ms, against 0.89 ms for the product in bfloat16 and then the sum; benchmarks/kernels.py
    times the whole head). Elsewhere (on CPU, or a and b already in float32) the product
    is formed in a's dtype and added, as before."""
    if acc.is_cuda and acc.dtype != a.dtype:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += a @ b


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, group, ignore_index, chunk_rows, use_kernel, recorded):
        # Only the gradients autograd will ask for: none under no_grad (evaluation), none
        # for a frozen head's weight. Each costs a matmul as large as the logits' own.
        need_hidden, need_weight = (recorded and need for need in ctx.needs_input_grad[:2])
        valid = target != ignore_index
        count = valid.sum().clamp(min=1)
        scale = valid.to(torch.promote_types(hidden.dtype, torch.float32)) / count
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=scale.dtype, device=weight.device) if need_weight else None
        total = torch.zeros((), dtype=scale.dtype, device=hidden.device)
        for first in range(0, hidden.shape[0], chunk_rows):
            rows = slice(first, first + chunk_rows)
            h, t = hidden[rows], target[rows]
            logits = h @ weight.T  # (chunk, V/size)
            lse, target_logit = token_stats(logits, t, group, ignore_index, use_kernel)
            total += torch.where(valid[rows], lse - target_logit, 0.0).sum()
            if not (need_hidden or need_weight):
                continue
            grad_logits = logits_gradient(logits, t, lse, scale[rows], group, use_kernel, out=logits)
            if need_hidden:  # written in place: a chunk's rows of a contiguous tensor are one block
                torch.matmul(grad_logits, weight, out=grad_hidden[rows])
            if need_weight:
                _accumulate_product(grad_weight, grad_logits.T, h)
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (None if grad_hidden is None else grad_hidden * grad_loss,
                None if grad_weight is None else grad_weight * grad_loss, None, None, None, None, None, None)
