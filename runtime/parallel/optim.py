"""Per-layer optimizer state and the learning-rate schedule.

Each layer owns its own AdamW, so a layer moves between workers as one unit:
parameters, step count, and both moments travel together, and a worker that drops
a layer drops its optimizer state with it. All replicas of a layer receive the same
gradient and the same clip coefficient, so their AdamW updates are bit-identical.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from planaria.runtime.config.sections import TrainConfig


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float
    min_lr: float
    warmup_steps: int
    lr_schedule: str
    total_steps: int
    weight_decay: float
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    impl: str = "for-loop"
    """`train.optimizer_impl`: "for-loop", "foreach" or "fused"."""


def optimizer_settings(train: "TrainConfig") -> OptimizerSettings:
    """The optimizer a config's `train` section describes."""
    return OptimizerSettings(lr=train.lr, min_lr=train.final_lr, warmup_steps=train.warmup_steps,
                             lr_schedule=train.lr_schedule, total_steps=train.steps,
                             weight_decay=train.weight_decay,
                             betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
                             impl=train.optimizer_impl)


def learning_rate(iteration: int, s: OptimizerSettings) -> float:
    """Linear warm-up, then constant or cosine decay to `min_lr` at `total_steps`."""
    if s.warmup_steps and iteration < s.warmup_steps:
        return s.lr * (iteration + 1) / s.warmup_steps
    if s.lr_schedule == "constant":
        return s.lr
    span = max(1, s.total_steps - s.warmup_steps)
    progress = min(1.0, (iteration - s.warmup_steps) / span)
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * progress))


def build_optimizer(module: nn.Module, s: OptimizerSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norm gains), as nanoGPT does."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    # One optimizer per layer whatever the implementation: an update never depends on
    # which other layers share the worker. "for-loop" is torch's reference arithmetic;
    # "foreach" and "fused" batch a layer's tensors into fewer kernels.
    return torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, eps=s.eps, **IMPLEMENTATIONS[s.impl])


IMPLEMENTATIONS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
"""torch.optim's flags for each `train.optimizer_impl`."""


def empty_adam_state(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> dict[str, torch.Tensor]:
    """AdamW's state for `param`, zeroed, laid out where AdamW itself would lay it out:
    the moments beside the parameter; the step count a 0-d tensor of AdamW's scalar dtype
    (float64 when that is the default dtype and AdamW is not fused, float32 otherwise), on the parameter's
    device only when the optimizer is capturable or fused and on the CPU otherwise (a GPU
    step count would cost a device synchronisation per parameter at every step)."""
    beside_param = optimizer.defaults.get("capturable") or optimizer.defaults.get("fused")
    # torch keeps a fused AdamW's step count in float32 whatever the default dtype.
    fused = bool(optimizer.defaults.get("fused"))
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 and not fused else torch.float32
    return {"step": torch.zeros((), dtype=dtype, device=param.device if beside_param else "cpu"),
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
