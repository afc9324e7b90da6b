"""Checkpoint and model directories as files: names, manifests, what is complete, pruning.

Part of the contract because the control plane (a node's agent, which never computes)
writes the checkpoints' manifests and prunes old checkpoints, while the workers write
the shard files. The tensors themselves are written and read by the runtime's
`planaria.runtime.state.saved_model`.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import BinaryIO, Callable

from dataclasses import dataclass

from planaria.runtime.contract.exactly_once import CommitRecord
from planaria.runtime.contract.record import JsonRecord, RecordError

MANIFEST = "manifest.json"
MODEL_RECORD = "model.json"
"""Beside the shards of a final save and of a checkpoint: {"model": the `model` config
section it was trained with, "data_source": the training data's `data.source`}, which
`planaria export hf` rebuilds the model from and finds the tokenizer by."""


def write_model_record(directory: Path, model: dict, data_source: str = "") -> None:
    if data_source and Path(data_source).exists():  # a path: kept valid for a later export elsewhere
        data_source = str(Path(data_source).resolve())
    record = {"model": model, "data_source": data_source}
    atomic_write_bytes(Path(directory) / MODEL_RECORD, json.dumps(record, indent=1).encode())


def read_model_record(directory: Path) -> dict:
    """{"model": the model section or None, "data_source": str} of a save. Final saves
    from before `MODEL_RECORD` kept both in their manifest; older ones neither."""
    directory = Path(directory)
    if (directory / MODEL_RECORD).is_file():
        record = read_json(directory / MODEL_RECORD)
        if "model" not in record:  # a checkpoint's bare model section, before the data source was kept
            record = {"model": record}
    else:
        record = read_manifest(directory)
    return {"model": record.get("model"), "data_source": record.get("data_source") or ""}


def read_json(path: Path) -> dict:
    """A JSON object file; a ValueError naming the file when it is not one."""
    try:
        value = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); the save is damaged") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object; the save is damaged")
    return value


def shard_filename(layer: int, tp_rank: int) -> str:
    return f"layer{layer:04d}-tp{tp_rank}.pt"


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """`write` into a temporary file beside `path`, on disk (fsync), then renamed over
    `path` and the rename itself made durable (fsync of the directory). A reader sees the
    old file or the whole new one; and a manifest written after a shard's atomic_write
    can never name a shard that a power cut leaves empty."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """Make a file's contents, or a directory's entries, durable (fsync by path)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_rename_dir(tmp: Path, path: Path) -> None:
    """Rename the finished directory `tmp` to `path`, durably: every file in it and the
    directory itself on disk first, the rename after, so that after a power cut `path`
    is absent or whole (never present with empty files). `path` may be an empty directory."""
    tmp, path = Path(tmp), Path(path)
    for file in tmp.rglob("*"):
        fsync_path(file)
    fsync_path(tmp)
    if path.exists():
        path.rmdir()
    os.replace(tmp, path)
    fsync_path(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def step_dir(directory: Path, iteration: int) -> Path:
    return Path(directory) / f"step-{iteration:08d}"


def epoch_dir(directory: Path, iteration: int, epoch: int) -> Path:
    """Where the workers of `epoch` write their shards of the checkpoint of `iteration`.

    The fence of a checkpoint (docs/recovery.md, "Fencing"): a worker writes only under
    the epoch that committed the step it saves, and the manifest names one epoch. A
    worker the job went on without (cut off, its lease expired) may still write, late;
    its files land beside the epoch's, never among them, and nothing reads them."""
    return step_dir(directory, iteration) / f"epoch-{epoch}"


def shard_dir(path: Path) -> Path:
    """The directory of a save's shard files: a checkpoint's manifest names the epoch
    whose workers wrote them (`epoch_dir`); a final save or a plain job's checkpoint
    holds them itself."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        epoch = read_manifest(path).get("epoch")
        if isinstance(epoch, int):
            return path / f"epoch-{epoch}"
    return path


def missing_shards(directory: Path, num_layers: int, tp: int) -> list[str]:
    """The shard files of a checkpoint or model directory that are not there (yet)."""
    return [name for name in (shard_filename(layer, t) for layer in range(num_layers) for t in range(tp))
            if not (Path(directory) / name).is_file()]


@dataclass(frozen=True)
class CheckpointManifest(JsonRecord):
    """A complete training checkpoint: written last, by the control plane (or rank 0 of a
    plain job), once every shard file is on disk."""

    iteration: int
    """The last step the checkpoint's state has taken."""
    loss: float
    grad_norm: float
    num_layers: int
    tp: int
    epoch: int | None = None
    """The epoch whose workers wrote the shards (under `epoch_dir`); None: beside the
    manifest (a plain job's checkpoint)."""

    @property
    def commit(self) -> CommitRecord:
        return CommitRecord(self.iteration, self.loss, self.grad_norm)


def write_manifest(directory: Path, commit: CommitRecord, num_layers: int, tp: int,
                   epoch: int | None = None) -> Path:
    """Complete the checkpoint of `commit.iteration`: its manifest, naming the shards of
    `epoch` (None: those beside it). Shards other epochs' workers left there are removed."""
    target = step_dir(directory, commit.iteration)
    manifest = CheckpointManifest(commit.iteration, commit.loss, commit.grad_norm, num_layers, tp, epoch)
    atomic_write_bytes(target / MANIFEST, json.dumps(manifest.to_dict(), indent=1).encode())
    if epoch is not None:
        for other in target.glob("epoch-*"):
            if other.name != f"epoch-{epoch}":
                shutil.rmtree(other, ignore_errors=True)
    return target


def read_checkpoint_manifest(path: Path) -> CheckpointManifest:
    """The manifest of the checkpoint directory `path`; a ValueError naming the file
    when it is not one."""
    try:
        return CheckpointManifest.from_dict(read_manifest(path))
    except RecordError as err:
        raise ValueError(f"{Path(path) / MANIFEST} is not a checkpoint's manifest ({err})") from None


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(iteration, directory) of every checkpoint with a manifest, oldest first."""
    found = []
    for path in Path(directory).glob("step-*"):
        if (path / MANIFEST).is_file():
            found.append((read_checkpoint_manifest(path).iteration, path))
    return sorted(found)


def read_manifest(path: Path) -> dict:
    return read_json(Path(path) / MANIFEST)


def prune(directory: Path, keep: int, *, after: int | None = None) -> None:
    """Keep the newest `keep` complete checkpoints; with `after`, also delete every
    checkpoint, complete or not, of a later iteration (the job went back before it)."""
    complete = complete_checkpoints(directory)
    doomed = [path for _, path in complete[:-keep]] if len(complete) > keep else []
    if after is not None:
        doomed += [p for p in Path(directory).glob("step-*") if int(p.name.split("-")[1]) > after]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
