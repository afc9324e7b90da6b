"""The configuration half of the Hugging Face LLaMA mapping: config.json <-> `model.*`.

The whole mapping (config keys, tensor names, the rotary permutation) is described in
one place, `planaria.runtime.models.hf_weights`; this module holds its torch-free part (the config keys,
the tensor names and full shapes), so that `load_config` (which a node's agent runs too)
can derive a model section from a checkpoint's config.json, and `check_init_from` check
its tensors' names and shapes from the safetensors headers, without importing torch.

`derive_model_config` is what `model.init_from: DIR` does at load time: every
`model.*` key the config leaves out is taken from DIR/config.json, and a key the
config sets to another value than the checkpoint's is refused, naming both.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from planaria.runtime.config.sections import Config, ConfigError, ModelConfig, normalized_rope_scaling
from planaria.runtime.contract.checkpoint_layout import complete_checkpoints

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
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
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
    `normalized_rope_scaling`'s: None for plain RoPE, else a mapping with `rope_type`
    (only 'llama3' is computed)."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = dict(hf.get("rope_scaling") or params)
    scaling.pop("rope_theta", None)
    scaling = normalized_rope_scaling(scaling)
    if scaling is not None and scaling["rope_type"] != "llama3":
        raise ConfigError(f"config.json: rope type {scaling['rope_type']!r} is not supported; Planaria "
                          "computes plain RoPE and LLaMA 3.1's 'llama3' scaling")
    return theta, scaling


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
    ones the YAML and overrides set) take the checkpoint's values; explicit ones must agree.
    The tensors are checked by `check_init_from` (a resumed job does not need them)."""
    path = Path(model.init_from) / "config.json"
    values = model_values(read_hf_config(model.init_from))
    updates = {}
    for key, value in values.items():
        hf_key = HF_KEYS[key]
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
    """What a model key means, for comparing with a checkpoint's (`model_values`)."""
    if key == "n_kv_heads":
        return model.kv_heads
    if key == "rope_scaling":
        return normalized_rope_scaling(model.rope_scaling)
    return getattr(model, key)


def hf_config_from_model(model: ModelConfig, *, torch_dtype: str,
                         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json `planaria export hf` writes for `model`.

    RoPE is written both ways (transformers 4's `rope_theta` and `rope_scaling`, which
    transformers 5 still reads), so that either version loads the directory."""
    scaling = normalized_rope_scaling(model.rope_scaling)
    config = {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "hidden_size": model.d_model, "intermediate_size": model.ffn_dim,
        "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim, "vocab_size": model.vocab_size,
        "rms_norm_eps": model.norm_eps, "rope_theta": model.rope_theta,
        "rope_scaling": dict(scaling) if scaling else None,
        "tie_word_embeddings": model.tie_embeddings,
        "max_position_embeddings": model.seq_len, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "initializer_range": model.init_std, "use_cache": True,
        "torch_dtype": torch_dtype, "dtype": torch_dtype,
    }
    config.update(extra or {})
    return config


# ------------------------------------------------------- tensor names and shapes
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight", "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}
EMBED = "model.embed_tokens.weight"


def hf_name(cfg: ModelConfig, index: int, name: str) -> str:
    """The Hugging Face tensor name of parameter `name` of Planaria layer `index`."""
    last = cfg.num_layers - 1
    if index == 0 and name == "embed.weight":
        return EMBED
    if 0 < index < last and name in _BLOCK_NAMES:
        return f"model.layers.{index - 1}.{_BLOCK_NAMES[name]}"
    if index == last and name == "norm.weight":
        return "model.norm.weight"
    if index == last and name == "output.weight":
        return EMBED if cfg.tie_embeddings else "lm_head.weight"
    raise ValueError(f"layer {index} parameter {name!r} has no Hugging Face LLaMA counterpart")


@dataclass(frozen=True)
class _Dim:
    size: int
    why: str  # what in model.* gives the size
    key: str  # the model key a differing size asks to change
    unit: int = 1  # the key's value is size / unit


def full_shape(cfg: ModelConfig, index: int, name: str) -> tuple[_Dim, ...]:
    """The full-size shape of a parameter, each size with the `model.*` keys behind it."""
    c = _Dim(cfg.d_model, f"model.d_model={cfg.d_model}", "model.d_model")
    vocab = _Dim(cfg.vocab_size, f"model.vocab_size={cfg.vocab_size}", "model.vocab_size")
    ffn = _Dim(cfg.ffn_dim, f"the FFN width {cfg.ffn_dim} (model.ffn_hidden)", "model.ffn_hidden")
    hd = cfg.head_dim
    q = _Dim(cfg.n_heads * hd, f"model.n_heads={cfg.n_heads} x head_dim {hd}", "model.n_heads", hd)
    n_kv = cfg.kv_heads
    kv = _Dim(n_kv * hd, f"model.n_kv_heads={n_kv} x head_dim {hd}", "model.n_kv_heads", hd)
    shapes = {"embed.weight": (vocab, c), "output.weight": (vocab, c), "norm.weight": (c,),
              "attn_norm.weight": (c,), "mlp_norm.weight": (c,), "attn.wq.weight": (q, c),
              "attn.wk.weight": (kv, c), "attn.wv.weight": (kv, c), "attn.wo.weight": (c, q),
              "mlp.w_gate.weight": (ffn, c), "mlp.w_up.weight": (ffn, c), "mlp.w_down.weight": (c, ffn)}
    return shapes[name]


def check_shape(directory: Path, key: str, actual: tuple[int, ...], dims: tuple[_Dim, ...]) -> None:
    expected = tuple(d.size for d in dims)
    if actual == expected:
        return
    if len(actual) != len(expected):
        raise ConfigError(f"{key} is {actual} in {directory} but Planaria expects {expected}: "
                          "the checkpoint is not a LLaMA of this shape")
    d, size = next((d, a) for d, a in zip(dims, actual) if a != d.size)
    fix = (f"set {d.key}={size // d.unit}" if size % d.unit == 0 and size // d.unit > 0
           else "the checkpoint does not fit this model")
    raise ConfigError(f"{key} is {actual} in {directory} but {d.why} gives {expected}: {fix}")




def layer_parameters(cfg: ModelConfig, index: int) -> tuple[str, ...]:
    """The parameter names of Planaria layer `index` (see `planaria.runtime.models.llama`)."""
    if index == 0:
        return ("embed.weight",)
    if index == cfg.num_layers - 1:
        return ("norm.weight", "output.weight")
    return tuple(_BLOCK_NAMES)


def read_weight_map(index: Path) -> dict[str, str]:
    """Tensor name -> file name of a model.safetensors.index.json."""
    try:
        weight_map = json.loads(Path(index).read_text(encoding="utf-8"))["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ConfigError(f"model.init_from: {index} is not a safetensors index (no JSON object with a "
                          f"weight_map: {err!r}); save the model again with save_pretrained") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(f"model.init_from: {index}: weight_map is not a mapping of tensor names to files")
    return weight_map


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from a safetensors file's header alone (an 8-byte
    little-endian length, then that many bytes of JSON): no tensor is read."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length).decode("utf-8"))
        return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
    except FileNotFoundError:
        raise ConfigError(f"model.init_from: {path} is missing; the checkpoint is incomplete") from None
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
            AttributeError, MemoryError, OverflowError) as err:
        raise ConfigError(f"model.init_from: {path} is not a safetensors file ({err!r})") from None


def checkpoint_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every tensor of a Hugging Face safetensors checkpoint."""
    directory = Path(directory)
    index, single = directory / SAFETENSORS_INDEX, directory / SAFETENSORS
    if index.is_file():
        files = sorted(set(read_weight_map(index).values()))
    elif single.is_file():
        files = [SAFETENSORS]
    else:
        raise ConfigError(f"model.init_from: {directory} has neither {SAFETENSORS} nor "
                          f"{SAFETENSORS_INDEX}; save the model with save_pretrained (safetensors; "
                          "PyTorch .bin pickles are not read)")
    shapes = {}
    for file in files:
        shapes.update(safetensors_shapes(directory / file))
    return shapes


def check_init_from(cfg: Config) -> None:
    """A job's `model.init_from` tensors, checked at start (before any process group or
    planning) unless it resumes from a complete checkpoint, whose state it then takes
    instead: a missing or mis-shaped tensor fails in one line, not in a worker."""
    if cfg.model.init_from and not (cfg.checkpoint.every and complete_checkpoints(cfg.checkpoint_dir)):
        check_checkpoint_tensors(cfg.model)


def check_checkpoint_tensors(cfg: ModelConfig) -> None:
    """Every tensor `cfg` needs from `cfg.init_from` is there with its shape, read from
    the safetensors headers alone (no tensor, no torch)."""
    directory = Path(cfg.init_from)
    shapes = checkpoint_shapes(directory)
    for index in range(cfg.num_layers):
        for name in layer_parameters(cfg, index):
            key = hf_name(cfg, index, name)
            if key not in shapes:
                raise ConfigError(f"model.init_from: {directory} has no tensor {key}: the checkpoint is "
                                  "incomplete or not a LLaMA of this shape")
            check_shape(directory, key, shapes[key], full_shape(cfg, index, name))
