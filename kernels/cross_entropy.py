"""Token cross-entropy computed in chunks over the vocabulary, and its vocabulary-parallel
form: the Triton kernels and the references.

`cross_entropy(logits, target, group=None)`: the mean over the tokens whose target is
not `ignore_index` of logsumexp(logits) - logits[target]. logits: (N, V) or (..., V),
target: (N,) or (...). With a process `group`, each rank holds a contiguous slice of the
vocabulary (rank r the r-th V/size columns), as a vocabulary-parallel output layer
leaves them; the ranks exchange two numbers per token, never logits.

The statistics kernel walks each row's vocabulary in blocks with an online softmax
(the running maximum and the sum of exponentials rescaled as it goes), so no softmax of
the row is ever materialised; it also reads the target's logit when this rank holds it.
The gradient kernel recomputes softmax - onehot block by block from the logits and the
saved log-sum-exp: the forward keeps the logits it was given (no copy) and one float per
token. `token_stats` and `logits_gradient` are those two steps, which the fused
linear + cross-entropy (`planaria.kernels.linear_cross_entropy`) reuses chunk by chunk.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from planaria.kernels.dispatch import tl, triton, use_triton

IGNORE_INDEX = -100
BLOCK_V = 1024
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor, group=None,
                            ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The same loss from the full logits (gathered from the group's ranks when there is
    one), in float32 as the kernels compute it."""
    logits = logits.reshape(-1, logits.shape[-1])
    if _parallel(group):
        logits = _AllGatherVocabulary.apply(logits, group)
    return F.cross_entropy(logits.to(_compute_dtype(logits)), target.reshape(-1), ignore_index=ignore_index)


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32 for half-precision logits (their exponentials lose too much), else their own."""
    return torch.promote_types(logits.dtype, torch.float32)


def _parallel(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None, *,
                  ignore_index: int = IGNORE_INDEX, kernels: str = "auto") -> torch.Tensor:
    """Mean token cross-entropy (see the module docstring and `planaria.kernels.dispatch`)."""
    logits_2d = logits.reshape(-1, logits.shape[-1])
    target_1d = target.reshape(-1).contiguous()
    use = use_triton("cross_entropy", kernels, logits_2d, target_1d,
                     unsupported=unsupported(logits_2d, target_1d))
    if not use and not _parallel(group):
        return cross_entropy_reference(logits_2d, target_1d, ignore_index=ignore_index)
    if logits_2d.stride(1) != 1:
        logits_2d = logits_2d.contiguous()
    return _CrossEntropy.apply(logits_2d, target_1d, group, ignore_index, use)


def unsupported(logits: torch.Tensor, target: torch.Tensor) -> str | None:
    if logits.dtype not in DTYPES:
        return f"logits of dtype {logits.dtype} (the kernels take float32, bfloat16, float16)"
    if logits.shape[0] != target.shape[0]:
        return f"{logits.shape[0]} rows of logits for {target.shape[0]} targets"
    return None


def vocab_range(vocab_local: int, group) -> tuple[int, int]:
    """The slice of the vocabulary this rank holds: [start, start + vocab_local)."""
    rank = dist.get_rank(group) if group is not None else 0
    return rank * vocab_local, (rank + 1) * vocab_local


def token_stats(logits: torch.Tensor, target: torch.Tensor, group, ignore_index: int,
                use_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp over the whole vocabulary, logit of the target) per row, combined over
    `group`'s ranks, in float32 (float64 for float64 logits, without the kernel); rows
    whose target is ignored get 0 as their logit."""
    start, end = vocab_range(logits.shape[1], group)
    if use_kernel:
        rows = logits.shape[0]
        row_max = torch.empty(rows, dtype=torch.float32, device=logits.device)
        sum_exp = torch.empty_like(row_max)
        target_logit = torch.empty_like(row_max)
        _stats_kernel[(rows,)](logits, logits.stride(0), target, row_max, sum_exp, target_logit,
                               logits.shape[1], start, BLOCK_V=BLOCK_V)
    else:
        x = logits.to(_compute_dtype(logits))
        row_max = x.max(dim=1).values
        sum_exp = (x - row_max[:, None]).exp().sum(dim=1)
        local = target - start
        held = (local >= 0) & (local < logits.shape[1])
        target_logit = torch.where(held, x.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None])[:, 0], 0.0)
    if _parallel(group):
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        both = torch.stack((sum_exp * (row_max - global_max).exp(), target_logit))
        dist.all_reduce(both, group=group)
        row_max, (sum_exp, target_logit) = global_max, both
    return row_max + sum_exp.log(), torch.where(target == ignore_index, 0.0, target_logit)


def logits_gradient(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                    group, use_kernel: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """(softmax(logits) - onehot(target)) * scale[row], in logits' dtype, for this rank's
    slice of the vocabulary (`scale` 0 for ignored rows)."""
    start, _ = vocab_range(logits.shape[1], group)
    out = torch.empty_like(logits) if out is None else out
    if use_kernel:
        _gradient_kernel[(logits.shape[0],)](logits, logits.stride(0), target, lse, scale, out, out.stride(0),
                                             logits.shape[1], start, BLOCK_V=BLOCK_V)
        return out
    grad = (logits.to(lse.dtype) - lse[:, None]).exp()
    local = target - start
    held = (local >= 0) & (local < logits.shape[1])
    rows = torch.arange(logits.shape[0], device=logits.device)[held]
    grad[rows, local[held]] -= 1.0
    out.copy_(grad * scale[:, None])
    return out


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, use_kernel):
        lse, target_logit = token_stats(logits, target, group, ignore_index, use_kernel)
        valid = target != ignore_index
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(logits, target, lse, valid, count)
        ctx.group, ctx.use_kernel = group, use_kernel
        return torch.where(valid, lse - target_logit, 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse, valid, count = ctx.saved_tensors
        scale = valid.to(lse.dtype) * (grad_loss.to(lse.dtype) / count)
        grad = logits_gradient(logits, target, lse, scale, ctx.group, ctx.use_kernel)
        return grad, None, None, None, None


class _AllGatherVocabulary(torch.autograd.Function):
    """The reference's vocabulary-parallel logits gathered whole (backward: this rank's slice)."""

    @staticmethod
    def forward(ctx, logits, group):
        ctx.group = group
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=1)[rank].contiguous(), None


if triton is not None:
    @triton.jit
    def _stats_kernel(LOGITS, stride, TARGET, MAX, SUMEXP, TARGET_LOGIT, vocab, vocab_start,
                      BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = LOGITS + row * stride
        running_max = float("-inf")
        running_sum = 0.0
        for first in range(0, vocab, BLOCK_V):
            cols = first + tl.arange(0, BLOCK_V)
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
        local = tl.load(TARGET + row) - vocab_start
        held = (local >= 0) & (local < vocab)
        target_logit = tl.load(base + local, mask=held, other=0.0).to(tl.float32)
        tl.store(MAX + row, running_max)
        tl.store(SUMEXP + row, running_sum)
        tl.store(TARGET_LOGIT + row, tl.where(held, target_logit, 0.0))

    @triton.jit
    def _gradient_kernel(LOGITS, stride, TARGET, LSE, SCALE, GRAD, grad_stride, vocab, vocab_start,
                         BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        lse = tl.load(LSE + row)
        scale = tl.load(SCALE + row)
        local = tl.load(TARGET + row) - vocab_start
        for first in range(0, vocab, BLOCK_V):
            cols = first + tl.arange(0, BLOCK_V)
            mask = cols < vocab
            x = tl.load(LOGITS + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(cols == local, 1.0, 0.0)
            tl.store(GRAD + row * grad_stride + cols, (grad * scale).to(GRAD.dtype.element_ty), mask=mask)
