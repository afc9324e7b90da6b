"""Checkpoint and model directories as files: names, manifests, what is complete, pruning.

Free of torch: the control plane (a node's agent, which never computes) writes the
manifests and prunes old checkpoints, and must not spend seconds importing torch for
that. The tensors themselves are written and read by `planaria.runtime.checkpoint`
(the final model) and `planaria.runtime.checkpointing` (training checkpoints).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from planaria.runtime.exactly_once import CommitRecord

MANIFEST = "manifest.json"


def shard_filename(layer: int, tp_rank: int) -> str:
    return f"layer{layer:04d}-tp{tp_rank}.pt"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def step_dir(directory: Path, iteration: int) -> Path:
    return Path(directory) / f"step-{iteration:08d}"


def write_manifest(directory: Path, commit: CommitRecord, num_layers: int, tp: int) -> Path:
    target = step_dir(directory, commit.iteration)
    manifest = {"iteration": commit.iteration, "loss": commit.loss, "grad_norm": commit.grad_norm,
                "num_layers": num_layers, "tp": tp}
    atomic_write_bytes(target / MANIFEST, json.dumps(manifest, indent=1).encode())
    return target


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(iteration, directory) of every checkpoint with a manifest, oldest first."""
    found = []
    for path in Path(directory).glob("step-*"):
        if (path / MANIFEST).is_file():
            found.append((json.loads((path / MANIFEST).read_text())["iteration"], path))
    return sorted(found)


def read_manifest(path: Path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


def prune(directory: Path, keep: int, *, after: int | None = None) -> None:
    """Keep the newest `keep` complete checkpoints; with `after`, also delete every
    checkpoint, complete or not, of a later iteration (the job went back before it)."""
    complete = complete_checkpoints(directory)
    doomed = [path for _, path in complete[:-keep]] if len(complete) > keep else []
    if after is not None:
        doomed += [p for p in Path(directory).glob("step-*") if int(p.name.split("-")[1]) > after]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
