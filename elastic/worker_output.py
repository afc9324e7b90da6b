"""Where a worker's stdout and stderr go: torchrun's `--redirects`, `--tee`,
`--local-ranks-filter` and `--log-dir`, for the workers an agent starts.

torchrun's layout (its `DefaultLogsSpecs`), which `planaria-run` reproduces:

    <log dir>/<run id>_<random>/attempt_<n>/<local rank>/stdout.log
                                                        /stderr.log
                                                        /error.json

- a redirected stream goes to its file only; a tee'd one to its file and to the
  console, each line prefixed `[<role><local rank>]:` (torchrun tails the file, as
  `Tail` does here);
- `--local-ranks-filter`: the console shows only those local ranks' output (a tee'd
  stream of another rank goes to its file only, an untouched one nowhere);
- attempt n is the number of times this node's workers were started again (torchrun's
  restart count, per node here: a Planaria job restarts nodes, not the whole job).

The local rank is the worker's index on its machine: with `--standalone` every worker
is a node with an agent of its own, and the launcher gives each agent its offset.
torchrun's parser of the `Std` values lives in a module that imports torch, which an
agent never loads, so `std_of` reads the same "3" / "0:1,1:2" form here.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable

OUT, ERR = 1, 2
"""torchrun's `Std` bits: 1 stdout, 2 stderr, 3 both."""

ROLE = "default"
"""torchrun's default role, the prefix of tee'd lines."""


def std_of(spec: str, local_rank: int) -> int:
    """torchrun's `Std` for `local_rank` from "N" (every rank) or "rank:N,rank:N"."""
    spec = (spec or "0").strip()
    try:
        if ":" not in spec:
            return _std(int(spec))
        per_rank = {int(r): _std(int(v)) for r, v in (item.split(":") for item in spec.split(","))}
    except ValueError:
        raise ValueError(f"{spec!r} is not a stream choice: 0-3, or local_rank:0-3 pairs such as 0:1,1:2") from None
    return per_rank.get(local_rank, 0)


def _std(value: int) -> int:
    if value not in (0, 1, 2, 3):
        raise ValueError(f"{value} is not a stream choice (0 none, 1 stdout, 2 stderr, 3 both)")
    return value


def ranks_filter(text: str) -> set[int] | None:
    """`--local-ranks-filter`'s "0,1,2"; None when empty (every rank shown)."""
    if not text:
        return None
    try:
        return {int(r) for r in text.split(",")}
    except ValueError:
        raise ValueError(f"--local-ranks-filter {text!r}: expected comma-separated local ranks, e.g. 0,1") from None


@dataclass(frozen=True)
class OutputSpec:
    """One agent's share of the machine's torchrun output options."""

    run_log_dir: Path
    """<log dir>/<run id>_<random>, shared by the agents of one machine."""
    redirects: str = "0"
    tee: str = "0"
    local_ranks: set[int] | None = None
    """`--local-ranks-filter`; None: every rank on the console."""
    rank_offset: int = 0
    """The machine-wide local rank of this agent's local worker 0."""


@dataclass
class WorkerStreams:
    """What `subprocess.Popen` gets for one worker, and the tails to start beside it."""

    stdout: IO | int | None
    stderr: IO | int | None
    error_file: Path
    tails: list[tuple[Path, IO]]


def open_streams(spec: OutputSpec, local: int, attempt: int) -> WorkerStreams:
    """Open the files of the agent's local worker `local` at restart `attempt`."""
    rank = spec.rank_offset + local
    directory = spec.run_log_dir / f"attempt_{attempt}" / str(rank)
    directory.mkdir(parents=True, exist_ok=True)
    tee = std_of(spec.tee, rank)
    written = std_of(spec.redirects, rank) | tee
    shown = spec.local_ranks is None or rank in spec.local_ranks
    streams, tails = [], []
    for bit, name, console in ((OUT, "stdout.log", sys.stdout), (ERR, "stderr.log", sys.stderr)):
        if written & bit:
            path = directory / name
            streams.append(open(path, "w", encoding="utf-8"))
            if tee & bit and shown:
                tails.append((path, console))
        else:  # the console (inherited), or nowhere for a rank the filter leaves out
            streams.append(None if shown else subprocess.DEVNULL)
    return WorkerStreams(streams[0], streams[1], directory / "error.json", tails)


class Tail(threading.Thread):
    """Copies the lines a worker writes to `path` onto `sink`, prefixed as torchrun's
    tee does, until `finished()` and the file is read to its end."""

    def __init__(self, path: Path, sink: IO, prefix: str, finished: Callable[[], bool], poll_s: float = 0.1):
        super().__init__(daemon=True, name=f"tail {path.name}")
        self.path, self.sink, self.prefix = path, sink, prefix
        self.finished, self.poll_s = finished, poll_s

    def run(self) -> None:
        with open(self.path, encoding="utf-8", errors="replace") as f:
            partial = ""
            while True:
                done = self.finished()  # asked before reading: nothing written after is missed
                chunk = f.read()
                lines = (partial + chunk).split("\n")
                partial = lines.pop()
                for line in lines:
                    self.sink.write(f"{self.prefix}{line}\n")
                if lines:
                    self.sink.flush()
                if done and not chunk:
                    break
                if not chunk:
                    time.sleep(self.poll_s)
            if partial:
                self.sink.write(f"{self.prefix}{partial}\n")
                self.sink.flush()


def start_tails(streams: WorkerStreams, rank: int, process: subprocess.Popen) -> list[Tail]:
    tails = [Tail(path, sink, f"[{ROLE}{rank}]:", lambda: process.poll() is not None)
             for path, sink in streams.tails]
    for tail in tails:
        tail.start()
    return tails


def close_files(streams: WorkerStreams) -> None:
    """The agent's copies of the worker's file handles (the worker keeps its own)."""
    for stream in (streams.stdout, streams.stderr):
        if hasattr(stream, "close"):
            stream.close()

