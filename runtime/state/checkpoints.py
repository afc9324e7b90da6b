"""Periodic training checkpoints: the fallback when a layer loses every replica (docs/recovery.md).

Layout: CHECKPOINT_DIR/step-<iteration>/epoch-<e>/layer<L>-tp<T>.pt, one file per (layer,
tp rank) holding the shard's parameters and AdamW state after that iteration's step,
written by the shard's owner replica only (the first rank of its replica group) of the
epoch e that committed the step, plus a `manifest.json` in step-<iteration>/ written
last, by the control plane, once every shard's file of that epoch is complete. A
directory without a manifest is never read, and a manifest names one epoch's files: a
worker that writes after the job went on without it writes beside them
(`checkpoint_layout.epoch_dir`). A plain job's checkpoint (`save_checkpoint`) keeps its
files beside its manifest.

Workers write in the background (`AsyncCheckpointer`): at the step, the shard is
copied to CPU memory (cheap), and a thread writes the files (temporary name, then
rename) while training goes on. When a worker's files of a checkpoint are on disk, the
thread adds their count to `checkpoint/<iteration>/<epoch>/shards` in the job's store; the control
plane writes the manifest when the count reaches the number of shards, and prunes old
checkpoints (`planaria.runtime.contract.checkpoint_layout`). Loading uses
`torch.load(weights_only=True)`: tensors only, no arbitrary pickle.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from planaria.runtime.contract.checkpoint_layout import (epoch_dir, prune, shard_filename, step_dir,
                                                         write_manifest, write_model_record)
from planaria.runtime.contract.exactly_once import CommitRecord
from planaria.runtime.parallel.optim import empty_adam_state
from planaria.runtime.state.saved_model import _atomic_torch_save, read_shard_file

if TYPE_CHECKING:
    from planaria.runtime.parallel.engine import Engine, LayerState

def snapshot_layer(state: "LayerState") -> dict[str, torch.Tensor]:
    """The shard's parameters and optimizer state, copied to CPU, as a flat dict of tensors."""
    out = {}
    for name, param in state.module.named_parameters():
        out[f"param/{name}"] = param.detach().to("cpu", copy=True)
        for key, value in state.optimizer.state.get(param, {}).items():
            out[f"{key}/{name}"] = value.detach().to("cpu", copy=True)
    return out


def load_layer(state: "LayerState", tensors: dict[str, torch.Tensor]) -> None:
    """Put a snapshot back into a freshly built shard (parameters and AdamW state)."""
    with torch.no_grad():
        for name, param in state.module.named_parameters():
            param.copy_(tensors[f"param/{name}"])
            if f"step/{name}" not in tensors:
                continue  # saved before the first step: AdamW has no state yet
            moments = empty_adam_state(state.optimizer, param)  # each where AdamW keeps it
            for key, target in moments.items():
                target.copy_(tensors[f"{key}/{name}"])
            state.optimizer.state[param] = moments


def read_layer(directory: Path, layer: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """A checkpoint shard's snapshot (`snapshot_layer`): parameters and AdamW state."""
    return read_shard_file(directory, layer, tp_rank)


class AsyncCheckpointer:
    """A worker's side: snapshot at the step, then write and report in a background thread.

    The report goes to the job's store from the writing thread (the store client is
    thread-safe), so a checkpoint counts as soon as its files are on disk, even if this
    worker fails right after."""

    def __init__(self, directory: Path, every: int,
                 report: Callable[[int, int, int, CommitRecord], None], data_source: str = ""):
        self.directory = Path(directory)
        self.data_source = data_source  # recorded with the model config: export finds the tokenizer
        self.every = every
        self.report = report
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending: list[Future] = []

    def after_step(self, engine: "Engine", epoch: int) -> None:
        """Call after each committed step, with the epoch that committed it."""
        still = []
        for future in self._pending:
            if future.done():
                future.result()  # a failed write raises here, in the training thread
            else:
                still.append(future)
        self._pending = still
        iteration = engine.last_stepped
        if not self.every or (iteration + 1) % self.every:
            return
        shards = {(layer, engine.tp.rank): snapshot_layer(engine.shard(layer))
                  for layer in engine.owned_shards()}
        self._pending.append(self._pool.submit(self._write, iteration, epoch, shards, engine.last_commit,
                                               asdict(engine.model.cfg)))

    def write_now(self, iteration: int, epoch: int, shards, commit: CommitRecord, engine: "Engine") -> None:
        """Write and report `shards` at once, in this thread (the fencing test's late writer)."""
        self._write(iteration, epoch, shards, commit, asdict(engine.model.cfg))

    def flush(self) -> None:
        """Wait for every write (end of training); a failed write raises here."""
        for future in self._pending:
            future.result()
        self._pending = []

    def _write(self, iteration: int, epoch: int, shards, commit: CommitRecord, model: dict) -> None:
        target = epoch_dir(self.directory, iteration, epoch)
        target.mkdir(parents=True, exist_ok=True)
        for (layer, tp_rank), tensors in shards.items():
            _atomic_torch_save(tensors, target / shard_filename(layer, tp_rank))
        # Every writer, the same content (the model's config), beside the manifest.
        write_model_record(step_dir(self.directory, iteration), model, self.data_source)
        self.report(iteration, epoch, len(shards), commit)


def save_checkpoint(engine: "Engine", directory: Path, keep: int, data_source: str = "") -> Path:
    """Save the checkpoint of the engine's last step at once (collective over its world):
    every owner writes its shards, a barrier, then rank 0 writes the manifest and prunes.
    For the non-elastic trainer, which has no control plane to finish a checkpoint."""
    target = step_dir(directory, engine.last_stepped)
    target.mkdir(parents=True, exist_ok=True)
    for layer in engine.owned_shards():
        _atomic_torch_save(snapshot_layer(engine.shard(layer)), target / shard_filename(layer, engine.tp.rank))
    dist.barrier(group=engine.groups.world)
    if engine.rank == 0:
        write_model_record(target, asdict(engine.model.cfg), data_source)
        write_manifest(directory, engine.last_commit, engine.plan.num_layers, engine.plan.tp)
        prune(directory, keep)
    return target
