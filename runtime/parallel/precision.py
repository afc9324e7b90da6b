"""How a bfloat16 job computes (`train.mixed_precision`): the context a step's forward and
backward run in.

Both recipes keep float32 master weights: the parameters the optimizer steps, and that
every transfer, checkpoint, peer snapshot and audit carries (a layer's state is its
float32 parameters and AdamW state whichever recipe runs, so a job may change recipe
across a restart, and nothing that moves layer state knows of it).

- `autocast` (what torchtitan does on one GPU, without FSDP): `torch.autocast` around the
  step. Each matmul reads a bfloat16 cast of its weight, made once per step within the
  autocast region (autocast's weight cache; inside a compiled block, a cast in its
  graph). Where a float32 weight meets an activation (a norm's scale, the embedding) the
  result is float32, so the residual stream between blocks stays float32.
- `bf16-params` (FSDP2's mixed-precision policy with param_dtype=bfloat16 and
  reduce_dtype=float32; Megatron's bf16 with float32 main parameters): every parameter
  the forward reads is a bfloat16 copy of its master, made once per step as the step
  begins (`compute_params`), so the whole forward, the residual stream and the
  activations sent between stages are bfloat16. Each copy's gradient (bfloat16, one
  per microbatch) flows back through the cast into its master's float32 gradient, where
  the microbatches are summed (in float64 with `train.exact_reduction`).

The copies are put in the modules' parameter slots for the step and the masters put
back after it, even when it fails (`torch.func.functional_call`'s way, done here because
torch's pipeline stages call their modules themselves). A split backward that computes
weight gradients from a stage's `parameters()` (the zb1f1b schedule) would compute them
for the copies: that pairing is refused by the config's check.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

RECIPES = ("autocast", "bf16-params")
"""`train.mixed_precision`'s values (module docstring)."""


@contextlib.contextmanager
def compute_params(modules: Iterable[nn.Module], dtype: torch.dtype | None) -> Iterator[None]:
    """Within: every floating-point parameter of `modules` that is not of `dtype` reads as
    a `dtype` copy of itself (made here, in autograd's graph: gradients reach the
    master); after: the masters again. `dtype` None: nothing changes."""
    if dtype is None:
        yield
        return
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for module in modules:
            for owner in module.modules():
                for name, param in owner._parameters.items():
                    if param is not None and param.is_floating_point() and param.dtype != dtype:
                        swapped.append((owner, name, param))
        for owner, name, param in swapped:
            owner._parameters[name] = param.to(dtype)
        yield
    finally:
        for owner, name, param in swapped:
            owner._parameters[name] = param
