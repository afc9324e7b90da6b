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

from planaria.kernels.dispatch import next_power_of_2, rows_per_block, tl, triton, use_triton, warps

IGNORE_INDEX = -100
MAX_BLOCK_V = 4096
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
        block_v, block_r = _blocks(logits)
        _stats_kernel[(triton.cdiv(rows, block_r),)](logits, logits.stride(0), target, row_max, sum_exp,
                                                     target_logit, rows, logits.shape[1], start,
                                                     BLOCK_R=block_r, BLOCK_V=block_v,
                                                     num_warps=warps(block_r * block_v))
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
        block_v, block_r = _blocks(logits)
        _gradient_kernel[(triton.cdiv(logits.shape[0], block_r),)](
            logits, logits.stride(0), target, lse, scale, out, out.stride(0), logits.shape[0], logits.shape[1],
            start, BLOCK_R=block_r, BLOCK_V=block_v, num_warps=warps(block_r * block_v))
        return out
    grad = (logits.to(lse.dtype) - lse[:, None]).exp()
    local = target - start
    held = (local >= 0) & (local < logits.shape[1])
    rows = torch.arange(logits.shape[0], device=logits.device)[held]
    grad[rows, local[held]] -= 1.0
    out.copy_(grad * scale[:, None])
    return out


def _blocks(logits: torch.Tensor) -> tuple[int, int]:
    """(vocabulary entries, rows) a program takes at once."""
    block_v = min(MAX_BLOCK_V, next_power_of_2(logits.shape[1]))
    return block_v, rows_per_block(block_v)


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
    def _stats_kernel(LOGITS, stride, TARGET, MAX, SUMEXP, TARGET_LOGIT, n_rows, vocab, vocab_start,
                      BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_rows = rows < n_rows
        rows = tl.minimum(rows, n_rows - 1)  # the block's spare rows read the last one (never stored)
        base = LOGITS + rows[:, None] * stride
        running_max = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        running_sum = tl.zeros((BLOCK_R,), tl.float32)
        for first in range(0, vocab, BLOCK_V):
            cols = first + tl.arange(0, BLOCK_V)
            x = tl.load(base + cols[None, :], mask=cols[None, :] < vocab, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=1))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max[:, None]), axis=1)
            running_max = new_max
        local = tl.load(TARGET + rows) - vocab_start
        held = (local >= 0) & (local < vocab)
        target_logit = tl.load(LOGITS + rows * stride + local, mask=held, other=0.0).to(tl.float32)
        tl.store(MAX + rows, running_max, mask=in_rows)
        tl.store(SUMEXP + rows, running_sum, mask=in_rows)
        tl.store(TARGET_LOGIT + rows, tl.where(held, target_logit, 0.0), mask=in_rows)

    @triton.jit
    def _gradient_kernel(LOGITS, stride, TARGET, LSE, SCALE, GRAD, grad_stride, n_rows, vocab, vocab_start,
                         BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_rows = rows < n_rows
        rows = tl.minimum(rows, n_rows - 1)
        lse = tl.load(LSE + rows)[:, None]
        scale = tl.load(SCALE + rows)[:, None]
        local = (tl.load(TARGET + rows) - vocab_start)[:, None]
        for first in range(0, vocab, BLOCK_V):
            cols = first + tl.arange(0, BLOCK_V)[None, :]
            x = tl.load(LOGITS + rows[:, None] * stride + cols, mask=cols < vocab, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(cols == local, 1.0, 0.0)
            tl.store(GRAD + rows[:, None] * grad_stride + cols, (grad * scale).to(GRAD.dtype.element_ty),
                     mask=in_rows[:, None] & (cols < vocab))
