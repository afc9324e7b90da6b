"""Model state on disk: one file per (layer, tp rank), written by one owner replica, manifest last.

The manifest is written only after every shard file is complete (and every file is
written to a temporary name, made durable, then renamed), so a directory without a
manifest is an incomplete save and is never read, even after a power cut. Files hold
plain tensors and are loaded with `weights_only=True`: no arbitrary pickle is ever
executed.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from planaria.runtime.checkpoint_files import MANIFEST, atomic_write, atomic_write_bytes, shard_filename


def _atomic_torch_save(obj, path: Path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def save_model_shards(engine, directory: Path) -> None:
    """Collective over the engine's world: every rank must call it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tp_rank = engine.info.tp_rank
    for layer in engine.owned_shards():
        state = {k: v.detach().cpu() for k, v in engine.layers[layer].module.state_dict().items()}
        _atomic_torch_save(state, directory / shard_filename(layer, tp_rank))
    dist.barrier(group=engine.groups.world)
    if engine.rank == 0:
        shard_dims = {str(i): engine.model.shard_dims(i) for i in range(engine.plan.num_layers)}
        # Tied embeddings: both copies are saved (bit-identical); readers such as an
        # exporter learn here that they are one weight.
        manifest = {"num_layers": engine.plan.num_layers, "tp": engine.plan.tp,
                    "shard_dims": shard_dims, "tied": [list(t) for t in engine.model.tied_parameters()]}
        atomic_write_bytes(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
    dist.barrier(group=engine.groups.world)


def load_full_model(directory: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Every layer's full (un-sharded) tensors, reassembled from the tp shards."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{directory} has no {MANIFEST}: the save is missing or incomplete")
    manifest = json.loads(manifest_path.read_text())
    layers = {}
    for layer in range(manifest["num_layers"]):
        shards = [torch.load(directory / shard_filename(layer, t), weights_only=True)
                  for t in range(manifest["tp"])]
        dims = manifest["shard_dims"][str(layer)]
        layers[layer] = {name: torch.cat([s[name] for s in shards], dim=dims[name]) if name in dims
                         else shards[0][name] for name in shards[0]}
    return layers
