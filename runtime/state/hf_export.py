"""`planaria export hf`: a Planaria save (the final model, or a checkpoint) written as a
Hugging Face LLaMA checkpoint, with its config.json and tokenizer files.

The tensors are mapped by `planaria.runtime.models.hf_weights` (names, the rotary
permutation) after the tp shards are joined with `LayerModel.unshard`; they are written
as safetensors shards of at most `max_shard_size` bytes, with the index Hugging Face
reads, into a directory renamed into place only when complete (docs/interop.md).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from planaria.runtime.config.hf_config import (SAFETENSORS, SAFETENSORS_INDEX, full_shape, hf_config_from_model,
                                               hf_name)
from planaria.runtime.config.sections import ConfigError, ModelConfig
from planaria.runtime.contract.checkpoint_layout import (MANIFEST, atomic_rename_dir, complete_checkpoints, read_manifest,
                                                        read_model_record)
from planaria.runtime.models.hf_weights import rotary_heads, to_hf_rows
from planaria.runtime.models.llama import LayerModel
from planaria.runtime.state.saved_model import full_layers, recorded_model


@dataclass(frozen=True)
class SavedModel:
    """A Planaria save to export: the final model or one checkpoint."""

    directory: Path
    kind: str  # "final" or "checkpoint"
    model: ModelConfig
    tp: int
    data_source: str = ""

    def layers(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """(index, full tensors by parameter name), one layer at a time."""
        return full_layers(self.directory, LayerModel(self.model, seed=0), self.tp)


def find_saved_model(path: str | Path, config: ModelConfig | None = None) -> tuple[SavedModel, str]:
    """The save that `planaria export hf PATH` means, and a line saying which it took:
    a final/ or checkpoint step directory itself, or an output directory (its final/,
    else its newest complete checkpoint), or a checkpoint root (its newest). `config`
    (from --config) replaces the model section the save records."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory; give a training output directory, its final/ "
                          "or a checkpoint's step-N directory")
    if (path / MANIFEST).is_file():
        directory = path
    elif (path / "final" / MANIFEST).is_file():
        directory = path / "final"
    else:
        found = complete_checkpoints(path / "checkpoints") or complete_checkpoints(path)
        if not found:
            raise ConfigError(f"{path} holds no final model (final/{MANIFEST}) and no complete "
                              "checkpoint; give a training output directory, its final/ or a "
                              "checkpoint's step-N directory")
        directory = found[-1][1]
    manifest = read_manifest(directory)
    missing = [key for key in ("num_layers", "tp") if not isinstance(manifest.get(key), int)]
    if missing:
        raise ConfigError(f"{directory / MANIFEST} lacks {', '.join(missing)}; the save is damaged: "
                          "give another checkpoint")
    kind = "checkpoint" if "iteration" in manifest else "final"
    record = read_model_record(directory)
    if config is None and record["model"] is None:
        raise ConfigError(f"{directory} does not record its model config (saved by an older "
                          "version); give the training config: --config CONFIG.yaml [section.key=value ...]")
    model = config if config is not None else recorded_model(record["model"], directory, manifest["tp"])
    saved = SavedModel(directory, kind, model, manifest["tp"], record["data_source"])
    if manifest["num_layers"] != model.num_layers:
        raise ConfigError(f"{directory} has {manifest['num_layers']} layers but the model config gives "
                          f"{model.num_layers} (model.n_layers={model.n_layers} + 2)")
    what = (f"the final model {directory}" if kind == "final"
            else f"the checkpoint of iteration {manifest['iteration']} ({directory})")
    return saved, what


def hf_tensors(saved: SavedModel, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every parameter of `saved`, q and k permuted."""
    tied = saved.model.tie_embeddings
    for index, tensors in saved.layers():
        for name, value in tensors.items():
            expected = tuple(d.size for d in full_shape(saved.model, index, name))
            if tuple(value.shape) != expected:
                raise ConfigError(f"layer {index} {name} is {tuple(value.shape)} in {saved.directory} "
                                  f"but the model config gives {expected}: give the config it was "
                                  "trained with (--config)")
            if tied and name == "output.weight":
                continue  # Hugging Face ties lm_head to embed_tokens: not stored twice
            heads = rotary_heads(saved.model, name)
            value = to_hf_rows(value, heads) if heads else value
            yield hf_name(saved.model, index, name), value.to(dtype or value.dtype).contiguous()


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000' -> bytes."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit):
            number = upper[: -len(unit)].strip()
            break
    else:
        number, factor = upper, 1
    try:
        size = int(float(number) * factor)
    except ValueError:
        raise ValueError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB or 500MB") from None
    if size <= 0:
        raise ValueError(f"--max-shard-size must be positive, got {text!r}")
    return size


def export_hf(saved: SavedModel, out_dir: str | Path, *, max_shard_size: int = 5 * 10**9,
              dtype: torch.dtype | None = None, tokenizer: str | Path | None = None) -> list[str]:
    """Write `saved` as a Hugging Face LLaMA directory that `from_pretrained` loads:
    config.json, safetensors (model.safetensors, or shards of at most `max_shard_size`
    bytes and model.safetensors.index.json), and the tokenizer when one is known.
    Written into a temporary directory, made durable and renamed to `out_dir` at the
    end: `out_dir` is absent or whole, even after a power cut. Returns lines
    describing what was written."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"{out_dir} already exists and is not empty; remove it or give another directory")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        files, weight_map, total, torch_dtype = _write_shards(saved, tmp, max_shard_size, dtype)
        source = _init_from_config(saved.model)
        extra = {k: source[k] for k in ("max_position_embeddings", "bos_token_id", "eos_token_id",
                                        "pad_token_id") if k in source}
        eos_id = _data_manifest(saved).get("eos_id")
        if "eos_token_id" not in extra and isinstance(eos_id, int):
            extra["eos_token_id"] = eos_id  # the documents' separator: generation stops there
        config = hf_config_from_model(saved.model, torch_dtype=torch_dtype, extra=extra)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        copied = copy_tokenizer(tmp, tokenizer, saved, config.get("eos_token_id"))
        atomic_rename_dir(tmp, out_dir)  # every file on disk before the name appears
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [f"{len(weight_map)} tensors in {len(files)} safetensors file(s), {total / 1e6:.1f} MB, "
            f"{torch_dtype}", copied]


def _write_shards(saved: SavedModel, directory: Path, max_shard_size: int,
                  dtype: torch.dtype | None) -> tuple[list[str], dict[str, str], int, str]:
    """Stream the tensors into safetensors files of at most `max_shard_size` bytes (a
    tensor larger than that gets a file of its own), each written as soon as it is full,
    under a provisional name: the file names count the files, known only at the end."""
    written: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size = total = 0
    torch_dtype = ""

    def flush() -> None:
        save_file(current, directory / f"shard{len(written)}.tmp", metadata={"format": "pt"})
        written.append(list(current))
        current.clear()

    for name, tensor in hf_tensors(saved, dtype):
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_size:
            flush()
            size = 0
        current[name] = tensor
        size += nbytes
        total += nbytes
        torch_dtype = str(tensor.dtype).removeprefix("torch.")
    flush()
    files = [SAFETENSORS] if len(written) == 1 else [
        f"model-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))]
    weight_map = {}
    for i, (file, names) in enumerate(zip(files, written)):
        os.replace(directory / f"shard{i}.tmp", directory / file)
        weight_map.update(dict.fromkeys(names, file))
    return files, weight_map, total, torch_dtype


def _init_from_config(model: ModelConfig) -> dict:
    """config.json of the checkpoint the model started from, if it is still there: its
    context length and special token ids carry over to the export."""
    path = Path(model.init_from) / "config.json" if model.init_from else None
    if path is None or not path.is_file():
        return {}
    with contextlib.suppress(ValueError, OSError):
        return json.loads(path.read_text())
    return {}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json")


def find_tokenizer(saved: SavedModel, given: str | Path | None) -> tuple[list[tuple[Path, str]], str]:
    """The tokenizer files to ship with an export, and where they come from: `given`
    (a tokenizer.json or a tokenizer directory), else the tokenizer `planaria data
    prepare` recorded in the training data's manifest, else the files beside the
    `model.init_from` checkpoint."""
    if given is not None:
        given = Path(given)
        found = _tokenizer_files(given.parent if given.is_file() else given, given if given.is_file() else None)
        if not found:
            raise ConfigError(f"--tokenizer {given}: no tokenizer.json there; give a tokenizer.json "
                              "file or a Hugging Face tokenizer directory")
        return found, f"--tokenizer {given}"
    data_dir = _data_dir(saved)
    if data_dir is not None:
        found = _tokenizer_files(data_dir, _manifest_tokenizer(data_dir, _data_manifest(saved)))
        if found:
            return found, f"the data manifest of {data_dir}"
    if saved.model.init_from and Path(saved.model.init_from).is_dir():
        found = _tokenizer_files(Path(saved.model.init_from), None)
        if found:
            return found, f"the model.init_from checkpoint {saved.model.init_from}"
    return [], ""


def _added_token(tokenizer_json: Path, token_id: int | None) -> str | None:
    """The text of special token `token_id` in a tokenizer.json, if it lists it."""
    if token_id is None or not tokenizer_json.is_file():
        return None
    with contextlib.suppress(ValueError, OSError):
        for token in json.loads(tokenizer_json.read_text()).get("added_tokens", []):
            if token.get("id") == token_id:
                return token.get("content")
    return None


def _data_dir(saved: SavedModel) -> Path | None:
    """The directory of the training data (`data.source`: a prepared directory or its
    manifest), when the save recorded one that is still there."""
    source = Path(saved.data_source) if saved.data_source else None
    if source is None or not source.exists():
        return None
    return source if source.is_dir() else source.parent


def _data_manifest(saved: SavedModel) -> dict:
    """The manifest `planaria data prepare` wrote beside the training data; {} if none."""
    data_dir = _data_dir(saved)
    path = data_dir / "manifest.json" if data_dir is not None else None
    if path is None or not path.is_file():
        return {}
    with contextlib.suppress(ValueError, OSError):
        manifest = json.loads(path.read_text())
        return manifest if isinstance(manifest, dict) else {}
    return {}


def _manifest_tokenizer(data_dir: Path, manifest: dict) -> Path | None:
    """The tokenizer file a data manifest names (a file name relative to it)."""
    entry = manifest.get("tokenizer")
    if not isinstance(entry, str):
        return None
    candidate = Path(entry) if Path(entry).is_absolute() else data_dir / entry
    return candidate if candidate.is_file() else None


def _tokenizer_files(directory: Path, tokenizer_json: Path | None) -> list[tuple[Path, str]]:
    """(source, name in the export) of the tokenizer files found; [] without a tokenizer."""
    files = [(tokenizer_json, "tokenizer.json")] if tokenizer_json is not None else []
    taken = {name for _, name in files}
    files += [(directory / name, name) for name in TOKENIZER_FILES
              if name not in taken and (directory / name).is_file()]
    names = {name for _, name in files}
    return files if names & {"tokenizer.json", "tokenizer.model"} else []


def copy_tokenizer(out_dir: Path, given: str | Path | None, saved: SavedModel,
                   eos_id: int | None = None) -> str:
    """Copy the export's tokenizer (`find_tokenizer`) into `out_dir`; a line saying what
    happened. A tokenizer_config.json is written when none came with it, naming the end
    of text token `eos_id` when tokenizer.json lists it among its special tokens."""
    files, origin = find_tokenizer(saved, given)
    if not files:
        return ("no tokenizer copied (none recorded by `planaria data prepare` or beside model.init_from): "
                "give --tokenizer PATH")
    for source, name in files:
        shutil.copyfile(source, out_dir / name)
    if not (out_dir / "tokenizer_config.json").is_file():
        # AutoTokenizer then reads tokenizer.json through the generic fast class.
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": saved.model.seq_len}
        eos = _added_token(out_dir / "tokenizer.json", eos_id)
        if eos is not None:
            config["eos_token"] = eos
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return f"tokenizer from {origin}: {', '.join(sorted(name for _, name in files))}"
