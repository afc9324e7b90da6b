"""Plain single-process PyTorch training of the same model: the oracle for exactness tests
and the baseline for benchmarks.

Nothing of Planaria's runtime is used here: no plan, no pipeline, no tensor
parallelism, no layer-wise sync. The model's layers run in one `nn.Sequential`,
one AdamW holds every parameter, gradient accumulation goes over the microbatches
of the global batch, and `torch.nn.utils.clip_grad_norm_` clips. Only the layer
definitions, the data and the learning-rate formula are shared, because those are
what "the same training job" means.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from planaria.runtime.models.llama import LayerModel
from planaria.runtime.models.tensor_parallel import TensorParallel
from planaria.runtime.parallel.optim import OptimizerSettings, learning_rate


@dataclass
class ReferenceRun:
    losses: list[float]
    grad_norms: list[float]
    step_times_s: list[float]
    model: nn.Sequential


def build_reference_model(model: LayerModel, dtype: torch.dtype, device: torch.device) -> nn.Sequential:
    """The model whole, in plain PyTorch: the PyTorch references of the fused kernels,
    and a head that outputs the full logits (the oracle the fused paths are held to).
    Tied embeddings are truly tied here: the head's output weight is the embedding's
    own Parameter, so autograd sums the two uses and AdamW holds it once."""
    single = TensorParallel()  # tp = 1: every layer full size
    plain = LayerModel(replace(model.cfg, kernels="reference", fused_head_loss=False), model.seed, model.recompute)
    net = nn.Sequential(*(plain.build_layer(i, single, dtype, device, pretrained=True) for i in range(plain.num_layers)))
    tied = [net[index].get_parameter(name) for index, name in plain.tied_parameters()]
    for index, name in plain.tied_parameters()[1:]:
        owner, _, attribute = name.rpartition(".")
        setattr(net[index].get_submodule(owner), attribute, tied[0])
    return net


def train_reference(model: LayerModel, optim: OptimizerSettings, dataset, *, steps: int,
                    global_batch: int, micro_batch: int, data_seed: int, grad_clip: float,
                    dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu"),
                    autocast_dtype: torch.dtype | None = None) -> ReferenceRun:
    net = build_reference_model(model, dtype, device)
    params = list(net.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=optim.lr, betas=optim.betas, eps=optim.eps, foreach=False)
    num_microbatches = global_batch // micro_batch
    run = ReferenceRun([], [], [], net)
    for iteration in range(steps):
        start = time.perf_counter()
        inputs, targets = dataset.batch(iteration, global_batch, data_seed)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(inputs.split(micro_batch), targets.split(micro_batch)):
            with _autocast(device, autocast_dtype):
                logits = net(x.to(device))  # (b, T, V)
                loss = F.cross_entropy(logits.flatten(0, 1).float() if autocast_dtype else logits.flatten(0, 1),
                                       y.to(device).flatten()) / num_microbatches
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip) if grad_clip > 0 else _norm(params)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(iteration, optim)
        optimizer.step()
        run.losses.append(total)
        run.grad_norms.append(float(norm))
        run.step_times_s.append(time.perf_counter() - start)
    return run


def _norm(params) -> torch.Tensor:
    return torch.sqrt(sum(p.grad.detach().double().pow(2).sum() for p in params))


def _autocast(device: torch.device, dtype: torch.dtype | None):
    import contextlib

    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
