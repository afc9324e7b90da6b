"""Rotary position embedding on interleaved pairs, as in the original LLaMA code.

x: (batch, seq, heads, head_dim); cos, sin: (seq, head_dim/2). Pair i of a head is
(x[..., 2i], x[..., 2i+1]), rotated by the angle of position t and frequency i.
"""
import torch


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
