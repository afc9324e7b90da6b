"""The per-worker JSON lines logs an elastic job writes into its output directory, by
name, and their reader: `commits-<worker>.jsonl` (one line per committed step) and
`evals-<worker>.jsonl` (one line per validation loss).

`planaria.runtime.elastic_worker` writes them; the chaos harness and its report read
them. Free of torch, so that reading a finished run's logs does not import it.
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["COMMITS", "EVALS", "log_path", "log_paths", "read_logs"]

COMMITS = "commits"
EVALS = "evals"


def log_path(out_dir: Path, kind: str, worker: str) -> Path:
    """The log of one worker (`kind`: COMMITS or EVALS)."""
    return Path(out_dir) / f"{kind}-{worker}.jsonl"


def log_paths(out_dir: Path, kind: str) -> list[Path]:
    """Every worker's log of one kind, sorted by name."""
    return sorted(Path(out_dir).glob(f"{kind}-*.jsonl"))


def read_logs(out_dir: Path, kind: str) -> dict[str, list[dict]]:
    """Each worker's records of one kind, in the order it wrote them, by worker name."""
    logs = {}
    for path in log_paths(out_dir, kind):
        lines = path.read_text().splitlines()
        logs[path.stem.removeprefix(f"{kind}-")] = [json.loads(line) for line in lines if line.strip()]
    return logs
