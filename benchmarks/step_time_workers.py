"""What each subprocess of step_time.py runs, its `--worker-*` modes: the plain PyTorch
reference, `torch.distributed.pipelining` used directly, the paired runs and the timed
sections of `--breakdown`. Each writes its step times as JSON to the path it is given.

step_time.py runs itself with those flags (so that the subprocess command lines it
prints name the script a reader ran) and calls these functions; nothing here starts a
process or prints a table.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path


def load(config: str, overrides: list[str]):
    from planaria.runtime.config.loading import load_config

    return load_config(config, overrides)


def write_times(path: str, times: list[float], **extra) -> None:
    Path(path).write_text(json.dumps({"step_times_s": times, **extra}))


def worker_reference(args) -> None:
    """(a): plain single-process PyTorch, the exactness tests' oracle."""
    import torch

    from planaria.runtime.data.token_datasets import build_dataset
    from planaria.runtime.models.llama import LayerModel
    from planaria.runtime.parallel.reference import train_reference
    from planaria.runtime.models.llama import torch_dtypes as dtypes
    from planaria.runtime.parallel.optim import optimizer_settings

    cfg = load(args.config, args.overrides)
    dataset = build_dataset(cfg.data.source, seq_len=cfg.model.seq_len,
                            vocab_size=cfg.model.vocab_size, seed=cfg.data.seed)
    param_dtype, autocast_dtype = dtypes(cfg.train.dtype)
    run = train_reference(LayerModel(cfg.model, seed=cfg.train.seed), optimizer_settings(cfg.train), dataset,
                          steps=cfg.train.steps, global_batch=cfg.train.global_batch,
                          micro_batch=cfg.train.micro_batch, data_seed=cfg.data.seed,
                          grad_clip=cfg.train.grad_clip, dtype=param_dtype,
                          autocast_dtype=autocast_dtype)
    write_times(args.worker_out, run.step_times_s, threads=torch.get_num_threads(),
                 final_loss=run.losses[-1])


def stage_ranges(n_blocks: int, pp: int) -> list[tuple[int, int]]:
    """Layer ranges of `pp` stages, the split Planaria's even layout makes (extra blocks
    go first; the embedding joins the first stage, the head the last)."""
    base, extra = divmod(n_blocks, pp)
    ranges, start = [], 0
    for j in range(pp):
        stop = start + base + (1 if j < extra else 0) + (j == 0) + (j == pp - 1)
        ranges.append((start, stop))
        start = stop
    return ranges


class DirectPipeline:
    """(c): one rank's stage of `torch.distributed.pipelining` used directly: the same layers
    (LayerModel.build_layer, tp = 1) in an nn.Sequential, PipelineStage + Schedule1F1B with
    loss / n_microbatches and scale_grads=False, one AdamW(foreach=False), local clipping."""

    def __init__(self, cfg, rank: int, world: int):
        import torch
        import torch.nn.functional as F
        from torch import nn
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        from planaria.runtime.data.token_datasets import build_dataset
        from planaria.runtime.models.llama import LayerModel
        from planaria.runtime.models.tensor_parallel import TensorParallel
        from planaria.runtime.models.llama import torch_dtypes as dtypes
        from planaria.runtime.parallel.optim import optimizer_settings

        self.cfg, self.rank = cfg, rank
        device = torch.device("cpu")
        param_dtype, autocast_dtype = dtypes(cfg.train.dtype)
        model = LayerModel(cfg.model, seed=cfg.train.seed)
        start, stop = stage_ranges(cfg.model.n_layers, world)[rank]
        single = TensorParallel()  # tp = 1
        self.module = nn.Sequential(*(model.build_layer(i, single, param_dtype, device, pretrained=True)
                                      for i in range(start, stop)))
        stage = PipelineStage(self.module, rank, world, device)
        n_micro = cfg.train.global_batch // cfg.train.micro_batch

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            logits = logits.flatten(0, 1)
            if autocast_dtype is not None:
                logits = logits.float()
            return F.cross_entropy(logits, target.flatten()) / n_micro

        self.schedule = Schedule1F1B(stage, n_micro, loss_fn=loss_fn, scale_grads=False)
        self.optim = optimizer_settings(cfg.train)
        self.params = list(self.module.parameters())
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in self.params if p.dim() >= 2], "weight_decay": self.optim.weight_decay},
             {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0}],
            lr=self.optim.lr, betas=self.optim.betas, eps=self.optim.eps, foreach=False)
        self.dataset = build_dataset(cfg.data.source, seq_len=cfg.model.seq_len,
                                     vocab_size=cfg.model.vocab_size, seed=cfg.data.seed)
        self.is_first, self.is_last = rank == 0, rank == world - 1
        self.autocast = (lambda: torch.autocast(device.type, dtype=autocast_dtype)) if autocast_dtype \
            else contextlib.nullcontext

    def step(self, iteration: int) -> tuple[float, float | None]:
        """One optimizer step; (seconds, loss on the last stage)."""
        import torch

        from planaria.runtime.parallel.optim import learning_rate

        cfg = self.cfg
        t0 = time.perf_counter()
        inputs, targets = self.dataset.batch(iteration, cfg.train.global_batch, cfg.data.seed)
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        with self.autocast():
            self.schedule.step(*((inputs,) if self.is_first else ()),
                               target=targets if self.is_last else None,
                               losses=losses if self.is_last else None, return_outputs=False)
        if cfg.train.grad_clip > 0:  # local to the stage: no all-reduce of the norm
            torch.nn.utils.clip_grad_norm_(self.params, cfg.train.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(iteration, self.optim)
        self.optimizer.step()
        loss = float(sum(l.detach() for l in losses)) if self.is_last else None
        return time.perf_counter() - t0, loss


def _init_torchrun_group(cfg) -> tuple[int, int]:
    from datetime import timedelta

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.comm.timeout_s))
    return rank, world


def worker_direct_pp(args) -> None:
    """(c) under torchrun: every rank writes its step times to WORKER_OUT.rank<r>."""
    import torch
    import torch.distributed as dist

    cfg = load(args.config, args.overrides)
    rank, world = _init_torchrun_group(cfg)
    try:
        pipe = DirectPipeline(cfg, rank, world)
        times, last_loss = [], None
        for iteration in range(cfg.train.steps):
            seconds, last_loss = pipe.step(iteration)
            times.append(seconds)
        write_times(f"{args.worker_out}.rank{rank}", times, threads=torch.get_num_threads(),
                     final_loss=last_loss)
    finally:
        dist.destroy_process_group()


def worker_paired_pp2(args) -> None:
    """Planaria's Engine (pp=2) and DirectPipeline in the same two processes, alternating
    blocks of steps: what is left of the difference is the runtimes', not the processes'."""
    import torch
    import torch.distributed as dist

    from planaria.runtime.worker.build import start_engine
    from planaria.runtime.config.validation import plan_from_config
    from planaria.runtime.data.token_datasets import build_dataset

    cfg = load(args.config, args.overrides)
    rank, world = _init_torchrun_group(cfg)
    try:
        # The trainer's own Engine: its dtypes, clipping and wide gradient sums.
        engine = start_engine(cfg, plan_from_config(cfg, world_size=world), rank, torch.device("cpu"))
        dataset = build_dataset(cfg.data.source, seq_len=cfg.model.seq_len,
                                vocab_size=cfg.model.vocab_size, seed=cfg.data.seed)
        pipe = DirectPipeline(cfg, rank, world)
        blocks: dict[str, list[list[float]]] = {"planaria_pp2": [], "direct_pp2": []}
        for r in range(args.paired_rounds):
            for name in (("planaria_pp2", "direct_pp2") if r % 2 == 0 else ("direct_pp2", "planaria_pp2")):
                dist.barrier()
                if name == "planaria_pp2":
                    # The engine runs each iteration once: its blocks carry on from the last.
                    times = [engine.train_step(i, dataset, cfg.data.seed).step_time_s
                             for i in range(r * cfg.train.steps, (r + 1) * cfg.train.steps)]
                else:
                    times = [pipe.step(i)[0] for i in range(cfg.train.steps)]
                blocks[name].append(times)
        engine.destroy()
        write_times(f"{args.worker_out}.rank{rank}", [], blocks=blocks)
    finally:
        dist.destroy_process_group()


def worker_paired_single(args) -> None:
    """Planaria's Engine (1 process, pp=1) and train_reference in the same process,
    alternating blocks of steps (train_reference builds a fresh model per block)."""
    import torch
    import torch.distributed as dist

    from planaria.runtime.worker import trainer
    from planaria.runtime.worker.build import start_engine
    from planaria.runtime.parallel.optim import optimizer_settings
    from planaria.runtime.models.llama import torch_dtypes as dtypes
    from planaria.runtime.config.validation import plan_from_config
    from planaria.runtime.data.token_datasets import build_dataset
    from planaria.runtime.models.llama import LayerModel
    from planaria.runtime.parallel.reference import train_reference

    cfg = load(args.config, args.overrides)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(trainer._free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        param_dtype, autocast_dtype = dtypes(cfg.train.dtype)
        model = LayerModel(cfg.model, seed=cfg.train.seed)
        optim = optimizer_settings(cfg.train)
        # The trainer's own Engine: its dtypes, clipping and wide gradient sums.
        engine = start_engine(cfg, plan_from_config(cfg, world_size=1), 0, torch.device("cpu"))
        dataset = build_dataset(cfg.data.source, seq_len=cfg.model.seq_len,
                                vocab_size=cfg.model.vocab_size, seed=cfg.data.seed)
        blocks: dict[str, list[list[float]]] = {"planaria": [], "plain": []}
        for r in range(args.paired_rounds):
            for name in (("planaria", "plain") if r % 2 == 0 else ("plain", "planaria")):
                if name == "planaria":
                    # The engine runs each iteration once: its blocks carry on from the last.
                    times = [engine.train_step(i, dataset, cfg.data.seed).step_time_s
                             for i in range(r * cfg.train.steps, (r + 1) * cfg.train.steps)]
                else:
                    times = train_reference(model, optim, dataset, steps=cfg.train.steps,
                                            global_batch=cfg.train.global_batch,
                                            micro_batch=cfg.train.micro_batch, data_seed=cfg.data.seed,
                                            grad_clip=cfg.train.grad_clip, dtype=param_dtype,
                                            autocast_dtype=autocast_dtype).step_times_s
                blocks[name].append(times)
        engine.destroy()
        write_times(f"{args.worker_out}.rank0", [], blocks=blocks)
    finally:
        dist.destroy_process_group()


class _Sections:
    """Seconds per named section and iteration, collected by wrapping callables."""

    def __init__(self):
        self.seconds: dict[str, dict[int, float]] = {}
        self.iteration = 0

    def wrap(self, name: str, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                per_iter = self.seconds.setdefault(name, {})
                per_iter[self.iteration] = per_iter.get(self.iteration, 0.0) + time.perf_counter() - t0
        return wrapper

    def dump(self, path: str, totals: list[float]) -> None:
        import torch

        sections = {name: [per_iter.get(i, 0.0) for i in range(len(totals))]
                    for name, per_iter in self.seconds.items()}
        Path(path).write_text(json.dumps({"step_times_s": totals, "sections": sections,
                                          "threads": torch.get_num_threads()}))


def worker_breakdown(args) -> None:
    """Planaria's Engine on one process, its sections timed by wrapping its methods."""
    import torch
    import torch.distributed as dist

    from planaria.runtime.parallel import engine as engine_mod
    from planaria.runtime.worker import trainer
    from planaria.runtime.worker.build import start_engine
    from planaria.runtime.config.validation import plan_from_config
    from planaria.runtime.data.token_datasets import build_dataset

    cfg = load(args.config, args.overrides)
    plan = plan_from_config(cfg, world_size=1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(trainer._free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    sec = _Sections()
    E = engine_mod.Engine
    E._forward_backward = sec.wrap("schedule.step", E._forward_backward)
    E._sync_gradients = sec.wrap("sync", E._sync_gradients)
    E._commit = sec.wrap("commit", E._commit)
    E._clip_and_step = sec.wrap("clip and step", E._clip_and_step)
    try:
        dataset = build_dataset(cfg.data.source, seq_len=cfg.model.seq_len,
                                vocab_size=cfg.model.vocab_size, seed=cfg.data.seed)
        dataset.batch = sec.wrap("data batch", dataset.batch)
        # The trainer's own Engine (its dtypes, clipping and wide gradient sums), its
        # methods wrapped above.
        engine = start_engine(cfg, plan, 0, torch.device("cpu"))
        # Inside the schedule: the stage's forward and backward chunks, the model's own
        # forward within them, and the loss; the rest of schedule.step is the runtime's.
        for stage in engine.stages:
            stage.forward_one_chunk = sec.wrap("forward_one_chunk", stage.forward_one_chunk)
            stage.backward_one_chunk = sec.wrap("backward", stage.backward_one_chunk)
            stage.submod.forward = sec.wrap("model forward", stage.submod.forward)
        engine.schedule._loss_fn = sec.wrap("loss", engine.schedule._loss_fn)
        for state in map(engine.shard, engine.held_layers()):
            state.optimizer.zero_grad = sec.wrap("zero_grad", state.optimizer.zero_grad)
            state.optimizer.step = sec.wrap("optimizer.step", state.optimizer.step)
        totals = []
        for iteration in range(cfg.train.steps):
            sec.iteration = iteration
            totals.append(engine.train_step(iteration, dataset, cfg.data.seed).step_time_s)
        engine.destroy()
    finally:
        dist.destroy_process_group()
    sec.dump(args.worker_out, totals)


def worker_breakdown_reference(args) -> None:
    """train_reference, its sections timed by wrapping what it calls (in this process only)."""
    import torch
    import torch.nn.functional as F

    from planaria.runtime.parallel import reference
    from planaria.runtime.data.token_datasets import build_dataset
    from planaria.runtime.models.llama import LayerModel
    from planaria.runtime.models.llama import torch_dtypes as dtypes
    from planaria.runtime.parallel.optim import optimizer_settings

    cfg = load(args.config, args.overrides)
    sec = _Sections()
    dataset = build_dataset(cfg.data.source, seq_len=cfg.model.seq_len,
                            vocab_size=cfg.model.vocab_size, seed=cfg.data.seed)
    batch = sec.wrap("data batch", dataset.batch)

    def batch_and_mark(iteration, *a, **k):  # the reference's step starts with its batch
        sec.iteration = iteration
        return batch(iteration, *a, **k)

    dataset.batch = batch_and_mark
    build = reference.build_reference_model

    def build_timed(*a, **k):
        net = build(*a, **k)
        net.forward = sec.wrap("model forward", net.forward)
        return net

    reference.build_reference_model = build_timed
    F.cross_entropy = sec.wrap("loss", F.cross_entropy)
    torch.Tensor.backward = sec.wrap("backward", torch.Tensor.backward)
    torch.Tensor.item = sec.wrap("loss.item", torch.Tensor.item)
    torch.nn.utils.clip_grad_norm_ = sec.wrap("clip_grad_norm_", torch.nn.utils.clip_grad_norm_)
    torch.optim.AdamW.step = sec.wrap("optimizer.step", torch.optim.AdamW.step)
    torch.optim.AdamW.zero_grad = sec.wrap("zero_grad", torch.optim.AdamW.zero_grad)
    param_dtype, autocast_dtype = dtypes(cfg.train.dtype)
    run = reference.train_reference(
        LayerModel(cfg.model, seed=cfg.train.seed), optimizer_settings(cfg.train), dataset,
        steps=cfg.train.steps, global_batch=cfg.train.global_batch,
        micro_batch=cfg.train.micro_batch, data_seed=cfg.data.seed, grad_clip=cfg.train.grad_clip,
        dtype=param_dtype, autocast_dtype=autocast_dtype)
    sec.dump(args.worker_out, run.step_times_s)
