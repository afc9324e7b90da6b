"""Rotary position embedding on interleaved pairs, as in the original LLaMA code: the
Triton kernel and its reference.

x: (batch, seq, heads, head_dim); cos, sin: (seq, head_dim/2) (longer tables are cut to
x's sequence). Pair i of a head is (x[..., 2i], x[..., 2i+1]), rotated by the angle of
position t and frequency i. The kernel rotates a block of (position, head) rows per
program; the backward is the same kernel rotating the other way (a rotation's transpose is its
inverse), so nothing is saved but the tables.
"""
from __future__ import annotations

import torch

from planaria.kernels.dispatch import next_power_of_2, rows_per_block, tl, triton, use_triton, warps

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 8192


def rotary_tables(seq_len: int, head_dim: int, theta: float, dtype: torch.dtype,
                  device: torch.device | str = "cpu",
                  scaling: tuple[float, float, float, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency), (seq_len, head_dim/2), computed in
    float64 and then cast. `scaling`: LLaMA 3.1's (factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings), see `llama3_inverse_frequencies`."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is not None:
        freqs = llama3_inverse_frequencies(freqs, *scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)  # (T, hd/2)
    return angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device)


def llama3_inverse_frequencies(freqs: torch.Tensor, factor: float, low_freq_factor: float,
                               high_freq_factor: float, original_max_positions: int) -> torch.Tensor:
    """LLaMA 3.1's long-context scaling of the rotary inverse frequencies: wavelengths
    shorter than original_max_positions / high_freq_factor are kept, those longer than
    original_max_positions / low_freq_factor are stretched by `factor`, and the ones
    between are interpolated smoothly between the two (Meta's `apply_scaling`)."""
    wavelen = 2 * torch.pi / freqs
    low_freq_wavelen = original_max_positions / low_freq_factor
    high_freq_wavelen = original_max_positions / high_freq_factor
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    interpolated = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, interpolated)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


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
    if x.shape[3] > MAX_HEAD_DIM:
        return f"head_dim {x.shape[3]} > {MAX_HEAD_DIM}"
    return None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    x = x.contiguous()
    b, t, h, d = x.shape
    out = torch.empty_like(x)
    rows, half = b * t * h, next_power_of_2(d // 2)
    block_rows = rows_per_block(half)
    _rotary_kernel[(triton.cdiv(rows, block_rows),)](x, cos, sin, out, rows, t, h, d // 2, cos.stride(0),
                                                     sin.stride(0), INVERSE=inverse, BLOCK_R=block_rows,
                                                     BLOCK_HALF=half, num_warps=warps(block_rows * half))
    return out


def _unit_stride(table: torch.Tensor) -> torch.Tensor:
    return table if table.stride(1) == 1 else table.contiguous()


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # The tables are passed as they are (views, no copy): the kernel rounds them to x's
        # dtype as it loads them, as the reference does. Casting them here cost two extra
        # launches per call, which on a GPU took longer than the rotation itself (a 7B
        # model's q at 8192 tokens rotates in 0.05 ms on an H100).
        cos, sin = _unit_stride(cos[: x.shape[1]]), _unit_stride(sin[: x.shape[1]])
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, inverse=True), None, None


if triton is not None:
    @triton.jit
    def _rotary_kernel(X, COS, SIN, OUT, n_rows, seq, heads, half, cos_stride, sin_stride,
                       INVERSE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # (b, t, h) flattened
        t = (rows // heads) % seq
        i = tl.arange(0, BLOCK_HALF)
        mask = (rows[:, None] < n_rows) & (i[None, :] < half)
        # Rounded to x's dtype first, as the reference multiplies in it.
        cos = tl.load(COS + t[:, None] * cos_stride + i[None, :], mask=mask, other=0.0)
        cos = cos.to(OUT.dtype.element_ty).to(tl.float32)
        sin = tl.load(SIN + t[:, None] * sin_stride + i[None, :], mask=mask, other=0.0)
        sin = sin.to(OUT.dtype.element_ty).to(tl.float32)
        if INVERSE:
            sin = -sin
        # Each row's pairs read and written whole, contiguous (vectorised loads and stores),
        # then split into even and odd lanes in registers: indexing x[2i] and x[2i+1]
        # directly compiles to one 2-byte access per element.
        j = tl.arange(0, 2 * BLOCK_HALF)
        at = rows[:, None] * half * 2 + j[None, :]
        in_row = (rows[:, None] < n_rows) & (j[None, :] < 2 * half)
        x = tl.load(X + at, mask=in_row, other=0.0).to(tl.float32)
        even, odd = tl.split(tl.reshape(x, (BLOCK_R, BLOCK_HALF, 2)))
        rotated = tl.interleave(even * cos - odd * sin, even * sin + odd * cos)
        tl.store(OUT + at, rotated.to(OUT.dtype.element_ty), mask=in_row)
