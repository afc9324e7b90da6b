"""Model state on disk: one file per (layer, tp rank), written by one owner replica, manifest last.

The manifest is written only after every shard file is complete (and every file is
written to a temporary name, made durable, then renamed), so a directory without a
manifest is an incomplete save and is never read, even after a power cut. Files hold
plain tensors and are loaded with `weights_only=True`: no arbitrary pickle is ever
executed.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from planaria.runtime.checkpoint_files import MANIFEST, atomic_write, atomic_write_bytes, shard_filename
from planaria.runtime.config import ModelConfig
from planaria.runtime.model import LayerModel


def _atomic_torch_save(obj, path: Path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def save_model_shards(engine, directory: Path, data_source: str = "") -> None:
    """Collective over the engine's world: every rank must call it. The manifest records
    the model config and the training data's source (`planaria export hf` reads them)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tp_rank = engine.info.tp_rank
    for layer in engine.owned_shards():
        state = {k: v.detach().cpu() for k, v in engine.layers[layer].module.state_dict().items()}
        _atomic_torch_save(state, directory / shard_filename(layer, tp_rank))
    dist.barrier(group=engine.groups.world)
    if engine.rank == 0:
        if data_source and Path(data_source).exists():  # a path: kept valid for a later export elsewhere
            data_source = str(Path(data_source).resolve())
        shard_dims = {str(i): engine.model.shard_dims(i) for i in range(engine.plan.num_layers)}
        # The model section too: reassembling the tp pieces needs its key/value heads.
        # Tied embeddings: both copies are saved (bit-identical); readers such as an
        # exporter learn from "tied" that they are one weight.
        manifest = {"num_layers": engine.plan.num_layers, "tp": engine.plan.tp,
                    "shard_dims": shard_dims, "model": asdict(engine.model.cfg),
                    "data_source": data_source,
                    "tied": [list(t) for t in engine.model.tied_parameters()]}
        atomic_write_bytes(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
    dist.barrier(group=engine.groups.world)


def load_full_model(directory: Path, model: LayerModel | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """Every layer's full (un-sharded) tensors, reassembled from the tp shards by
    `LayerModel.unshard` of `model`, or of the model section the save recorded."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{directory} has no {MANIFEST}: the save is missing or incomplete")
    manifest = json.loads(manifest_path.read_text())
    if model is None:
        model = LayerModel(_recorded_model(manifest, directory), seed=0)
    layers = {}
    for layer in range(manifest["num_layers"]):
        shards = [torch.load(directory / shard_filename(layer, t), weights_only=True)
                  for t in range(manifest["tp"])]
        layers[layer] = {name: model.unshard(layer, name, [s[name] for s in shards]) for name in shards[0]}
    return layers


def _recorded_model(manifest: dict, directory: Path) -> ModelConfig:
    if "model" not in manifest:
        # Saved before manifests recorded it, when every model was multi-head: as many
        # heads as tp ranks makes `unshard` join the key/value pieces as they were split.
        return ModelConfig(n_heads=manifest["tp"])
    try:
        return ModelConfig(**manifest["model"])
    except TypeError as err:
        raise ValueError(f"{directory / MANIFEST}: its model section does not fit this version of "
                         f"Planaria ({err}); load it with the version that saved it") from None
