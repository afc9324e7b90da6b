"""Fused kernels (Triton) with pure-PyTorch references, and the dispatch between them.

Imports nothing else of Planaria. Each operation has one file holding its Triton kernels
(forward and backward, as a `torch.autograd.Function`) beside its reference, which is
the CPU path and the test oracle; `planaria.kernels.dispatch` picks between them.

The operations are imported on first use (PEP 562), not with the package: importing
`planaria.kernels.modes` (what a config check needs) must not import torch and Triton,
which take seconds, into a process that never computes, such as a node's agent.
"""
from importlib import import_module

from planaria.kernels.modes import ENV, MODES

_HOMES = {
    "check_mode": "dispatch", "describe": "dispatch",
    "rms_norm": "rms_norm", "rms_norm_reference": "rms_norm",
    "swiglu": "swiglu", "swiglu_reference": "swiglu",
    "apply_rotary": "rotary", "apply_rotary_reference": "rotary", "rotary_tables": "rotary",
    "cross_entropy": "cross_entropy", "cross_entropy_reference": "cross_entropy",
    "linear_cross_entropy": "linear_cross_entropy",
    "linear_cross_entropy_reference": "linear_cross_entropy",
}

__all__ = ["ENV", "MODES", *_HOMES]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:  # a submodule (`from planaria.kernels import dispatch`) is found after this
        raise AttributeError(f"module 'planaria.kernels' has no attribute {name!r}")
    value = getattr(import_module(f"planaria.kernels.{home}"), name)
    globals()[name] = value  # looked up once
    return value
