"""RMSNorm, y = x / sqrt(mean(x^2) + eps) * weight: the Triton kernel and its reference.

The kernel normalises a block of rows per program in float32 and saves each row's
1/rms for the backward, which recomputes x_hat = x/rms rather than storing it (one
tensor of x's size less). The weight's gradient is a sum over every row: each program
accumulates its rows' share in float32 and the shares are summed afterwards, so no
atomics make it depend on scheduling.
"""
from __future__ import annotations

import torch

from planaria.kernels.dispatch import next_power_of_2, program_count, rows_per_block, tl, triton, use_triton, warps

MAX_HIDDEN = 65536
"""Widest row one program normalises (its whole row is in registers)."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in at least float32: bf16 squares lose too many bits.
    compute = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    normed = compute * torch.rsqrt(compute.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, kernels: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dimension of `x` (see `planaria.kernels.dispatch`)."""
    if use_triton("rms_norm", kernels, x, weight, unsupported=_unsupported(x, weight)):
        return _RMSNorm.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def _unsupported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        return f"dtype {x.dtype}/{weight.dtype} (the kernel takes float32, bfloat16, float16)"
    if x.shape[-1] > MAX_HIDDEN:
        return f"hidden size {x.shape[-1]} > {MAX_HIDDEN}"
    if weight.shape != x.shape[-1:]:
        return f"weight of shape {tuple(weight.shape)} for rows of {x.shape[-1]}"
    return None


def _blocks(rows: torch.Tensor) -> tuple[int, int]:
    width = next_power_of_2(rows.shape[1])
    return width, rows_per_block(width)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        n_rows, n_cols = rows.shape
        y = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        width, block_rows = _blocks(rows)
        _forward_kernel[(triton.cdiv(n_rows, block_rows),)](rows, weight, y, rstd, n_rows, n_cols, eps,
                                                            BLOCK_R=block_rows, BLOCK=width,
                                                            num_warps=warps(block_rows * width))
        ctx.save_for_backward(rows, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], n_cols)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        rows, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = rows.shape
        grad_rows = grad_y.reshape(rows.shape).contiguous()
        grad_x = torch.empty_like(rows)
        width, block_rows = _blocks(rows)
        blocks = triton.cdiv(n_rows, block_rows)
        programs = program_count(rows.device, blocks)
        # Every program stores its whole row of partial sums (zeros if it had no rows).
        partial = torch.empty(programs, n_cols, dtype=torch.float32, device=rows.device)
        _backward_kernel[(programs,)](rows, weight, rstd, grad_rows, grad_x, partial, n_rows, n_cols,
                                      triton.cdiv(blocks, programs), BLOCK_R=block_rows, BLOCK=width,
                                      num_warps=warps(block_rows * width))
        return grad_x.view(ctx.x_shape), partial.sum(0).to(weight.dtype), None


if triton is not None:
    @triton.jit
    def _forward_kernel(X, W, Y, RSTD, n_rows, n_cols, eps, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        offsets = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        # As the reference: the normalised row in x's dtype, then times the weight.
        normed = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        tl.store(Y + offsets, (normed * w[None, :]).to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=rows < n_rows)

    @triton.jit
    def _backward_kernel(X, W, RSTD, DY, DX, DW_PARTIAL, n_rows, n_cols, blocks_per_program,
                         BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
        program = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        first = program.to(tl.int64) * blocks_per_program  # int64: row * n_cols may pass 2^31
        for block in range(first, first + blocks_per_program):
            rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
            mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
            offsets = rows[:, None] * n_cols + cols[None, :]
            x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)[:, None]
            x_hat = x * rstd
            dy_w = dy * w[None, :]
            # d/dx of x * rstd(x): rstd * (dy_w - x_hat * mean(dy_w * x_hat))
            dx = rstd * (dy_w - x_hat * (tl.sum(dy_w * x_hat, axis=1) / n_cols)[:, None])
            tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * x_hat.to(X.dtype.element_ty).to(tl.float32), axis=0)
        tl.store(DW_PARTIAL + program * n_cols + cols, dw, mask=cols < n_cols)
