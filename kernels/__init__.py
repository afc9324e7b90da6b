"""Fused kernels (Triton) with pure-PyTorch references, and the dispatch between them.

Imports nothing else of Planaria. Each operation has one file holding its reference
implementation, which is the CPU path and the oracle for the fused kernel.
"""
from planaria.kernels.rms_norm import rms_norm_reference
from planaria.kernels.rotary import apply_rotary_reference, rotary_tables
from planaria.kernels.swiglu import swiglu_reference

__all__ = ["rms_norm_reference", "apply_rotary_reference", "rotary_tables", "swiglu_reference"]
