"""SwiGLU activation, silu(gate) * up: the pure-PyTorch reference."""
import torch
import torch.nn.functional as F


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
