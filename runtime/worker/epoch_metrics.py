"""An elastic worker's training metrics: the TensorBoard (and W&B) writer of each epoch in
which this worker is the plan's rank 0, fed from the loop after every committed step.

Each epoch's writer takes over the run's directory (`planaria.runtime.worker.metrics_writer`,
which writes each step once); what it finds committed and not written it takes from the
job's own records: the steps from the workers' commit logs, the epoch changes from the
control plane's accounts (`EpochEvent`).

The writing runs on a thread of its own, in order; the loop only measures the step. On
the training thread it held rank 0's next step, and every rank's with it: the directory's
lock, the event file, and for an epoch that trains before its record is published (a
join's, prepared before the stop) a look at the control plane after each step until it
is (a round trip to etcd): 63 ms of a join's second step on two cores, traced.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from planaria.runtime.config.sections import Config
from planaria.runtime.contract import env, keys
from planaria.runtime.contract.epochs import EpochEvent, EpochRecord
from planaria.runtime.parallel.optim import learning_rate, optimizer_settings
from planaria.runtime.worker.metrics_writer import RunWriter, WandbRun
from planaria.runtime.worker.step_metrics import EpochChange, MfuMeter, StepMetrics, step_metrics, steps_from_logs
from planaria.templates.plan import Plan

_NOT_PUBLISHED = object()
"""`epoch_change`'s answer for an epoch whose record is not published yet."""


class EpochMetrics:
    """The metrics side of one elastic worker, across its epochs (logging.tensorboard)."""

    def __init__(self, cfg: Config, store, device: torch.device, out_dir: Path, log: Callable[[str], None]):
        """`store`: the job's store, where the control plane's records are read."""
        self.cfg, self.store, self.out_dir, self.log = cfg, store, out_dir, log
        self.job_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get(env.STORE, "")
        """The same in every worker of the job: its run id (an agent's), else its store's address."""
        w = cfg.logging.wandb
        self.wandb = WandbRun(w, job=self.job_id, directory=Path(w.dir or cfg.output.dir)) if w.enabled else None
        self.mfu = MfuMeter.for_job(cfg, device) if cfg.tensorboard_dir is not None else None
        self.writer: RunWriter | None = None
        """The TensorBoard writer, while this worker is the plan's rank 0 of an epoch."""
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics")
        """Where the writers write, in order (module docstring)."""
        self._queued = []
        """The writes handed to `_thread` and not known done."""

    def component(self, epoch: int, plan: Plan, rank: int,
                  committed_at: Callable[[], float]) -> Callable[[object, object], None] | None:
        """The loop component that writes this epoch's steps, when this worker is the
        plan's rank 0 and logging.tensorboard is on; None otherwise. `committed_at`: when
        the step just committed was (the commit log's own time, logged before the
        evaluation)."""
        directory = self.cfg.tensorboard_dir
        if directory is None or rank != 0:
            return None
        # `fresh`: nothing of the job was committed before this plan's first step (a plan
        # that goes back after a failure never starts at 0: there is no step before it).
        writer = self.writer = RunWriter(directory, job=self.job_id, epoch=epoch, fresh=plan.first_iteration == 0,
                                         history=lambda after, before, after_epoch: self._history(
                                             after, before, after_epoch, epoch),
                                         wandb=self.wandb, log=self.log)
        first_commit_s: float | None = None
        change_written = False

        def write_step(metrics: StepMetrics) -> None:  # (on `_thread`: its own state)
            nonlocal first_commit_s, change_written
            first_commit_s = first_commit_s or metrics.time
            # An epoch prepared before the stop trains before its record is published (the
            # controller publishes it once the statuses are in): its change is written with
            # the first step that finds the record.
            change = None
            if not change_written:
                change = self.epoch_change(epoch, first_commit_s, absent=_NOT_PUBLISHED)
                change_written = change is not _NOT_PUBLISHED
                change = None if change is _NOT_PUBLISHED else change
            writer.commit(metrics, change)

        def write(engine, ctx) -> None:
            metrics = step_metrics(ctx.result, at=committed_at(), workers=plan.world_size, mfu=self.mfu,
                                   val_loss=ctx.val_loss)
            self._submit(write_step, metrics)
        return write

    def _submit(self, fn, *args) -> None:
        """`fn(*args)` on the writing thread, after what was handed to it before."""
        def run() -> None:
            try:
                fn(*args)
            except Exception as err:  # noqa: BLE001 - metrics must never end training
                self.log(f"metrics: {type(err).__name__}: {err}")
        self._queued = [f for f in self._queued if not f.done()] + [self._thread.submit(run)]

    def _drain(self, wait_s: float) -> bool:
        """Wait up to `wait_s` for the writes handed over so far: True if they are done."""
        _, pending = wait(self._queued, timeout=wait_s)
        self._queued = list(pending)
        return not pending

    def flush(self, wait_s: float) -> None:
        """The epoch's last steps written, before the job can be declared over."""
        started = time.monotonic()
        writer = self.writer
        if writer is not None and self._drain(wait_s):
            writer.flush(wait_s=max(0.0, wait_s - (time.monotonic() - started)))

    def end_epoch(self) -> None:
        """The epoch's writer closes once what it was handed is written (a failed epoch's
        committed steps too; never waiting on the directory's lock), on the writing
        thread: the next epoch's entry does not wait for it."""
        if self.writer is not None:
            self._submit(self.writer.close)
            self.writer = None

    def close(self, wait_s: float = 30.0) -> None:
        """The job is over: what was handed over written (up to `wait_s`), the W&B run
        finishes."""
        self._drain(wait_s)
        self._thread.shutdown(wait=False)
        if self.wandb is not None:
            self.wandb.close()

    def _history(self, after: int, before: int, after_epoch: int,
                 epoch: int) -> tuple[list[StepMetrics], list[EpochChange]]:
        """What the writer of `epoch` finds committed and not written when it takes over:
        steps from the workers' commit logs, epoch changes from the control plane."""
        settings = optimizer_settings(self.cfg.train)
        steps, missing = steps_from_logs(self.out_dir, after, before,
                                         tokens=self.cfg.train.global_batch * self.cfg.model.seq_len,
                                         lr=lambda step: learning_rate(step, settings))
        if missing:
            self.log(f"metrics: steps {missing} were committed before this epoch but are in no commit log "
                     f"in {self.out_dir}; they are not written (is output.dir shared by the nodes?)")
        changes = [change for e in range(after_epoch + 1, epoch) if (change := self.epoch_change(e)) is not None]
        return steps, changes

    def epoch_change(self, epoch: int, first_commit_s: float | None = None, absent=None) -> EpochChange | None:
        """Epoch `epoch`'s change as the control plane recorded it (`first_commit_s`: when
        this worker committed its first step, for the epoch it writes); None if unrecorded
        or unreadable, `absent` if its record is not published (yet)."""
        store = self.store
        try:
            if not store.check([keys.epoch_record(epoch)]):
                return absent
            plan = EpochRecord.from_json(store.get(keys.epoch_record(epoch))).plan
            event = store.get(keys.epoch_event(epoch)) if epoch and store.check([keys.epoch_event(epoch)]) else None
        except Exception as err:  # the control plane is away (etcd down): a later writer writes it
            self.log(f"metrics: epoch {epoch}'s account could not be read ({type(err).__name__}: {err})")
            return None
        if epoch == 0:
            change = EpochChange(epoch=0, step=plan.first_iteration, reason="start", workers=plan.world_size,
                                 time=first_commit_s or time.time())
        elif event is not None:
            change = EpochChange.of_event(EpochEvent.from_json(event), plan.world_size)
        else:  # its leader died between the record and the account
            change = EpochChange(epoch=epoch, step=plan.first_iteration, reason="unrecorded",
                                 workers=plan.world_size, time=time.time())
        return change if first_commit_s is None else replace(change, time=first_commit_s)
