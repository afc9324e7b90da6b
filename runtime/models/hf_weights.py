"""Hugging Face LLaMA weights and Planaria's layers: the one place the mapping between
them is written down (docs/interop.md explains it with commands), and the reading of a
checkpoint's weights into a worker's layers (`model.init_from`).

config.json <-> `model.*` (coded in the torch-free half, `planaria.runtime.config.hf_config`,
with the tensor names and shapes):

    hidden_size -> d_model            num_hidden_layers -> n_layers
    num_attention_heads -> n_heads    num_key_value_heads -> n_kv_heads
    intermediate_size -> ffn_hidden   vocab_size -> vocab_size
    rms_norm_eps -> norm_eps          rope_theta (or rope_parameters) -> rope_theta
    rope_scaling -> rope_scaling      tie_word_embeddings -> tie_embeddings
    max_position_embeddings: not read (model.seq_len is the training length); written
    as the checkpoint's own when model.init_from still names one, else model.seq_len.

Tensors (HF name -> Planaria layer and parameter; layer 0 is the embedding, layers
1..n_layers the blocks, layer n_layers + 1 the head):

    model.embed_tokens.weight                       -> 0      embed.weight
    model.layers.{i}.input_layernorm.weight         -> i + 1  attn_norm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight-> i + 1  attn.w{q,k,v,o}.weight
    model.layers.{i}.post_attention_layernorm.weight-> i + 1  mlp_norm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight -> i + 1  mlp.w_{gate,up,down}.weight
    model.norm.weight                               -> last   norm.weight
    lm_head.weight                                  -> last   output.weight
    (with tie_word_embeddings: model.embed_tokens.weight -> last output.weight, and
     no lm_head.weight is written)

Rotary permutation. Planaria rotates interleaved pairs (x[2i], x[2i+1]) of a head by
angle i; Hugging Face rotates halves (x[i], x[i + head_dim/2]). The q and k projections
are therefore stored with their rows permuted within each head, as Hugging Face's
convert_llama_weights_to_hf does (its `permute`):

    hf = planaria.view(heads, head_dim // 2, 2, d_model).transpose(1, 2).reshape(rows, d_model)
    planaria = hf.view(heads, 2, head_dim // 2, d_model).transpose(1, 2).reshape(rows, d_model)

with heads = n_heads for q and n_kv_heads for k (v and o are not permuted: attention
scores are invariant to one permutation applied to both q and k).

Reading (`model.init_from`): each worker reads only its own layers' tensors, and of
those only its tp shard (safetensors `get_slice`), which `LayerModel.shard` defines.
Writing (`planaria.runtime.state.hf_export`): the tp shards of a final save or a
checkpoint are joined with `LayerModel.unshard`. Neither side shards or joins tensors by
a rule of its own.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from planaria.runtime.config.hf_config import (SAFETENSORS, SAFETENSORS_INDEX, check_shape, full_shape, hf_name,
                                               read_weight_map)
from planaria.runtime.config.sections import ConfigError, ModelConfig
from planaria.runtime.models.llama import LayerModel
from planaria.runtime.models.tensor_parallel import TensorParallel


def rotary_heads(cfg: ModelConfig, name: str) -> int:
    """Heads whose rows are permuted between the two rotary layouts (0: not permuted)."""
    if name == "attn.wq.weight":
        return cfg.n_heads
    if name == "attn.wk.weight":
        return cfg.kv_heads
    return 0


def hf_row_order(rows: int, heads: int) -> torch.Tensor:
    """planaria_rows = hf_rows[order]: row p of Planaria's q (or k) is row order[p] of HF's."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, 2, half).transpose(1, 2).reshape(rows)


def to_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Planaria's interleaved-pair rows -> Hugging Face's half-split rows (per head)."""
    rows = w.shape[0]
    return w.view(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def from_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's half-split rows -> Planaria's interleaved pairs (`to_hf_rows`'s inverse)."""
    rows = w.shape[0]
    return w.view(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ------------------------------------------------------------- reading
class HFCheckpoint:
    """The tensors of a Hugging Face safetensors checkpoint directory, read lazily: a
    tensor, or a contiguous block of one along a dimension, without the rest."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._files: dict[str, Path] = self._weight_map()
        self._open = contextlib.ExitStack()
        self._handles: dict[Path, object] = {}

    def _weight_map(self) -> dict[str, Path]:
        index, single = self.directory / SAFETENSORS_INDEX, self.directory / SAFETENSORS
        if index.is_file():
            return {name: self.directory / file for name, file in read_weight_map(index).items()}
        if single.is_file():
            with safe_open(single, framework="pt") as f:
                return {name: single for name in f.keys()}
        raise ConfigError(f"model.init_from: {self.directory} has neither {SAFETENSORS} nor "
                          f"{SAFETENSORS_INDEX}; save the model with save_pretrained (safetensors; "
                          "PyTorch .bin pickles are not read)")

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self._open.close()

    def _slice(self, key: str):
        if key not in self._files:
            raise ConfigError(f"{self.directory} has no tensor {key}: the checkpoint is incomplete "
                              "or not a LLaMA of this shape")
        path = self._files[key]
        if path not in self._handles:
            self._handles[path] = self._open.enter_context(safe_open(path, framework="pt"))
        return self._handles[path].get_slice(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor `key`, or only its indices [start, stop) along `dim`."""
        piece = self._slice(key)
        if dim is None:
            return piece[:]
        ndim = len(piece.get_shape())
        return piece[tuple(slice(start, stop) if d == dim else slice(None) for d in range(ndim))]


def _shard_positions(model: LayerModel, index: int, name: str, shape: tuple[int, ...], dim: int,
                     tp: TensorParallel) -> torch.Tensor:
    """Which indices along `dim` of the full tensor this tp rank's shard holds, in its
    order: `LayerModel.shard` applied to a probe whose entries are their own index along
    `dim`, broadcast over the other dimensions (free until the shard copies its piece:
    then 4 bytes per element of the shard, once)."""
    view = [1] * len(shape)
    view[dim] = shape[dim]
    index_dtype = torch.int32 if shape[dim] < 2**31 else torch.int64
    probe = torch.arange(shape[dim], dtype=index_dtype).view(view).expand(shape)
    piece = model.shard(index, name, probe, tp.rank, tp.size)
    return piece.movedim(dim, 0).reshape(piece.shape[dim], -1)[:, 0].to(torch.int64)


def read_shard(ckpt: HFCheckpoint, model: LayerModel, index: int, name: str,
               tp: TensorParallel) -> torch.Tensor:
    """This tp rank's shard of Planaria parameter `name` of layer `index`, in Planaria's
    layout, read from the checkpoint (only the rows or columns the shard needs)."""
    cfg = model.cfg
    key = hf_name(cfg, index, name)
    dims = full_shape(cfg, index, name)
    shape = ckpt.shape(key)
    check_shape(ckpt.directory, key, shape, dims)
    heads = rotary_heads(cfg, name)
    order = hf_row_order(shape[0], heads) if heads else None
    dim = model.shard_dims(index).get(name)
    if dim is None or tp.size == 1:
        full = ckpt.read(key)
        full = full if order is None else full[order]
        return full if dim is None else model.shard(index, name, full, tp.rank, tp.size)
    positions = _shard_positions(model, index, name, shape, dim, tp)
    if order is not None:
        assert dim == 0, "rotary rows are split along dimension 0"
        positions = order[positions]
    start, stop = int(positions.min()), int(positions.max()) + 1
    return ckpt.read(key, dim, start, stop).index_select(dim, positions - start)


def load_pretrained_layer(model: LayerModel, index: int, layer: nn.Module, tp: TensorParallel) -> None:
    """Overwrite the parameters of `layer` (layer `index`, this tp rank's shard) with
    `model.init_from`'s values."""
    with HFCheckpoint(model.cfg.init_from) as ckpt, torch.no_grad():
        for name, param in layer.named_parameters():
            value = read_shard(ckpt, model, index, name, tp)
            if value.shape != param.shape:
                raise RuntimeError(f"layer {index} {name}: the shard read is {tuple(value.shape)}, "
                                   f"the layer's is {tuple(param.shape)}")
            param.copy_(value)
