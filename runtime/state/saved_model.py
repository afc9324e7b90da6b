"""A saved model (a final save, or the parameters of a checkpoint): written one file per
(layer, tp rank) by one owner replica, manifest last; read whole (export, init, tests).

Training checkpoints, which add the optimizer state and are written in the background,
are `planaria.runtime.state.checkpoints`'s; the names of the files and manifests are the
contract's (`planaria.runtime.contract.checkpoint_layout`).

The manifest is written only after every shard file is complete (and every file is
written to a temporary name, made durable, then renamed), so a directory without a
manifest is an incomplete save and is never read, even after a power cut. Files hold
plain tensors and are loaded with `weights_only=True`: no arbitrary pickle is ever
executed.
"""
from __future__ import annotations

import json
import pickle
from dataclasses import asdict, fields
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from planaria.runtime.config.sections import ConfigError, ModelConfig
from planaria.runtime.contract.checkpoint_layout import (MANIFEST, atomic_write, atomic_write_bytes, read_manifest, shard_dir,
                                               read_model_record, shard_filename, write_model_record)
from planaria.runtime.models.llama import LayerModel


def _atomic_torch_save(obj, path: Path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def save_model_shards(engine, directory: Path, data_source: str = "") -> None:
    """Collective over the engine's world: every rank must call it. Beside the manifest,
    the model record (`write_model_record`: the model config and the training data's
    source, which `planaria export hf` reads)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tp_rank = engine.info.tp_rank
    for layer in engine.owned_shards():
        state = {k: v.detach().cpu() for k, v in engine.shard(layer).module.state_dict().items()}
        _atomic_torch_save(state, directory / shard_filename(layer, tp_rank))
    dist.barrier(group=engine.groups.world)
    if engine.rank == 0:
        shard_dims = {str(i): engine.model.shard_dims(i) for i in range(engine.plan.num_layers)}
        # Tied embeddings: both copies are saved (bit-identical); readers such as an
        # exporter learn from "tied" that they are one weight.
        write_model_record(directory, asdict(engine.model.cfg), data_source)
        manifest = {"num_layers": engine.plan.num_layers, "tp": engine.plan.tp,
                    "shard_dims": shard_dims,
                    "tied": [list(t) for t in engine.model.tied_parameters()]}
        atomic_write_bytes(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
    dist.barrier(group=engine.groups.world)


def read_shard_file(directory: Path, layer: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """The tensors of one (layer, tp rank) file of a final save or a checkpoint."""
    path = shard_dir(directory) / shard_filename(layer, tp_rank)
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: the save is incomplete") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        raise ValueError(f"{path} is not a readable shard file ({str(err).splitlines()[0]}); "
                         "the save is damaged: use another checkpoint") from None


def full_layers(directory: Path, model: LayerModel, tp: int) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(index, full parameters by name) of every layer of a final save or a checkpoint,
    one layer at a time, reassembled from the tp pieces by `model.unshard` (a
    checkpoint's AdamW state is left out)."""
    for index in range(model.num_layers):
        pieces = [_parameters(read_shard_file(directory, index, t)) for t in range(tp)]
        yield index, {name: model.unshard(index, name, [p[name] for p in pieces]) for name in pieces[0]}


def _parameters(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not any(key.startswith("param/") for key in tensors):
        return tensors  # a final save: parameters only
    return {key.removeprefix("param/"): value for key, value in tensors.items() if key.startswith("param/")}


def load_full_model(directory: Path, model: LayerModel | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """Every layer's full (un-sharded) tensors, reassembled from the tp shards by
    `LayerModel.unshard` of `model`, or of the model section the save recorded."""
    directory = Path(directory)
    if not (directory / MANIFEST).is_file():
        raise FileNotFoundError(f"{directory} has no {MANIFEST}: the save is missing or incomplete")
    manifest = read_manifest(directory)
    if model is None:
        model = LayerModel(recorded_model(read_model_record(directory)["model"], directory, manifest["tp"]), seed=0)
    return dict(full_layers(directory, model, manifest["tp"]))


def recorded_model(record: dict | None, directory: Path, tp: int) -> ModelConfig:
    """The ModelConfig of a save's recorded model section (`read_model_record`)."""
    if record is None:
        # Saved before saves recorded it, when every model was multi-head: as many
        # heads as tp ranks makes `unshard` join the key/value pieces as they were split.
        return ModelConfig(n_heads=tp)
    unknown = sorted(set(record) - {f.name for f in fields(ModelConfig)})
    if unknown:
        raise ConfigError(f"{directory} records model keys {unknown} that this version of Planaria "
                          "does not know; load it with the version that saved it")
    return ModelConfig(**record)
