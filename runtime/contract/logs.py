"""The JSON lines logs a job writes, their records, and their reader.

- `metrics.jsonl` (`MetricsEntry`): one line per step, written by rank 0 of a plain job;
- `commits-<worker>.jsonl` (`CommitEntry`): one line per step an elastic worker
  committed (or rolled forward);
- `evals-<worker>.jsonl` (`EvalEntry`): one line per validation loss of an elastic job;
- `audit-<worker>.jsonl` (`AuditEntry`): one line per replica mismatch found.

One vocabulary in every log: `step` is the 0-based index of an optimizer step (the
plan contract's "iteration"); progress lines print it 1-based, as "step k/n". Logs of
earlier versions wrote `iteration` in commits, evals and audits: they are read still.

`error_line` says an error in one line, as every log line and timing record does.

The elastic worker and the trainer write them; the chaos harness and its report read
them. Free of torch, so that reading a finished run's logs does not import it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

from planaria.runtime.contract.record import JsonRecord, RecordError

def error_line(err: BaseException, limit: int = 200) -> str:
    """`err`'s first line, at most `limit` characters; its type's name when it says
    nothing (a bare `TimeoutError()`)."""
    text = str(err)
    return text.splitlines()[0][:limit] if text.strip() else type(err).__name__


COMMITS = "commits"
EVALS = "evals"
AUDIT = "audit"
METRICS = "metrics.jsonl"

E = TypeVar("E", bound=JsonRecord)


@dataclass(frozen=True)
class StepEntry(JsonRecord):
    """What every line of a log is about: the step (logs of earlier versions said iteration)."""

    renamed = {"iteration": "step"}
    step: int


@dataclass(frozen=True)
class MetricsEntry(StepEntry):
    """A step of a plain (torchrun) job, in metrics.jsonl."""

    loss: float
    grad_norm: float
    lr: float
    tokens: int
    step_time_s: float
    time: float
    val_loss: float | None = None


@dataclass(frozen=True)
class EpochStep(StepEntry):
    """What every line of an elastic worker's logs says besides the step: the epoch it
    was written in, and when (seconds since the Unix epoch)."""

    epoch: int
    time: float


@dataclass(frozen=True)
class CommitEntry(EpochStep):
    """A step an elastic worker committed, or applied by rolling forward."""

    loss: float
    grad_norm: float
    rolled_forward: bool = False
    step_time_s: float | None = None
    """None for a rolled-forward step: it was not timed."""
    compiled_graphs: int | None = None
    """With `train.compile`: the graphs the worker's process had compiled by this commit
    (the same in every epoch when a reconfiguration recompiles nothing, but for those of
    its first evaluation, which runs without gradients); None without."""


@dataclass(frozen=True)
class EvalEntry(EpochStep):
    """The validation loss after a step: the mean loss of `eval.batches` fixed validation
    batches, forward only."""

    val_loss: float


@dataclass(frozen=True)
class Mismatch(JsonRecord):
    """Replicas of one (layer, tp rank) shard that disagreed at an audit."""

    layer: int
    tp_rank: int
    majority: tuple[int, ...]
    """Ranks holding the most common state (empty on a tie)."""
    minority: tuple[int, ...]
    """Ranks holding another state (every replica's rank on a tie)."""
    repaired: bool
    """The minority's state was overwritten from the majority's."""

    def describe(self) -> str:
        if not self.majority:
            return (f"layer {self.layer} (tp rank {self.tp_rank}): replicas on ranks "
                    f"{list(self.minority)} all differ; no majority to repair from")
        action = "repaired from the majority" if self.repaired else "not repaired (audit.repair=false)"
        return (f"layer {self.layer} (tp rank {self.tp_rank}): ranks {list(self.minority)} differ from "
                f"ranks {list(self.majority)}; {action}")


@dataclass(frozen=True)
class AuditEntry(Mismatch, StepEntry):
    """A mismatch the audit after a step found, in audit-<worker>.jsonl."""


def log_path(out_dir: Path, kind: str, worker: str) -> Path:
    """The log of one worker (`kind`: COMMITS, EVALS or AUDIT)."""
    return Path(out_dir) / f"{kind}-{worker}.jsonl"


def log_paths(out_dir: Path, kind: str) -> list[Path]:
    """Every worker's log of one kind, sorted by name."""
    return sorted(Path(out_dir).glob(f"{kind}-*.jsonl"))


def append(log: IO[str], entry: JsonRecord) -> None:
    """One complete line, flushed: a crash never leaves half a line."""
    log.write(entry.to_json() + "\n")
    log.flush()


def read_entries(path: Path, entry: type[E]) -> list[E]:
    """The records of one log file, in the order they were written; a bad line is an
    error naming the file and the line."""
    found = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                found.append(entry.from_json(line))
            except RecordError as err:
                raise RecordError(f"{path}:{number}: {err}") from None
    return found


def read_logs(out_dir: Path, kind: str, entry: type[E]) -> dict[str, list[E]]:
    """Each worker's records of one kind, in the order it wrote them, by worker name."""
    return {path.stem.removeprefix(f"{kind}-"): read_entries(path, entry) for path in log_paths(out_dir, kind)}
