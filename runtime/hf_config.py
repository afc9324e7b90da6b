"""The configuration half of the Hugging Face LLaMA mapping: config.json <-> `model.*`.

The whole mapping (config keys, tensor names, the rotary permutation) is described in
one place, `planaria.runtime.hf`; this module holds only its config part, free of torch
so that `load_config` (which a node's agent runs too) can derive a model section from a
checkpoint's config.json without importing torch.

`derive_model_config` is what `model.init_from: DIR` does at load time: every
`model.*` key the config leaves out is taken from DIR/config.json, and a key the
config sets to another value than the checkpoint's is refused, naming both.
"""
from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from planaria.runtime.config import ConfigError, ModelConfig

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"

HF_KEYS = {
    # model.* key: config.json key
    "n_layers": "num_hidden_layers",
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_hidden": "intermediate_size",
    "vocab_size": "vocab_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
    "tie_embeddings": "tie_word_embeddings",
}
_FFN_KEYS = {"ffn_hidden", "multiple_of", "ffn_dim_multiplier"}
_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """DIR/config.json, checked to be a LLaMA checkpoint that Planaria's blocks compute."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"model.init_from: {directory} is not a directory; give a Hugging Face "
                          "LLaMA checkpoint directory (config.json and model.safetensors)")
    path = directory / "config.json"
    if not path.is_file():
        raise ConfigError(f"model.init_from: {directory} has no config.json; give a Hugging Face "
                          "LLaMA checkpoint directory (as save_pretrained writes it)")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} is not a JSON object; give a Hugging Face model's config.json")
    architectures = hf.get("architectures") or [ARCHITECTURE]
    if ARCHITECTURE not in architectures or hf.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise ConfigError(f"{path} describes {'/'.join(architectures)} (model_type "
                          f"{hf.get('model_type')!r}); model.init_from takes {ARCHITECTURE} "
                          f"checkpoints (model_type {MODEL_TYPE!r})")
    missing = [key for key in _REQUIRED if not isinstance(hf.get(key), int) or hf[key] < 1]
    if missing:
        raise ConfigError(f"{path} lacks {', '.join(missing)} (or they are not positive integers); "
                          "a LLaMA config.json gives them")
    _check_computable(hf, path)
    return hf


def _check_computable(hf: dict, path: Path) -> None:
    """LLaMA options Planaria's blocks do not compute: refused rather than ignored."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{path}: hidden_act {hf['hidden_act']!r}; Planaria's MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"{path}: {key} is true; Planaria's LLaMA blocks have no biases")
    head_dim = hf.get("head_dim")
    if head_dim and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        raise ConfigError(f"{path}: head_dim {head_dim} x num_attention_heads "
                          f"{hf['num_attention_heads']} != hidden_size {hf['hidden_size']}; "
                          "Planaria's head size is d_model / n_heads")


def rope_from_hf(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a config.json in either spelling: transformers 4's
    `rope_theta` + `rope_scaling`, or transformers 5's `rope_parameters`. The scaling is
    None for plain RoPE, else a mapping with `rope_type` (only 'llama3' is computed)."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = dict(hf.get("rope_scaling") or params)
    scaling.pop("rope_theta", None)
    kind = scaling.pop("type", None) or scaling.get("rope_type") or "default"
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ConfigError(f"config.json: rope type {kind!r} is not supported; Planaria computes "
                          "plain RoPE and LLaMA 3.1's 'llama3' scaling")
    return theta, {"rope_type": kind, **{k: v for k, v in scaling.items() if k != "rope_type"}}


def model_values(hf: dict) -> dict[str, Any]:
    """`model.*` values of a checked config.json (see `HF_KEYS`)."""
    theta, scaling = rope_from_hf(hf)
    return {
        "n_layers": hf["num_hidden_layers"], "d_model": hf["hidden_size"],
        "n_heads": hf["num_attention_heads"],
        "n_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "ffn_hidden": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "rope_theta": theta,
        "rope_scaling": scaling, "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def derive_model_config(model: ModelConfig, explicit: set[str]) -> ModelConfig:
    """`model` completed from `model.init_from`'s config.json: keys not in `explicit` (the
    ones the YAML and overrides set) take the checkpoint's values; explicit ones must agree."""
    path = Path(model.init_from) / "config.json"
    values = model_values(read_hf_config(model.init_from))
    known = {f.name for f in fields(ModelConfig)}
    # What a ModelConfig without the key computes (one without grouped-query attention,
    # tied embeddings or RoPE scaling): the checkpoint must then agree with that.
    implicit = {"n_kv_heads": values["n_heads"], "rope_scaling": None, "tie_embeddings": False}
    updates = {}
    for key, value in values.items():
        hf_key = HF_KEYS[key]
        if key not in known:
            if value != implicit[key]:
                raise ConfigError(f"{path}: {hf_key}={value!r} needs model.{key}, which this version "
                                  "of Planaria does not have")
            continue
        if key == "ffn_hidden" and explicit & _FFN_KEYS:
            current, shown = model.ffn_dim, "the FFN width of model." + "/".join(sorted(explicit & _FFN_KEYS))
        elif key in explicit:
            current, shown = _effective(model, key), f"model.{key}={getattr(model, key)!r}"
        else:
            updates[key] = value
            continue
        if current != value:
            raise ConfigError(f"{shown} disagrees with {path} ({hf_key}={value!r}): leave the key out "
                              f"to take the checkpoint's value, or set it to {value!r}")
    return replace(model, **updates)


def _effective(model: ModelConfig, key: str) -> Any:
    """What a model key means, for comparing with a checkpoint: n_kv_heads 0 is n_heads,
    a rope_scaling of rope_type 'default' is none."""
    value = getattr(model, key)
    if key == "n_kv_heads":
        return value or model.n_heads
    if key == "rope_scaling" and (not value or value.get("rope_type", "default") == "default"):
        return None
    return value


def hf_config_from_model(model: ModelConfig, *, torch_dtype: str,
                         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json `planaria export hf` writes for `model` (read with getattr defaults:
    a ModelConfig without GQA, tied embeddings or RoPE scaling means none of them).

    RoPE is written both ways (transformers 4's `rope_theta` and `rope_scaling`, which
    transformers 5 still reads), so that either version loads the directory."""
    scaling = getattr(model, "rope_scaling", None)
    config = {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "hidden_size": model.d_model, "intermediate_size": model.ffn_dim,
        "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
        "num_key_value_heads": getattr(model, "n_kv_heads", 0) or model.n_heads,
        "head_dim": model.head_dim, "vocab_size": model.vocab_size,
        "rms_norm_eps": model.norm_eps, "rope_theta": model.rope_theta,
        "rope_scaling": dict(scaling) if scaling else None,
        "tie_word_embeddings": bool(getattr(model, "tie_embeddings", False)),
        "max_position_embeddings": model.seq_len, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "initializer_range": model.init_std, "use_cache": True,
        "torch_dtype": torch_dtype, "dtype": torch_dtype,
    }
    config.update(extra or {})
    return config
