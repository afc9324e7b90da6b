"""Training metrics as TensorBoard event files, and optionally a Weights & Biases run,
each committed step written exactly once whichever process writes it
(docs/training_metrics.md).

Owns a run's metrics directory (`logging.tensorboard.dir`) and what lies in it:

- `events.out.tfevents.<time>.<host>.<pid>.<n>.planaria-<job>-e<epoch>`: one event file
  per writer, a process that is the plan's rank 0, for one epoch of one job; TensorBoard
  merges the files of a directory. A step is one event holding all its values, so a
  writer killed mid-write leaves at most a truncated last record, which readers skip.
- `writer.json`: the fence, the job and epoch of the writer in force, replaced atomically;
- `writer.lock`: locked (flock) by a writer while it takes over and while it writes.

The rule that writes a step once, with its committed values:

1. A step is offered to the writer only after its commit, so nothing uncommitted is ever
   written.
2. A writer writes only while holding the lock and only while the fence names it. It
   takes over (writes the fence) unless the fence names a later epoch of its job: a
   rank 0 of an epoch the job has left, still alive, writes nothing more.
3. Taking over, it reads back every event file of the directory and from then on writes
   only steps above the newest one found (and only its job's epoch changes above the
   newest found). A step that a rollback to a peer snapshot or a checkpoint commits again
   is not written again: under the exactness rule (docs/recovery.md) its values are the
   ones already written.
4. Committed steps that no writer wrote (the writer in force died first) are taken from
   the job's own records (`History`: the workers' commit logs) when the next writer
   takes over.

On the training thread the lock is only ever tried, never waited for: a writer that finds
it held (by a frozen process) keeps its steps and writes them after a later step.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from planaria.runtime.worker.step_metrics import EPOCH, EVENT, LOSS, EpochChange, History, StepMetrics

if TYPE_CHECKING:
    from planaria.runtime.config.sections import WandbConfig

FENCE = "writer.json"
LOCK = "writer.lock"
EVENTS = "tfevents"

_FILE_OF_JOB = re.compile(r"\.planaria-([0-9a-f]+)-e(\d+)$")


# ------------------------------------------------------------------ the fence
@dataclass(frozen=True)
class Fence:
    """The writer in force: `epoch` of `job` (`writer.json`)."""

    job: str
    epoch: int


def read_fence(directory: Path) -> Fence | None:
    """The directory's fence; None when there is none. A file that is not one is an error
    naming it (it is only ever replaced whole)."""
    path = Path(directory) / FENCE
    try:
        data = json.loads(path.read_text())
        return Fence(job=str(data["job"]), epoch=int(data["epoch"]))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a metrics writer's fence ({err}); remove it to let the next "
                         "writer take over") from None


def write_fence(directory: Path, fence: Fence) -> None:
    """Replace the fence atomically: a reader sees the old one or the new one, whole."""
    with tempfile.NamedTemporaryFile("w", dir=directory, prefix=f".{FENCE}.", delete=False) as f:
        json.dump({"job": fence.job, "epoch": fence.epoch}, f)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(f.name, 0o644)  # readable by whoever reads the run, as the event files are
    os.replace(f.name, Path(directory) / FENCE)


class _DirectoryLock:
    """`writer.lock`, flock'd: held per open file, so two writers in one process exclude
    each other too; released by the kernel when its holder dies."""

    def __init__(self, directory: Path):
        self._fd = os.open(Path(directory) / LOCK, os.O_RDWR | os.O_CREAT, 0o644)

    @contextlib.contextmanager
    def held(self, wait_s: float) -> Iterator[bool]:
        """Yields whether the lock was got within `wait_s` (0: one try)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.05)
        try:
            yield True
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._fd)


# ------------------------------------------------------------- reading back
def job_key(job: str) -> str:
    """The short name of a job in its writers' file names."""
    return hashlib.sha256(job.encode()).hexdigest()[:12]


def event_files(directory: Path) -> list[Path]:
    """The directory's event files, in TensorBoard's order (by name)."""
    return sorted(p for p in Path(directory).iterdir() if EVENTS in p.name and p.is_file())


def job_of_file(path: Path) -> str | None:
    """The job key of a Planaria writer's event file; None for another program's."""
    found = _FILE_OF_JOB.search(Path(path).name)
    return None if found is None else found[1]


@dataclass
class Written:
    """What the event files of a directory hold (`read_back`)."""

    last_step: int = -1
    last_time: float | None = None
    """The wall time of the newest step's event."""
    epochs: dict[str, int] = field(default_factory=dict)
    """Job key -> the newest epoch change written by that job's writers."""


def read_back(directory: Path) -> Written:
    """The newest step and each job's newest epoch change in the directory's event files,
    read with TensorBoard's own reader (a truncated last record is skipped, as
    TensorBoard skips it)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    found = Written()
    for path in event_files(directory):
        job = job_of_file(path)
        for event in EventFileLoader(str(path)).Load():
            values = {v.tag: v for v in event.summary.value}
            if LOSS in values and event.step > found.last_step:
                found.last_step, found.last_time = event.step, event.wall_time
            if EPOCH in values and job is not None:
                epoch = int(tensor_util.make_ndarray(values[EPOCH].tensor).item())
                found.epochs[job] = max(found.epochs.get(job, -1), epoch)
    return found


# ------------------------------------------------------------------ writing
class RunWriter:
    """The metrics writer of one job's epoch (a plain job: its one epoch), in the plan's
    rank 0. It takes over the directory at its first write (module docstring, the rule)."""

    def __init__(self, directory: Path, *, job: str, epoch: int, fresh: bool,
                 history: History | None = None, wandb: "WandbRun | None" = None,
                 log: Callable[[str], None] = print):
        """`job`: the same for every process of a job and its restarts (a run id); `fresh`:
        the job starts from nothing (no step committed before this writer's first), so
        event files of another job in the directory are an earlier run's, and are removed
        (as metrics.jsonl is started anew)."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fence = Fence(job, epoch)
        self.fresh, self.history, self.wandb, self.log = fresh, history, wandb, log
        self._lock = _DirectoryLock(self.directory)
        self._pending: list[StepMetrics | EpochChange] = []
        self._events = None
        """The SummaryWriter of this writer's event file, once it took over."""
        self._last_step, self._last_epoch, self._last_time = -1, -1, None
        self.stopped: str | None = None
        """Why this writer writes nothing more (another took over, or the directory failed it)."""

    @property
    def pending_steps(self) -> list[int]:
        return [m.step for m in self._pending if isinstance(m, StepMetrics)]

    def commit(self, metrics: StepMetrics, change: EpochChange | None = None) -> None:
        """A committed step (and, with its epoch's first, the epoch's change): written now
        if the lock is free, else with a later step."""
        if self.stopped is None:
            self._pending += [change, metrics] if change is not None else [metrics]
            self.flush()

    def flush(self, wait_s: float = 0.0) -> bool:
        """Write what is pending, waiting up to `wait_s` for the lock; True when nothing is
        left to write (written, or never to be: this writer stopped)."""
        if self.stopped is not None or not self._pending:
            return True
        try:
            with self._lock.held(wait_s) as held:
                if not held:
                    return False
                if self._in_force():
                    self._write()
        except (OSError, ValueError) as err:  # the directory failed us: training goes on without it
            self._stop(f"writing metrics to {self.directory} failed: {err}")
        return True

    def close(self, wait_s: float = 0.0) -> None:
        """Write what is pending (waiting up to `wait_s` for the lock), then close the file."""
        if not self.flush(wait_s):
            self.log(f"metrics: steps {self.pending_steps} not written to {self.directory}: its lock "
                     f"was held for {wait_s:.0f} s (a frozen writer?); left to the next writer, if any")
        if self._events is not None:
            self._events.close()
            self._events = None
        self._lock.close()

    # ------------------------------------------------------------ internals
    def _in_force(self) -> bool:
        """Under the lock: whether this writer may write, taking over when it may."""
        fence = read_fence(self.directory)
        if self._events is not None:
            if fence != self.fence:
                self._stop(f"the metrics writer of epoch {fence.epoch if fence else '?'} took over")
            return fence == self.fence
        if fence is not None and fence.job == self.fence.job and fence.epoch > self.fence.epoch:
            self._stop(f"the metrics writer of epoch {fence.epoch} is in force")
            return False
        self._take_over(fence)
        return True

    def _take_over(self, fence: Fence | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        key = job_key(self.fence.job)
        if self.fresh and (fence is None or fence.job != self.fence.job):
            for path in event_files(self.directory):
                if job_of_file(path) != key:
                    path.unlink()
        written = read_back(self.directory)
        write_fence(self.directory, self.fence)
        self._last_step, self._last_time = written.last_step, written.last_time
        self._last_epoch = written.epochs.get(key, -1)
        self._events = SummaryWriter(str(self.directory), flush_secs=3600,
                                     filename_suffix=f".planaria-{key}-e{self.fence.epoch}")
        first = min(self.pending_steps)
        if self.history is not None:
            steps, changes = self.history(self._last_step, first, self._last_epoch)
            # The steps before this writer's own first: its epoch change's pause counts from them.
            self._pending = [*steps, *changes, *self._pending]

    def _write(self) -> None:
        written: list[StepMetrics | EpochChange] = []
        for item in self._pending:
            if isinstance(item, StepMetrics):
                if item.step <= self._last_step:
                    continue  # committed again after a rollback: written once, with equal values
                self._add(item.step, item.time, item.scalars())
                self._last_step, self._last_time = item.step, item.time
            else:
                if item.epoch <= self._last_epoch:
                    continue
                if item.epoch == self.fence.epoch and item.reason != "start" and self._last_time is not None:
                    item = replace(item, pause_s=max(0.0, item.time - self._last_time))
                self._add(item.step, item.time, item.scalars(), text=item.describe())
                self._last_epoch = item.epoch
            written.append(item)
        self._events.flush()  # in the kernel before the lock is released (NFS: flushed at unlock)
        self._pending = []
        if self.wandb is not None:
            self._send_to_wandb(written)

    def _add(self, step: int, wall_time: float, scalars: dict[str, float], text: str | None = None) -> None:
        """One event holding every value of a step: readers see all of it or none."""
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.text.summary_v2 import text_pb
        from torch.utils.tensorboard.summary import scalar

        values = [v for tag, x in scalars.items()
                  for v in scalar(tag, float(x), new_style=True, double_precision=True).value]
        if text is not None:
            values += text_pb(EVENT, text).value
        self._events.file_writer.add_summary(Summary(value=values), step, wall_time)

    def _send_to_wandb(self, items: list[StepMetrics | EpochChange]) -> None:
        try:
            for item in items:
                text = item.describe() if isinstance(item, EpochChange) else None
                self.wandb.log(item.step, item.scalars(), text)
        except Exception as err:  # W&B's own failures (network, service) must not end training
            self.log(f"metrics: W&B failed ({type(err).__name__}: {err}); going on with TensorBoard only")
            self.wandb = None

    def _stop(self, why: str) -> None:
        self.stopped = why
        self.log(f"metrics: this writer (epoch {self.fence.epoch}) stops: {why}"
                 + (f"; steps {self.pending_steps} left to it" if self.pending_steps else ""))
        self._pending = []


# ------------------------------------------------------------------ W&B
class WandbRun:
    """One process's handle on the job's W&B run: every writer of the job resumes the same
    run id. wandb is imported, and the run started, at the first write."""

    def __init__(self, cfg: "WandbConfig", *, job: str, directory: Path, config: dict | None = None):
        self.cfg, self.job, self.directory, self.config = cfg, job, Path(directory), config
        self._run = None
        self._step = -1

    def log(self, step: int, scalars: dict[str, float], text: str | None = None) -> None:
        if self._run is None:
            self._run = self._start()
        data = dict(scalars) | ({EVENT: text} if text is not None else {})
        # W&B's steps only go up: an epoch change at a step written before (a rollback's
        # first) goes in at the newest one.
        self._step = max(step, self._step)
        self._run.log(data, step=self._step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None

    def _start(self):
        try:
            import wandb
        except ImportError:
            raise RuntimeError("logging.wandb.enabled needs the wandb package: pip install wandb "
                               "(or set logging.wandb.enabled=false)") from None
        self.directory.mkdir(parents=True, exist_ok=True)
        c = self.cfg
        return wandb.init(project=c.project, entity=c.entity or None, name=c.name or None, mode=c.mode,
                          id=c.id or f"planaria-{job_key(self.job)}", resume="allow", dir=str(self.directory),
                          config=self.config)
