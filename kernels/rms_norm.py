"""RMSNorm: the pure-PyTorch reference (CPU path and test oracle for a fused kernel)."""
import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in at least float32: bf16 squares lose too many bits.
    compute = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    normed = compute * torch.rsqrt(compute.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight
