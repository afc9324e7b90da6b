"""Rotary position embedding on interleaved pairs, as in the original LLaMA code: the
Triton kernel and its reference.

x: (batch, seq, heads, head_dim); cos, sin: (seq, head_dim/2) (longer tables are cut to
x's sequence). Pair i of a head is (x[..., 2i], x[..., 2i+1]), rotated by the angle of
position t and frequency i. The kernel rotates every head of one position per program;
the backward is the same kernel rotating the other way (a rotation's transpose is its
inverse), so nothing is saved but the tables.
"""
from __future__ import annotations

import torch

from planaria.kernels.dispatch import next_power_of_2, tl, triton, use_triton

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_POSITION_ELEMENTS = 65536
"""Most elements (heads x head_dim) one program rotates."""


def rotary_tables(seq_len: int, head_dim: int, theta: float, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)  # (T, hd/2)
    return angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]  # (B, T, H, hd/2) each
    cos = cos[: x.shape[1]].unsqueeze(1).to(x.dtype)  # (T, 1, hd/2)
    sin = sin[: x.shape[1]].unsqueeze(1).to(x.dtype)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2)  # (B, T, H, hd), pairs interleaved again


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, kernels: str = "auto") -> torch.Tensor:
    """Rotate the interleaved pairs of `x` (see the module docstring and `planaria.kernels.dispatch`)."""
    if use_triton("apply_rotary", kernels, x, cos, sin, unsupported=_unsupported(x, cos, sin)):
        return _Rotary.apply(x, cos, sin)
    return apply_rotary_reference(x, cos, sin)


def _unsupported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    if x.dim() != 4 or x.shape[-1] % 2:
        return f"x of shape {tuple(x.shape)} (need (batch, seq, heads, even head_dim))"
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype} (the kernel takes float32, bfloat16, float16)"
    half = x.shape[-1] // 2
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[0] < x.shape[1] or table.shape[1] != half:
            return f"{name} of shape {tuple(table.shape)} for x of shape {tuple(x.shape)}"
    if x.shape[2] * x.shape[3] > MAX_POSITION_ELEMENTS:
        return f"{x.shape[2]} heads x {x.shape[3]} > {MAX_POSITION_ELEMENTS} elements a position"
    return None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    x = x.contiguous()
    b, t, h, d = x.shape
    out = torch.empty_like(x)
    _rotary_kernel[(b * t,)](x, cos, sin, out, t, h, d // 2, cos.stride(0), sin.stride(0),
                             INVERSE=inverse, BLOCK_H=next_power_of_2(h), BLOCK_HALF=next_power_of_2(d // 2))
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # The tables in x's dtype, as the reference uses them.
        cos = cos[: x.shape[1]].to(x.dtype).contiguous()
        sin = sin[: x.shape[1]].to(x.dtype).contiguous()
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, inverse=True), None, None


if triton is not None:
    @triton.jit
    def _rotary_kernel(X, COS, SIN, OUT, seq, heads, half, cos_stride, sin_stride,
                       INVERSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        position = tl.program_id(0).to(tl.int64)  # batch * seq + t
        t = position % seq
        h = tl.arange(0, BLOCK_H)[:, None]
        i = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (h < heads) & (i < half)
        cos = tl.load(COS + t * cos_stride + i, mask=i < half, other=0.0).to(tl.float32)
        sin = tl.load(SIN + t * sin_stride + i, mask=i < half, other=0.0).to(tl.float32)
        if INVERSE:
            sin = -sin
        even_at = position * heads * half * 2 + h * half * 2 + 2 * i
        even = tl.load(X + even_at, mask=mask, other=0.0).to(tl.float32)
        odd = tl.load(X + even_at + 1, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + even_at, (even * cos - odd * sin).to(OUT.dtype.element_ty), mask=mask)
        tl.store(OUT + even_at + 1, (even * sin + odd * cos).to(OUT.dtype.element_ty), mask=mask)
