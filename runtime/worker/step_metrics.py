"""What is written of training, step by step: the values of a committed step and of an
elastic job's epoch change, their TensorBoard tags, the model FLOPs utilisation, and the
committed steps read back from the workers' commit logs (a writer fills in the steps a
writer before it never wrote). `planaria.runtime.worker.metrics_writer` writes them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from planaria.runtime.contract.epochs import EpochEvent
from planaria.runtime.contract.logs import COMMITS, EVALS, CommitEntry, EvalEntry, read_logs

if TYPE_CHECKING:
    import torch

    from planaria.runtime.config.sections import Config

LOSS = "train/loss"
LR = "train/lr"
GRAD_NORM = "train/grad_norm"
TOKENS_PER_S = "train/tokens_per_s"
MFU = "train/mfu"
VAL_LOSS = "val/loss"
EPOCH = "elastic/epoch"
WORKERS = "elastic/workers"
RERUN = "elastic/rerun_steps"
PAUSE = "elastic/pause_s"
EVENT = "elastic/event"
"""The tags: every step's event has LOSS, LR and GRAD_NORM; an epoch change's has EPOCH,
WORKERS, RERUN and EVENT (a text saying what happened)."""


@dataclass(frozen=True)
class StepMetrics:
    """What is written of one committed step."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    time: float
    """When it committed (wall clock): the event's wall time."""
    tokens_per_s: float | None = None
    """None for a step applied by rolling forward: it was not timed."""
    mfu: float | None = None
    """None where the hardware's peak is not known (`MfuMeter`)."""
    val_loss: float | None = None

    def scalars(self) -> dict[str, float]:
        values = {LOSS: self.loss, LR: self.lr, GRAD_NORM: self.grad_norm}
        optional = {TOKENS_PER_S: self.tokens_per_s, MFU: self.mfu, VAL_LOSS: self.val_loss}
        return values | {tag: v for tag, v in optional.items() if v is not None}


@dataclass(frozen=True)
class EpochChange:
    """An elastic job's new epoch, written at its first step."""

    epoch: int
    step: int
    """The epoch's first iteration."""
    reason: str
    """"start" (epoch 0), or the controller's: "failure", "join", "leave"."""
    workers: int
    time: float
    source: str = "replicas"
    """Where the epoch's layer state came from: "replicas", "memory" (peer snapshots), "disk"."""
    rerun: int = 0
    """Committed steps the epoch trains again (it went back to a snapshot or a checkpoint)."""
    restored_step: int | None = None
    """The snapshot's or checkpoint's step it went back to."""
    failed: tuple[str, ...] = ()
    joined: tuple[str, ...] = ()
    pause_s: float | None = None
    """From the last step committed before the epoch to its first (set by the writer)."""

    @classmethod
    def of_event(cls, event: EpochEvent, workers: int) -> "EpochChange":
        """The controller's account of a reconfiguration (`EpochEvent`)."""
        restored = event.restored if event.restored is not None else event.snapshot
        return cls(epoch=event.epoch, step=event.first_iteration, reason=event.reason, workers=workers,
                   time=event.published_s, source=event.source, rerun=event.rerun, restored_step=restored,
                   failed=event.failed, joined=event.joined)

    def scalars(self) -> dict[str, float]:
        values = {EPOCH: self.epoch, WORKERS: self.workers, RERUN: self.rerun}
        return values if self.pause_s is None else values | {PAUSE: self.pause_s}

    def describe(self) -> str:
        parts = [f"epoch {self.epoch} from step {self.step}: {self.reason}, {self.workers} worker(s)"]
        if self.failed:
            parts.append(f"failed {', '.join(self.failed)}")
        if self.joined:
            parts.append(f"joined {', '.join(self.joined)}")
        source = {"memory": "peer snapshots", "disk": "checkpoint"}.get(self.source)
        if source is not None:
            parts.append(f"restored from the {source} of step {self.restored_step}, "
                         f"{self.rerun} committed step(s) run again")
        if self.pause_s is not None:
            parts.append(f"training paused {self.pause_s:.1f} s")
        return "; ".join(parts)


History = Callable[[int, int, int], tuple[list[StepMetrics], list[EpochChange]]]
"""(newest step written, first step this writer offers, newest epoch change of the job
written) -> the committed steps strictly between the two steps and the epoch changes
after that epoch and before the writer's own, from the job's own records."""


_PRESET = re.compile(r"\b(h200|h100|a100|v100|t4)\b")


class MfuMeter:
    """Model FLOPs utilisation of a step: the model's training FLOPs (`planning.
    model_flops_per_token`) over what the plan's devices could do at their peak. Only for
    a GPU the hardware presets describe, training in bfloat16 (the precision of their
    peaks); `for_job` returns None elsewhere (a CPU, another GPU, float32)."""

    def __init__(self, flops_per_token: float, peak_flops: float):
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops

    @classmethod
    def for_job(cls, cfg: "Config", device: "torch.device") -> "MfuMeter | None":
        if device.type != "cuda" or cfg.train.dtype != "bfloat16":
            return None
        import torch

        from planaria.runtime.config.sections import model_shape
        from planaria.runtime.planning.job_plans import model_flops_per_token
        from planaria.templates.analytic import hardware

        preset = _PRESET.search(torch.cuda.get_device_name(device).lower())
        if preset is None:
            return None
        return cls(model_flops_per_token(model_shape(cfg.model)), hardware(preset[1], gpus_per_node=1).peak_flops)

    def of(self, tokens: int, step_time_s: float, workers: int) -> float:
        return self.flops_per_token * tokens / (step_time_s * workers * self.peak_flops)


def step_metrics(result, *, at: float, workers: int, mfu: MfuMeter | None,
                 val_loss: float | None = None) -> StepMetrics:
    """What is written of a step this process committed (`engine.StepResult`) at `at`."""
    timed = result.step_time_s > 0
    return StepMetrics(step=result.iteration, loss=result.loss, grad_norm=result.grad_norm, lr=result.lr,
                       time=at, tokens_per_s=result.tokens / result.step_time_s if timed else None,
                       mfu=mfu.of(result.tokens, result.step_time_s, workers) if mfu is not None and timed else None,
                       val_loss=val_loss)


def steps_from_logs(out_dir: Path, after: int, before: int, *, tokens: int,
                    lr: Callable[[int], float]) -> tuple[list[StepMetrics], list[int]]:
    """The committed steps `after < step < before` as the workers' commit and evaluation
    logs in `out_dir` record them (the first record of each in time), and the steps of that
    range no log holds. No MFU: the plan that committed them is not at hand."""
    if before <= after + 1:
        return [], []
    commits = _first_in_time(read_logs(out_dir, COMMITS, CommitEntry), after, before)
    evals = _first_in_time(read_logs(out_dir, EVALS, EvalEntry), after, before)
    found = []
    for step, c in sorted(commits.items()):
        found.append(StepMetrics(
            step=step, loss=c.loss, grad_norm=c.grad_norm, lr=lr(step), time=c.time,
            tokens_per_s=tokens / c.step_time_s if c.step_time_s else None,
            val_loss=evals[step].val_loss if step in evals else None))
    return found, [s for s in range(after + 1, before) if s not in commits]


def _first_in_time(logs: dict, after: int, before: int) -> dict:
    first: dict = {}
    for entry in sorted((e for entries in logs.values() for e in entries), key=lambda e: e.time):
        if after < entry.step < before:
            first.setdefault(entry.step, entry)
    return first
