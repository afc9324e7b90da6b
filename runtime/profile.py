"""Profiling Planaria's own model: the glue between the config, the layers and the profiler.

Owns `profile_model(cfg)`, which builds the config's real layers (`LayerModel`) at
tp = 1 with the trainer's dtypes and recomputation setting and hands them to
`planaria.templates.profiler.profile_layers`, and `model_shape(cfg.model)`, the
planner's view of the model section. The profiler itself knows nothing of Planaria's
model, and the planner nothing of torch.
"""
from __future__ import annotations

from pathlib import Path

import torch

from planaria.runtime.config import Config, model_shape, torch_dtypes
from planaria.runtime.engine import accumulate_wide
from planaria.runtime.model import LayerModel
from planaria.runtime.optim import OptimizerSettings, build_optimizer
from planaria.runtime.tensor_parallel import TensorParallel
from planaria.templates.analytic import hardware
from planaria.templates.costs import CostModel
from planaria.templates.profiler import profile_layers


def profile_model(cfg: Config, *, device: torch.device | str | None = None,
                  cache_dir: str | Path | None = None, hardware_name: str = "cpu",
                  num_threads: int | None = None, repeats: int = 20,
                  warmup: int = 2, statistic: str = "mean",
                  measure_links: bool | None = None) -> CostModel:
    """Measure the config's layers on `device` (default: CUDA if present, else CPU).

    One microbatch of `train.micro_batch` sequences, `train.dtype` (bf16 autocast over
    float32 weights), `train.recompute`, and `parallel.tp` derived from tp = 1 as the
    profiler documents. The head is profiled with the training loss; each layer's
    update with the engine's optimizer (`build_optimizer`: one AdamW(foreach=False) per
    layer, weight decay on matrices). `hardware_name` names the preset whose links cost
    the tensor-parallel all-reduces and the sends between stages. `num_threads=1`
    profiles as the workers run under torchrun. With `train.exact_reduction` the
    layers sum their gradients wide, as the engine's do (`engine.accumulate_wide`),
    and the update rounds them. `statistic`: "mean" or "median" of the
    timed repeats (the profiler's docstring says why the mean). `measure_links`
    (default: for "cpu" on a CPU device) measures gloo between two processes and uses
    it for the links, message overhead and commit (`profiler.measure_gloo_links`).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    m, t = cfg.model, cfg.train
    shape = model_shape(m)
    param_dtype, _ = torch_dtypes(t.dtype)
    model = LayerModel(m, seed=t.seed, recompute=t.recompute)
    solo = TensorParallel()  # tp = 1: the only degree one process can run
    gen = torch.Generator().manual_seed(t.seed)
    tokens = torch.randint(m.vocab_size, (t.micro_batch, m.seq_len), generator=gen)
    targets = torch.randint(m.vocab_size, (t.micro_batch, m.seq_len), generator=gen).to(device)
    hidden = torch.randn(t.micro_batch, m.seq_len, m.d_model, generator=gen, dtype=param_dtype)

    built: dict[int, torch.nn.Module] = {}

    # Summing gradients wide costs a cast or an add per parameter per microbatch: a
    # tenth of a small model's backward on CPU. Time backward and the update with it.
    wide = torch.float64 if t.exact_reduction and param_dtype != torch.float64 else None

    def build_layer(index: int) -> torch.nn.Module:
        built[index] = model.build_layer(index, solo, param_dtype, device)
        if wide is not None:
            accumulate_wide(built[index], wide)
        return built[index]

    def make_input(index: int) -> torch.Tensor:
        # The residual stream is in the parameter dtype, float32 under bf16 autocast too.
        return (tokens if index == 0 else hidden).to(device)

    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        return model.loss(output, targets, solo, head=built.get(model.num_layers - 1))

    settings = OptimizerSettings(lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps,
                                 lr_schedule=t.lr_schedule, total_steps=t.steps,
                                 weight_decay=t.weight_decay)

    def make_optimizer(layer: torch.nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(layer, settings)

    if measure_links is None:
        measure_links = hardware_name == "cpu" and device.type == "cpu"
    hw = hardware(hardware_name, gpus_per_node=cfg.parallel.tp)
    return profile_layers(build_layer, make_input, shape, hw,
                          tp=cfg.parallel.tp, micro_batch=t.micro_batch, dtype=t.dtype,
                          recompute=t.recompute, repeats=repeats, warmup=warmup,
                          cache_dir=None if cache_dir is None else Path(cache_dir),
                          cache_key={"model": "planaria-llama", "norm_eps": m.norm_eps,
                                     "rope_theta": m.rope_theta,
                                     "grad_accum": str(wide).removeprefix("torch.")},
                          loss_fn=loss_fn, num_threads=num_threads, make_optimizer=make_optimizer,
                          statistic=statistic, measure_links=measure_links)
