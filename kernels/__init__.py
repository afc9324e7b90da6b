"""Fused kernels (Triton) with pure-PyTorch references, and the dispatch between them.

Imports nothing else of Planaria. Each operation has one file holding its Triton kernels
(forward and backward, as a `torch.autograd.Function`) beside its reference, which is
the CPU path and the test oracle; `planaria.kernels.dispatch` picks between them.
"""
from planaria.kernels.cross_entropy import cross_entropy, cross_entropy_reference
from planaria.kernels.dispatch import MODES, check_mode, describe
from planaria.kernels.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from planaria.kernels.rms_norm import rms_norm, rms_norm_reference
from planaria.kernels.rotary import apply_rotary, apply_rotary_reference, llama3_inverse_frequencies, rotary_tables
from planaria.kernels.swiglu import swiglu, swiglu_reference

__all__ = [
    "MODES", "check_mode", "describe",
    "rms_norm", "rms_norm_reference",
    "swiglu", "swiglu_reference",
    "apply_rotary", "apply_rotary_reference", "llama3_inverse_frequencies", "rotary_tables",
    "cross_entropy", "cross_entropy_reference",
    "linear_cross_entropy", "linear_cross_entropy_reference",
]
