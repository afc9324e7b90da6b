"""`python -m planaria.train CONFIG.yaml [section.key=value ...]`: the training entry point.

Alone it trains in one process; under `torchrun` it reads RANK / WORLD_SIZE and
trains with the plan the config describes. Everything that can be checked without
processes (config, plan, schedules) is checked before the process group is created.
Rank 0 prints progress and writes `OUTPUT_DIR/metrics.jsonl`, one JSON object per
step (and, with `logging.tensorboard`, TensorBoard events:
`planaria.runtime.worker.metrics_writer`); at the end the final parameters are saved, one file
per layer and tp rank.
Started by a Planaria control plane (`PLANARIA_STORE` in the environment), it runs the
elastic worker loop instead (`planaria.runtime.worker.elastic_worker`): it survives the
failure of other workers and follows the plans the control plane publishes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

from planaria.runtime.config.hf_config import check_init_from
from planaria.runtime.config.loading import load_config
from planaria.runtime.config.sections import Config, ConfigError, uses_planner
from planaria.runtime.config.validation import plan_from_config
from planaria.runtime.contract.checkpoint_layout import complete_checkpoints
from planaria.runtime.contract.logs import METRICS, MetricsEntry, append as append_entry
from planaria.runtime.data.token_datasets import TokenDataset, dataset_for
from planaria.runtime.parallel.engine import StepResult
from planaria.runtime.parallel.loop import Call, Evaluation, Every, StepContext, run_steps
from planaria.runtime.state.checkpoints import save_checkpoint
from planaria.runtime.state.layer_sources import FromCheckpoint
from planaria.runtime.state.saved_model import save_model_shards
from planaria.runtime.worker.build import build_engine, describe, plan_for_world
from planaria.runtime.worker.elastic_worker import elastic_environment, run_elastic
from planaria.runtime.worker.fault_injection import FaultInjector
from planaria.runtime.worker.metrics_writer import RunWriter, WandbRun
from planaria.runtime.worker.step_metrics import MfuMeter, step_metrics


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m planaria.train",
        description="Train a LLaMA-style model with pipeline, tensor and data parallelism.",
    )
    parser.add_argument("config", help="YAML config, e.g. configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*", default=[], help="section.key=value, e.g. train.steps=10")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(highlight=False, soft_wrap=True)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(args.config, args.overrides)
        check_init_from(cfg)  # its tensors' names and shapes, unless a checkpoint is resumed
        elastic = elastic_environment()
        if elastic is not None:  # started by a Planaria control plane
            device, backend = _device_and_backend(cfg, local_rank=elastic[2])
            return run_elastic(cfg, console, device, backend)
        plan = None if uses_planner(cfg) else plan_from_config(cfg, world_size=world_size)
        if plan is None and world_size % cfg.parallel.tp:
            raise ConfigError(f"{world_size} processes do not make whole nodes of parallel.tp = "
                              f"{cfg.parallel.tp} workers; launch a multiple of {cfg.parallel.tp}")
        device, backend = _device_and_backend(cfg, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                                              per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        # Before the process group and the planner's profiling: bad data fails in a moment.
        data = dataset_for(cfg), dataset_for(cfg, "val") if cfg.eval.every else None
    except ConfigError as err:
        if rank == 0:
            console.print(f"[bold red]config error:[/] {err}")
        return 2
    _init_process_group(backend, rank, world_size, cfg.comm.timeout_s)
    try:
        if plan is None:
            plan, summary = plan_for_world(cfg, world_size, rank, device)
            if rank == 0:
                console.print(summary)
        train(cfg, plan, rank, device, console, data)
    except ConfigError as err:
        if rank == 0:
            console.print(f"[bold red]config error:[/] {err}")
        return 2
    finally:
        dist.destroy_process_group()
    return 0


def _device_and_backend(cfg: Config, *, local_rank: int, per_node: int = 1) -> tuple[torch.device, str]:
    """This process's device and backend: with NCCL, the GPU of its local rank (torchrun's
    LOCAL_RANK, or the one a Planaria agent gives it); `per_node` processes on its node
    (at least local_rank + 1: an agent does not say how many it starts)."""
    backend = cfg.comm.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        per_node = max(per_node, local_rank + 1)
        gpus = torch.cuda.device_count()
        if per_node > gpus:  # every rank of the node sees it, so rank 0 says it
            raise ConfigError(f"{per_node} process(es) on this node but {gpus} GPU(s) visible, and NCCL "
                              f"needs a GPU per process: launch at most {gpus} per node "
                              "(--nproc-per-node), or set comm.backend=gloo to train on CPU")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), backend
    return torch.device("cpu"), backend


def _init_process_group(backend: str, rank: int, world_size: int, timeout_s: float) -> None:
    if "MASTER_ADDR" not in os.environ:  # a single process started without torchrun
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps its store across restarts: without a prefix per attempt, the
        # restarted workers would read the dead ones' addresses and fail to connect.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=dist.PrefixStore(f"planaria/attempt{restart}/", store),
                                rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        return
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(cfg: Config, plan, rank: int, device: torch.device, console: Console,
          data: tuple[TokenDataset, TokenDataset | None]) -> None:
    """Train `plan`; `data`: the training set and, with eval.every, the validation set."""
    out_dir = Path(cfg.output.dir)
    dataset, val_dataset = data
    resume = _checkpoint_to_resume(cfg)
    if resume is not None:
        plan = replace(plan, first_iteration=resume[0] + 1)
    engine = build_engine(cfg, device, phase=_fault_injector(rank))
    engine.enter_epoch(plan, rank, layers=None if resume is None else FromCheckpoint(resume[1]))
    log = _MetricsLog(out_dir / METRICS, cfg.train.log_every, append=resume is not None) if rank == 0 else None
    if rank == 0:
        console.print(describe(cfg, plan))
        console.print(f"data: {dataset.description}")
        if resume is not None:
            console.print(f"resumed from the checkpoint of iteration {resume[0]} ({resume[1]})")
    events = _run_writer(cfg, plan, device, console) if rank == 0 else None
    components = [Evaluation(val_dataset, cfg.data.seed, cfg.eval.batches, cfg.eval.due)]
    if log is not None:  # after the evaluation: a step's line carries its validation loss
        components.append(Call(lambda engine, ctx: log.write(ctx, console)))
    if events is not None:
        components.append(Call(lambda engine, ctx: events.commit(ctx)))
    components.append(Every(cfg.checkpoint.every, before_last=True, action=lambda engine, step: save_checkpoint(
        engine, cfg.checkpoint_dir, cfg.checkpoint.keep, data_source=cfg.data.source)))
    try:
        run_steps(engine, dataset, cfg.data.seed, plan.first_iteration, cfg.train.steps, components)
        if rank == 0 and device.type == "cuda":
            console.print(f"peak GPU memory: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated, "
                          f"{torch.cuda.max_memory_reserved(device) / 2**30:.2f} GiB reserved")
        if cfg.output.save_final:
            save_model_shards(engine, out_dir / "final", data_source=cfg.data.source)
            if rank == 0:
                console.print(f"saved final parameters to {out_dir / 'final'}")
    finally:
        if log is not None:
            log.close()
        if events is not None:
            events.close()
        engine.destroy()


def _fault_injector(rank: int) -> FaultInjector | None:
    """PLANARIA_FAULTS names workers of a plain torchrun job "rank<RANK>"; a fault fires in
    the first run only, not after torchrun restarted the workers."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    return FaultInjector.from_env(f"rank{rank}")


def _checkpoint_to_resume(cfg: Config) -> tuple[int, Path] | None:
    """(iteration, directory) of the newest complete checkpoint when checkpoints are on
    and one exists: a job restarted with the same command line goes on from there."""
    if not cfg.checkpoint.every:
        return None
    found = complete_checkpoints(cfg.checkpoint_dir)
    return found[-1] if found else None


class _Events:
    """Rank 0's TensorBoard events (and W&B run) of a plain job: one writer, epoch 0."""

    def __init__(self, writer: RunWriter, wandb: WandbRun | None, mfu: MfuMeter | None, workers: int):
        self.writer, self.wandb, self.mfu, self.workers = writer, wandb, mfu, workers

    def commit(self, ctx: StepContext) -> None:
        self.writer.commit(step_metrics(ctx.result, at=time.time(), workers=self.workers, mfu=self.mfu,
                                        val_loss=ctx.val_loss))

    def close(self) -> None:
        self.writer.close(wait_s=30.0)
        if self.wandb is not None:
            self.wandb.close()


def _run_writer(cfg: Config, plan, device: torch.device, console: Console) -> _Events | None:
    """The job's TensorBoard writer when logging.tensorboard is on. A torchrun restart
    (same run id, or a restart count above 0) goes on with the run's events; any other
    start from step 0 begins the directory anew (module `metrics_writer`, "fresh")."""
    directory = cfg.tensorboard_dir
    if directory is None:
        return None
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    job = run_id if run_id not in ("", "none") else uuid.uuid4().hex  # torchrun's default id is "none"
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    w = cfg.logging.wandb
    wandb = WandbRun(w, job=job, directory=Path(w.dir or cfg.output.dir)) if w.enabled else None
    writer = RunWriter(directory, job=job, epoch=0, fresh=plan.first_iteration == 0 and not restarted,
                       wandb=wandb, log=lambda message: console.print(message, markup=False))
    console.print(f"tensorboard: {directory}")
    return _Events(writer, wandb, MfuMeter.for_job(cfg, device), plan.world_size)


def _progress_line(r: StepResult, steps: int) -> str:
    return (f"step {r.iteration + 1:>5}/{steps} | loss {r.loss:.4f} | grad norm {r.grad_norm:.3f} | "
            f"lr {r.lr:.2e} | {r.tokens / r.step_time_s:,.0f} tok/s | {r.step_time_s * 1000:.0f} ms")


class _MetricsLog:
    """metrics.jsonl (`contract.logs.MetricsEntry`, one complete line per step, flushed)
    and the progress lines of rank 0."""

    def __init__(self, path: Path, log_every: int, append: bool = False):
        self.log_every = log_every
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a" if append else "w", encoding="utf-8")

    def write(self, ctx: StepContext, console: Console) -> None:
        r = ctx.result
        append_entry(self._file, MetricsEntry(step=r.iteration, loss=r.loss, grad_norm=r.grad_norm, lr=r.lr,
                                              tokens=r.tokens, step_time_s=r.step_time_s, time=time.time(),
                                              val_loss=ctx.val_loss))
        if r.iteration % self.log_every == 0 or ctx.last:
            console.print(_progress_line(r, ctx.steps))
        if ctx.val_loss is not None:
            console.print(f"step {r.iteration + 1:>5}/{ctx.steps} | validation loss {ctx.val_loss:.4f}")

    def close(self) -> None:
        self._file.close()


if __name__ == "__main__":
    sys.exit(main())
