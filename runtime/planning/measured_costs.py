"""Profiling Planaria's own model: the glue between the config, the layers and the profiler.

Owns `profile_model(cfg)`, which builds the config's real layers (`LayerModel`) at
tp = 1 with the trainer's dtypes and recomputation setting and hands them to
`planaria.templates.profiler.profile_layers`, and `model_shape(cfg.model)`, the
planner's view of the model section, and `worker_load`, the busy neighbours a CPU
job's layers are timed beside (`concurrent_workers`). The profiler itself knows
nothing of Planaria's model, and the planner nothing of torch.
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import torch

from planaria.runtime.config.sections import Config, ModelConfig, model_shape
from planaria.runtime.models.llama import LayerModel, torch_dtypes
from planaria.runtime.models.tensor_parallel import TensorParallel
from planaria.runtime.parallel.engine import accumulate_wide
from planaria.runtime.parallel.optim import build_optimizer, optimizer_settings
from planaria.runtime.planning.pipeline_probe import measure_links_and_runtime
from planaria.templates.analytic import hardware, sums_wide
from planaria.templates.costs import CostModel
from planaria.templates.profiler import profile_layers


def profiled_cost_model(cfg: Config, *, hardware_name: str, gpus_per_node: int, cache_dir: Path | None = None,
                        device: torch.device | None = None, concurrent_workers: int | None = None) -> CostModel:
    """The job's cost model measured on `device` (the analytic one is
    `planaria.runtime.planning.job_plans.cost_model`). `concurrent_workers` (profiling on CPU): how
    many workers compute at once on this machine, default a node's `gpus_per_node`;
    counted at most one per core."""
    if gpus_per_node != cfg.parallel.tp:
        cfg = replace(cfg, parallel=replace(cfg.parallel, tp=gpus_per_node))
    # CPU workers run one thread each under torchrun; profile the way they run.
    on_cpu = (device or torch.device("cuda" if torch.cuda.is_available() else "cpu")).type == "cpu"
    # CPU workers of one machine share its cores: profile beside as many busy ones.
    busy = min(concurrent_workers or gpus_per_node, os.cpu_count() or 1) if on_cpu else 1
    return profile_model(cfg, hardware_name=hardware_name, cache_dir=cache_dir, device=device,
                         num_threads=1 if on_cpu else None, concurrent_workers=busy)


def profile_model(cfg: Config, *, device: torch.device | str | None = None,
                  cache_dir: str | Path | None = None, hardware_name: str = "cpu",
                  num_threads: int | None = None, repeats: int = 20,
                  warmup: int = 2, statistic: str = "mean",
                  measure_links: bool | None = None, concurrent_workers: int = 1) -> CostModel:
    """Measure the config's layers on `device` (default: CUDA if present, else CPU).

    One microbatch of `train.micro_batch` sequences, `train.dtype` (bf16 autocast over
    float32 weights), `train.recompute`, and `parallel.tp` derived from tp = 1 as the
    profiler documents. The head is profiled with the training loss; each layer's
    update with the engine's optimizer (`build_optimizer`: one AdamW per layer, of
    `train.optimizer_impl`, weight decay on matrices); the blocks compiled with
    `train.compile`. `hardware_name` names the preset whose links cost
    the tensor-parallel all-reduces and the sends between stages. `num_threads=1`
    profiles as the workers run under torchrun. With `train.exact_reduction` the
    layers sum their gradients wide, as the engine's do (`engine.accumulate_wide`),
    and the update rounds them. `statistic`: "mean" or "median" of the
    timed repeats (the profiler's docstring says why the mean). `measure_links`
    (default: for "cpu" on a CPU device) measures gloo between two processes and uses
    it for the links, message overhead and commit (`gloo_links.measure_gloo_links`), and
    the pipeline runtime's own cost per action
    (`pipeline_probe.measure_links_and_runtime`).
    `concurrent_workers`: how many of the job's workers compute at once on this machine
    (CPU jobs: a torchrun job's workers share the host's cores). The layers are then
    timed while `concurrent_workers - 1` other processes run a block's forward and
    backward (`worker_load`): on a shared VM a layer runs up to a half slower beside
    busy neighbours than beside idle cores, and training always has them. GPU workers
    compute on their own devices: there it changes nothing.
    """
    if concurrent_workers < 1:
        raise ValueError(f"concurrent_workers must be at least 1, got {concurrent_workers}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    m, t = cfg.model, cfg.train
    shape = model_shape(m)
    param_dtype, _ = torch_dtypes(t.dtype)
    model = LayerModel(m, seed=t.seed, recompute=t.recompute, compile=t.compile)  # as the workers run them
    solo = TensorParallel()  # tp = 1: the only degree one process can run
    gen = torch.Generator().manual_seed(t.seed)
    tokens = torch.randint(m.vocab_size, (t.micro_batch, m.seq_len), generator=gen)
    targets = torch.randint(m.vocab_size, (t.micro_batch, m.seq_len), generator=gen).to(device)
    hidden = torch.randn(t.micro_batch, m.seq_len, m.d_model, generator=gen, dtype=param_dtype)

    built: dict[int, torch.nn.Module] = {}

    # Summing gradients wide costs a cast or an add per parameter per microbatch: a
    # tenth of a small model's backward on CPU. Time backward and the update with it.
    wide = torch.float64 if sums_wide(t.dtype, t.exact_reduction) else None

    def build_layer(index: int) -> torch.nn.Module:
        # Timing needs the shapes, not the values: model.init_from is not read for it.
        built[index] = model.build_layer(index, solo, param_dtype, device, pretrained=False)
        if wide is not None:
            accumulate_wide(built[index], wide)
        return built[index]

    def make_input(index: int) -> torch.Tensor:
        # The residual stream is in the parameter dtype, float32 under bf16 autocast too.
        return (tokens if index == 0 else hidden).to(device)

    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        return model.loss(output, targets, solo, head=built.get(model.num_layers - 1))

    settings = optimizer_settings(t)

    def make_optimizer(layer: torch.nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(layer, settings)

    if measure_links is None:
        measure_links = hardware_name == "cpu" and device.type == "cpu"
    hw = hardware(hardware_name, gpus_per_node=cfg.parallel.tp)
    return profile_layers(build_layer, make_input, shape, hw,
                          tp=cfg.parallel.tp, micro_batch=t.micro_batch, dtype=t.dtype,
                          recompute=t.recompute, wide_gradients=wide is not None, repeats=repeats, warmup=warmup,
                          cache_dir=None if cache_dir is None else Path(cache_dir),
                          cache_key={"model": "planaria-llama", "norm_eps": m.norm_eps,
                                     "rope_theta": m.rope_theta,
                                     "grad_accum": str(wide).removeprefix("torch."),
                                     "compile": t.compile, "optimizer_impl": t.optimizer_impl,
                                     "concurrent_workers": concurrent_workers,
                                     "runtime_probe": "1f1b-2-stages" if measure_links else None},
                          loss_fn=loss_fn, num_threads=num_threads, make_optimizer=make_optimizer,
                          statistic=statistic, measure_links=measure_links,
                          background=(lambda: worker_load(cfg, concurrent_workers - 1, device))
                          if device.type == "cpu" else None,
                          link_measurer=measure_links_and_runtime)


@contextmanager
def worker_load(cfg: Config, workers: int, device: torch.device, *, start_timeout_s: float = 120.0):
    """While inside: `workers` processes, each repeating a block's forward and backward
    of `cfg` with one thread on the CPU, as the job's other workers would compute.

    Fresh interpreters (`python -m planaria.runtime.planning.measured_costs --load-worker`, so callers
    need no `__main__` guard), warm before the body runs, killed after it. Yields their
    process ids.
    """
    if workers <= 0:
        yield []
        return
    spec = json.dumps({"model": asdict(cfg.model), "micro_batch": cfg.train.micro_batch,
                       "dtype": cfg.train.dtype, "seed": cfg.train.seed,
                       "recompute": cfg.train.recompute})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # stderr to a file: a pipe nobody reads could fill up and stall the load.
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(workers)]
    procs = [subprocess.Popen([sys.executable, "-m", "planaria.runtime.planning.measured_costs", "--load-worker", spec],
                              stdout=subprocess.PIPE, stderr=log, text=True, env=env)
             for log in logs]
    try:
        for proc, log in zip(procs, logs):
            _wait_ready(proc, log, start_timeout_s)
        yield [proc.pid for proc in procs]
    finally:
        for proc, log in zip(procs, logs):
            proc.kill()
            proc.wait()
            proc.stdout.close()
            log.close()


def _wait_ready(proc: subprocess.Popen, log, timeout_s: float) -> None:
    """Wait for a load process's "ready" line; kill it and raise with its stderr otherwise."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        line = proc.stdout.readline() if sel.select(timeout_s) else ""
    if line.strip() != "ready":
        proc.kill()
        proc.wait()
        log.seek(0)
        raise RuntimeError(f"a load process for the profile did not start within {timeout_s:.0f} s "
                           f"(exit code {proc.returncode}): {log.read().strip()[-2000:]}")


def _load_worker(spec: dict) -> None:
    """A block's forward and backward, over and over, until killed."""
    torch.set_num_threads(1)
    m = ModelConfig(**spec["model"])
    param_dtype, _ = torch_dtypes(spec["dtype"])
    block = LayerModel(m, seed=spec["seed"], recompute=spec["recompute"]).build_layer(
        1, TensorParallel(), param_dtype, torch.device("cpu"), pretrained=False)
    x = torch.randn(spec["micro_batch"], m.seq_len, m.d_model, dtype=param_dtype, requires_grad=True)
    block(x).sum().backward()
    print("ready", flush=True)
    while True:
        for _ in range(4):
            block(x).sum().backward()
        block.zero_grad(set_to_none=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--load-worker":
        _load_worker(json.loads(sys.argv[2]))
    else:
        sys.exit("usage: python -m planaria.runtime.planning.measured_costs --load-worker SPEC (used by worker_load)")
