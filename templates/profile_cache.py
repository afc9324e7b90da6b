"""The profile cache: the profiler's tp = 1 measurements (and the measured links), one JSON
file per key, in the caller's cache folder.

The key (`measurement_key`) holds everything that changes the measurements: the model's
shape, the micro batch, the dtype, recomputation, the device's name, torch's version
and thread count, and what the caller adds (`profile_layers`' `cache_key`). tp is not
in it: one profile serves every tp (`templates/profiler.py`). The file is named by a
digest of the key and also holds the key, so a collision or an older format (another
`CACHE_VERSION`) is measured again; an unreadable file too, with a warning. Files are
written atomically. Imports torch (the device's name, torch's version): only computing
processes load this module.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from planaria.templates.costs import ModelShape
from planaria.templates.gloo_links import GlooLinks

CACHE_VERSION = 5


@dataclass(frozen=True)
class Measurement:
    """One layer measured at tp = 1 for one microbatch; what the cache stores."""

    forward_s: float
    backward_s: float
    activation_bytes: int
    output_bytes: int
    sharded_parameters: int
    """Matrices (dim >= 2), which tensor parallelism splits."""
    replicated_parameters: int
    """Vectors such as norm gains, which every tp worker holds whole."""
    optimizer_s: float = 0.0
    """The parameter update, once per iteration (module docstring)."""


def measurement_key(shape: ModelShape, micro_batch: int, dtype: str, recompute: bool,
                    device: torch.device, extra: dict | None) -> dict:
    """Everything that changes the tp = 1 measurements (tp does not: see the module docstring)."""
    return {"version": CACHE_VERSION, "shape": asdict(shape), "micro_batch": micro_batch,
            "dtype": dtype, "recompute": recompute, "device": _device_name(device),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "extra": extra or {}}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{_cpu_name()}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def cache_file(cache_dir: Path | str, key: dict) -> Path:
    """The cache file of `key` in `cache_dir`."""
    return Path(cache_dir) / f"profile-{_digest(key)}.json"


def read_cache(path: Path, key: dict) -> tuple[dict[str, Measurement], GlooLinks | None] | None:
    """The cached measurements and links, or None when absent, stale, or corrupt (with a
    warning)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data["key"] != key:  # a hash collision or an older format: measure again
            return None
        links = data.get("links")
        return ({kind: Measurement(**data["layers"][kind]) for kind in ("embedding", "block", "head")},
                None if links is None else GlooLinks(**links))
    except (OSError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"ignoring unreadable profile cache {path}: {err!r}; measuring again",
                      stacklevel=3)
        return None


def write_cache(path: Path, key: dict, measured: dict[str, Measurement],
                 links: GlooLinks | None = None) -> None:
    """Write atomically: a temporary file in the same folder, then os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"key": key, "layers": {kind: asdict(m) for kind, m in measured.items()},
            "links": None if links is None else asdict(links)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
