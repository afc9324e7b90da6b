"""SwiGLU activation, silu(gate) * up: the Triton kernel and its reference.

One elementwise pass each way, in float32. The backward recomputes sigmoid(gate) from
the saved inputs instead of saving silu(gate) (one tensor of the input's size less,
which is what an activation-bound MLP is short of).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from planaria.kernels.dispatch import elementwise_block, tl, triton, use_triton

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, kernels: str = "auto") -> torch.Tensor:
    """silu(gate) * up (see `planaria.kernels.dispatch`)."""
    if use_triton("swiglu", kernels, gate, up, unsupported=_unsupported(gate, up)):
        return _SwiGLU.apply(gate, up)
    return swiglu_reference(gate, up)


def _unsupported(gate: torch.Tensor, up: torch.Tensor) -> str | None:
    if gate.shape != up.shape:
        return f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ (no broadcasting)"
    if gate.dtype != up.dtype or gate.dtype not in DTYPES:
        return f"dtypes {gate.dtype}/{up.dtype} (the kernel takes one of float32, bfloat16, float16)"
    return None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        n = gate.numel()
        block = elementwise_block()
        _forward_kernel[(triton.cdiv(n, block),)](gate, up, out, n, BLOCK=block)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        block = elementwise_block()
        _backward_kernel[(triton.cdiv(n, block),)](gate, up, grad_out, grad_gate, grad_up, n, BLOCK=block)
        return grad_gate, grad_up


if triton is not None:
    @triton.jit
    def _forward_kernel(GATE, UP, OUT, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        a = tl.load(GATE + offsets, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(UP + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + offsets, (a * tl.sigmoid(a) * b).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward_kernel(GATE, UP, DOUT, DGATE, DUP, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        a = tl.load(GATE + offsets, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(UP + offsets, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(DOUT + offsets, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        silu = a * sig
        # silu'(a) = sig * (1 + a * (1 - sig))
        tl.store(DGATE + offsets, (dout * b * sig * (1.0 + a * (1.0 - sig))).to(DGATE.dtype.element_ty), mask=mask)
        tl.store(DUP + offsets, (dout * silu).to(DUP.dtype.element_ty), mask=mask)
