"""Deterministic training data: token sources and the iteration -> samples mapping.

This module owns two things:

1. Building a 1-D token stream from a `data.source` string:
   - ``"synthetic"``: a learnable stream of random motifs, generated from the seed;
   - ``"stdlib"``: the running Python's standard-library ``.py`` files as bytes
     (vocab 256), a real corpus that needs no download;
   - a corpus prepared by ``planaria data prepare`` (its directory or manifest):
     all shards of the split, each memory-mapped, read as one stream
     (:class:`planaria.runtime.data.shards.ShardStream`); or a single shard file;
   - a headerless nanoGPT-style ``.bin`` file of little-endian tokens, only with
     ``data.dtype`` (uint16 or uint32) saying their width, memory-mapped read-only.

   Each source has a ``train`` split; prepared corpora and ``synthetic`` also a
   ``val`` split (held out by document; synthetic: the same motifs in another order).

2. Mapping a training iteration to its samples, independent of the parallel plan.
   Sample ``i`` is ``tokens[i*T : i*T + T + 1]`` (inputs are the first ``T``
   tokens, targets the last ``T``). The infinite stream of sample *positions*
   0, 1, 2, ... is cut into epochs of ``num_samples`` positions; epoch ``e`` visits
   the samples in the order ``default_rng([seed, e]).permutation(num_samples)``.
   Iteration ``k`` with global batch ``B`` uses positions ``[k*B, (k+1)*B)``.
   Because this depends only on ``(seed, k, B)`` and the dataset, re-running
   iteration ``k`` after a failure, on any pipeline layout, yields the same
   tokens; each pipeline then takes a contiguous slice ``[start, start+count)``
   of that global batch via :meth:`TokenDataset.batch`.

It does not own sharding across data-parallel ranks beyond that slice, nor any
loader threads: a batch is a cheap gather from an in-memory or mapped array.
"""
from __future__ import annotations

import operator
import os
import sys
import sysconfig
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from planaria.runtime.config.sections import ConfigError
from planaria.runtime.data import shards

__all__ = ["TokenDataset", "build_dataset", "dataset_for", "SYNTHETIC", "STDLIB"]

SYNTHETIC = "synthetic"
STDLIB = "stdlib"

# Config keys named in error messages, so a user knows which YAML field to fix.
KEY_SOURCE = "data.source"
KEY_SEED = "data.seed"
KEY_SEQ_LEN = "model.seq_len"
KEY_VOCAB = "model.vocab_size"
KEY_DTYPE = "data.dtype"

SPLITS = shards.SPLITS
HEADERLESS_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}

DEFAULT_SYNTHETIC_SAMPLES = 4096
DEFAULT_STDLIB_MAX_BYTES = 16 * 2**20

# Synthetic stream shape: few enough motifs that a small model can memorise
# them, long enough that most next tokens are predictable from context.
_N_MOTIFS = 64
_MOTIF_LEN = 16
# Mixed into the synthetic generator's seed so its random stream never
# coincides with the permutation streams default_rng([seed, epoch]).
_SYNTHETIC_STREAM_TAG = 0x53594E54  # "SYNT"
_SYNTHETIC_VAL_TAG = 0x56414C  # "VAL": the held-out order of the same motifs


def _as_int(value, key: str, minimum: int) -> int:
    """Coerce an integer-like value (int, numpy int) and enforce a lower bound."""
    try:
        v = operator.index(value)  # rejects floats and bools-as-strings alike
    except TypeError:
        raise ValueError(f"{key}: expected an integer, got {value!r}") from None
    if v < minimum:
        raise ValueError(f"{key}: must be >= {minimum}, got {v}")
    return v


def _token_dtype(vocab_size: int) -> np.dtype:
    # Smallest dtype holding every token id keeps big streams compact.
    if vocab_size <= 2**8:
        return np.dtype(np.uint8)
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    if vocab_size <= 2**31:
        return np.dtype(np.int32)
    return np.dtype(np.int64)


class TokenDataset:
    """A 1-D token stream cut into samples of ``seq_len + 1`` tokens.

    Samples do not overlap except for the one shared boundary token (the last
    target of sample ``i`` is the first input of sample ``i+1``), so
    ``num_samples = (len(tokens) - 1) // seq_len``.
    """

    # Two cached permutations suffice: a global batch straddles at most the
    # current epoch and the next one (unless B > num_samples, which still works,
    # just with recomputation).
    _PERM_CACHE_SIZE = 2

    def __init__(self, tokens: np.ndarray, seq_len: int, description: str):
        if not isinstance(tokens, (np.ndarray, shards.ShardStream)):
            tokens = np.asarray(tokens)  # a stream of shards stays mapped, never concatenated
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}"
            )
        seq_len = _as_int(seq_len, KEY_SEQ_LEN, 1)
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"{KEY_SEQ_LEN}: the data has {len(tokens):,} tokens, fewer than one sample "
                f"needs ({seq_len + 1:,} = seq_len + 1); use more data or a shorter seq_len"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.description = description
        self._perms: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def __repr__(self) -> str:
        return f"TokenDataset({self.description!r}, seq_len={self.seq_len}, num_samples={self.num_samples})"

    @property
    def num_samples(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def _permutation(self, seed: int, data_epoch: int) -> np.ndarray:
        key = (seed, data_epoch)
        perm = self._perms.get(key)
        if perm is None:
            perm = np.random.default_rng([seed, data_epoch]).permutation(self.num_samples)
            self._perms[key] = perm
            while len(self._perms) > self._PERM_CACHE_SIZE:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(key)
        return perm

    def prepare(self, iteration: int, global_batch: int, seed: int) -> None:
        """Shuffle now the data epoch that `iteration`'s batch reads (a permutation of every
        sample: seconds and a gigabyte for a pretraining corpus of 10^8 samples), off the
        step that would: a joiner does it while it waits to be let in, so that the join's
        first step, which every rank waits for, does not (6 ms of the tiny config's
        first step on CPU, measured)."""
        self.sample_indices(iteration, global_batch, seed)

    def sample_indices(self, iteration: int, global_batch: int, seed: int) -> np.ndarray:
        """The ``global_batch`` dataset sample indices of ``iteration``, in batch order."""
        iteration = _as_int(iteration, "iteration", 0)
        global_batch = _as_int(global_batch, "global_batch", 1)
        seed = _as_int(seed, KEY_SEED, 0)
        n = self.num_samples
        # Python ints: k*B can exceed int64 in principle, and epochs are exact.
        pos = iteration * global_batch
        end = pos + global_batch
        out = np.empty(global_batch, dtype=np.int64)
        filled = 0
        while pos < end:
            epoch, offset = divmod(pos, n)
            take = min(end - pos, n - offset)
            out[filled : filled + take] = self._permutation(seed, epoch)[offset : offset + take]
            filled += take
            pos += take
        return out

    def batch(
        self,
        iteration: int,
        global_batch: int,
        seed: int,
        start: int = 0,
        count: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, ``torch.long`` of shape ``(count, seq_len)``, for
        samples ``[start, start+count)`` of the iteration's global batch."""
        global_batch = _as_int(global_batch, "global_batch", 1)
        start = _as_int(start, "start", 0)
        count = global_batch - start if count is None else _as_int(count, "count", 1)
        if start + count > global_batch or count < 1:
            raise ValueError(
                f"batch slice [start={start}, start+count={start + count}) is outside the global "
                f"batch of {global_batch} samples; need 0 <= start < start+count <= global_batch"
            )
        idx = self.sample_indices(iteration, global_batch, seed)[start : start + count]
        t = self.seq_len
        # One vectorised gather of (count, T+1) tokens; works on memmaps too and
        # touches only the pages of the chosen samples.
        offsets = idx[:, None] * t + np.arange(t + 1, dtype=np.int64)[None, :]
        chunk = np.asarray(self.tokens[offsets]).astype(np.int64, copy=False)
        inputs = torch.from_numpy(np.ascontiguousarray(chunk[:, :-1]))
        targets = torch.from_numpy(np.ascontiguousarray(chunk[:, 1:]))
        return inputs, targets


# ---------------------------------------------------------------- sources


def _synthetic_tokens(seed: int, vocab_size: int, num_samples: int, seq_len: int,
                      split: str = "train") -> np.ndarray:
    """A stream of ``_N_MOTIFS`` fixed random motifs in random order.

    Within a motif the next token is (nearly) determined by the context, so a
    model's loss can fall far below log(vocab); only motif boundaries carry
    log(_N_MOTIFS) nats of real uncertainty. The ``val`` split strings the same
    motifs in an order of its own.
    """
    rng = np.random.default_rng([_SYNTHETIC_STREAM_TAG, seed])
    dtype = _token_dtype(vocab_size)
    motifs = rng.integers(0, vocab_size, size=(_N_MOTIFS, _MOTIF_LEN), dtype=np.int64).astype(dtype)
    n_tokens = num_samples * seq_len + 1
    n_motifs = -(-n_tokens // _MOTIF_LEN)
    if split == "val":
        rng = np.random.default_rng([_SYNTHETIC_STREAM_TAG, seed, _SYNTHETIC_VAL_TAG])
    order = rng.integers(0, _N_MOTIFS, size=n_motifs)
    return motifs[order].reshape(-1)[:n_tokens]


def _stdlib_files(stdlib: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        # Installed third-party packages are not part of the standard library,
        # and their presence varies between machines; skip them for determinism.
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        for name in filenames:
            if name.endswith(".py"):
                files.append(Path(dirpath, name))
    # Sorted relative POSIX paths give the same order on every machine/filesystem.
    files.sort(key=lambda p: p.relative_to(stdlib).as_posix())
    return files


@lru_cache(maxsize=4)
def _stdlib_corpus(stdlib: str, max_bytes: int) -> tuple[bytes, int]:
    """Concatenated stdlib source, truncated to ``max_bytes``; returns (bytes, files used)."""
    parts: list[bytes] = []
    total = 0
    used = 0
    for path in _stdlib_files(Path(stdlib)):
        if total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable (broken symlink, permissions): not worth failing over
        if not data:
            continue
        data = data[: max_bytes - total]
        parts.append(data)
        total += len(data)
        used += 1
    return b"".join(parts), used


def _stdlib_dataset(seq_len: int, vocab_size: int, max_bytes: int) -> TokenDataset:
    if vocab_size < 256:
        raise ValueError(
            f"{KEY_VOCAB}: the 'stdlib' corpus is byte-level and needs vocab_size >= 256, "
            f"got {vocab_size}; raise {KEY_VOCAB} or use {KEY_SOURCE}: 'synthetic'"
        )
    stdlib = sysconfig.get_paths()["stdlib"]
    corpus, n_files = _stdlib_corpus(stdlib, max_bytes)
    if not corpus:
        raise ValueError(
            f"{KEY_SOURCE}: no .py files found under the standard library at {stdlib!r}; "
            f"use 'synthetic' or a corpus prepared by `planaria data prepare`"
        )
    tokens = np.frombuffer(corpus, dtype=np.uint8)
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    desc = f"stdlib corpus: {len(tokens) / 2**20:.1f} MiB of Python {ver} source, {n_files:,} files"
    return TokenDataset(tokens, seq_len, desc)


_PATH_HINT = ("give a directory prepared by `planaria data prepare`, a headerless .bin with data.dtype, "
              "or use 'synthetic' or 'stdlib'")


def _bin_dataset(source: str, seq_len: int, vocab_size: int, dtype: str) -> TokenDataset:
    """A headerless nanoGPT .bin: nothing in it says how wide its tokens are, so
    `data.dtype` must (a uint32 corpus read as uint16 trains on garbage, silently)."""
    path = Path(source).expanduser()
    if not dtype:
        raise ValueError(f"{KEY_DTYPE}: {source!r} has no shard header, so its token width is unknown; set "
                         f"{KEY_DTYPE}: uint16 (vocabularies up to 65,536) or uint32, or prepare the corpus "
                         f"with `planaria data prepare`")
    width = HEADERLESS_DTYPES[dtype]  # any other value is refused with the config (load_config)
    name = dtype
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{KEY_SOURCE}: file {source!r} is empty; {_PATH_HINT}")
    if size % width.itemsize:
        raise ValueError(
            f"{KEY_SOURCE}: file {source!r} has a byte length ({size:,}) that is not a multiple of "
            f"{width.itemsize}, so it is not a stream of {name} tokens; check {KEY_DTYPE} or the file"
        )
    n_tokens = size // width.itemsize
    _check_length(source, n_tokens, seq_len)
    # Read-only map: the file may be shared by every rank on the host and is
    # never copied into process memory as a whole.
    tokens = np.memmap(path, dtype=width, mode="r")
    _check_vocab(source, _largest_token(path, tokens), vocab_size)
    desc = f"token file {str(path)!r}: {n_tokens:,} {name} tokens ({size / 2**20:.1f} MiB)"
    return TokenDataset(tokens, seq_len, desc)


def _check_length(source: str, n_tokens: int, seq_len: int) -> None:
    if n_tokens < seq_len + 1:
        raise ValueError(
            f"{KEY_SOURCE}: {source!r} holds {n_tokens:,} tokens, too short for one sample "
            f"of {KEY_SEQ_LEN}={seq_len} (needs {seq_len + 1:,}); use more data or a shorter seq_len"
        )


def _check_vocab(source: str, max_token: int, vocab_size: int) -> None:
    if max_token >= vocab_size:
        raise ValueError(
            f"{KEY_VOCAB}: {source!r} contains token id {max_token}, which does not fit "
            f"vocab_size={vocab_size}; set {KEY_VOCAB} >= {max_token + 1}"
        )


def _check_header_dtype(source: str, header: shards.ShardHeader, dtype: str) -> None:
    """The header is the authority on the token width; a contradicting data.dtype is a mistake."""
    actual = shards.dtype_name(header.dtype)
    if dtype and dtype != actual:
        raise ValueError(f"{KEY_DTYPE}: {dtype} contradicts {source!r}, whose header says {actual} tokens; "
                         f"remove {KEY_DTYPE} (a shard's header sets the width)")


def _shard_dataset(source: str, seq_len: int, vocab_size: int, dtype: str, split: str) -> TokenDataset:
    """A single shard file given directly: the stream of one split, whatever it was."""
    if split != "train":
        raise ValueError(f"{KEY_SOURCE}: {source!r} is a single shard, with no {split!r} split; give the "
                         f"prepared directory (its manifest names the splits)")
    try:
        header, tokens = shards.open_shard(Path(source).expanduser())
    except ValueError as err:
        raise ValueError(f"{KEY_SOURCE}: {err}") from None
    _check_header_dtype(source, header, dtype)
    _check_length(source, header.num_tokens, seq_len)
    if header.vocab_size > vocab_size:  # ids may still fit: only then read them all
        _check_vocab(source, int(tokens.max()), vocab_size)
    desc = (f"token shard {source!r}: {header.num_tokens:,} {shards.dtype_name(header.dtype)} tokens, "
            f"vocab {header.vocab_size:,}")
    return TokenDataset(tokens, seq_len, desc)


def _prepared_dataset(source: str, seq_len: int, vocab_size: int, dtype: str, split: str) -> TokenDataset:
    """All shards of one split of a prepared corpus as one memory-mapped stream."""
    path = shards.manifest_path(Path(source).expanduser())
    try:
        manifest = shards.read_manifest(path)
    except ValueError as err:
        raise ValueError(f"{KEY_SOURCE}: {err}") from None
    entries = manifest.get("splits", {}).get(split) or []
    if not entries:
        raise ValueError(f"{KEY_SOURCE}: {source!r} has no {split!r} shards; prepare it again "
                         f"(`planaria data prepare`, --val-fraction above 0 for a validation split)")
    parts, names = [], []
    for entry in entries:
        file = path.parent / entry["file"]
        if not file.is_file():
            raise ValueError(f"{KEY_SOURCE}: shard {str(file)!r} named by {str(path)!r} is missing; "
                             f"run `planaria data prepare` again into that directory")
        try:
            header, tokens = shards.open_shard(file)
        except ValueError as err:
            raise ValueError(f"{KEY_SOURCE}: {err}") from None
        _check_header_dtype(str(file), header, dtype)
        if header.num_tokens != entry["tokens"] or header.vocab_size != manifest["vocab_size"]:
            raise ValueError(f"{KEY_SOURCE}: {str(file)!r} holds {header.num_tokens:,} tokens of vocab {header.vocab_size:,}, "
                             f"its manifest says {entry['tokens']:,} of {manifest['vocab_size']:,}; run "
                             f"`planaria data prepare` again into that directory")
        # The manifest keeps each shard's largest id: no pass over a terabyte at each start.
        _check_vocab(str(file), int(entry["max_token"]), vocab_size)
        parts.append(tokens)
        names.append(entry["file"])
    stream = shards.ShardStream(parts, names)
    _check_length(source, len(stream), seq_len)
    desc = (f"prepared corpus {source!r} ({split}): {len(stream):,} {shards.dtype_name(stream.dtype)} tokens "
            f"in {len(parts)} shards, vocab {manifest['vocab_size']:,}")
    return TokenDataset(stream, seq_len, desc)


def _largest_token(path: Path, tokens: np.ndarray) -> int:
    """The largest token id in a .bin file: one vectorised pass, once per version of the
    file. Every worker checks it at start (an out-of-range id would fail an embedding
    lookup mid-run), and workers start again and again in an elastic job: on a corpus of
    a terabyte, a pass each time would cost minutes per start. So the answer is kept
    beside the file (`<name>.maxtoken`, keyed by its size and modification time), where
    the directory is writable; otherwise each start reads the file."""
    stat = path.stat()
    key = f"{stat.st_size} {stat.st_mtime_ns}"
    sidecar = path.with_name(path.name + ".maxtoken")
    try:
        cached_key, _, value = sidecar.read_text(encoding="utf-8").rpartition(" ")
        if cached_key == key:
            return int(value)
    except (OSError, ValueError):
        pass  # absent, unreadable or not ours: compute it
    largest = int(tokens.max())
    partial = sidecar.with_name(f".{sidecar.name}.{os.getpid()}")
    try:
        partial.write_text(f"{key} {largest}", encoding="utf-8")
        os.replace(partial, sidecar)  # whole or absent: readers never see half of it
    except OSError:
        partial.unlink(missing_ok=True)  # a read-only corpus directory: nothing kept
    return largest


def build_dataset(
    source: str,
    *,
    seq_len: int,
    vocab_size: int,
    seed: int,
    num_samples: int = DEFAULT_SYNTHETIC_SAMPLES,
    max_bytes: int = DEFAULT_STDLIB_MAX_BYTES,
    dtype: str = "",
    split: str = "train",
) -> TokenDataset:
    """Build the dataset named by ``source`` ('synthetic', 'stdlib', a prepared
    directory or its manifest, a shard, or a headerless .bin with ``dtype``).

    ``num_samples`` sizes the synthetic stream; ``max_bytes`` caps the stdlib
    corpus. Both are ignored by the other sources. ``split`` is 'train' or 'val'.
    """
    if not isinstance(source, (str, os.PathLike)) or not str(source):
        raise ValueError(f"{KEY_SOURCE}: expected 'synthetic', 'stdlib' or a path, got {source!r}; {_PATH_HINT}")
    source = os.fspath(source)
    seq_len = _as_int(seq_len, KEY_SEQ_LEN, 1)
    vocab_size = _as_int(vocab_size, KEY_VOCAB, 2)
    seed = _as_int(seed, KEY_SEED, 0)
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is unknown; use one of {SPLITS}")
    if source == SYNTHETIC:
        num_samples = _as_int(num_samples, "num_samples", 1)
        tokens = _synthetic_tokens(seed, vocab_size, num_samples, seq_len, split)
        desc = (
            f"synthetic ({split}): {num_samples:,} samples of {seq_len} tokens, {_N_MOTIFS} motifs of "
            f"length {_MOTIF_LEN} over vocab {vocab_size:,}, seed {seed}"
        )
        return TokenDataset(tokens, seq_len, desc)
    if source == STDLIB:
        if split != "train":
            raise ValueError(f"{KEY_SOURCE}: 'stdlib' has no {split!r} split; prepare a corpus with "
                             f"`planaria data prepare` (it holds out documents) or set eval.every: 0")
        max_bytes = _as_int(max_bytes, "max_bytes", 1)
        return _stdlib_dataset(seq_len, vocab_size, max_bytes)
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"{KEY_SOURCE}: {source!r} not found; {_PATH_HINT}")
    if path.is_dir() or path.suffix == ".json":
        return _prepared_dataset(source, seq_len, vocab_size, dtype, split)
    if not path.is_file():
        raise ValueError(f"{KEY_SOURCE}: {source!r} is not a regular file; {_PATH_HINT}")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{KEY_SOURCE}: cannot read {source!r} (permission denied); make it readable by "
                         f"this user")
    if shards.is_shard(path):
        return _shard_dataset(source, seq_len, vocab_size, dtype, split)
    if split != "train":
        raise ValueError(f"{KEY_SOURCE}: the headerless file {source!r} has no {split!r} split; prepare "
                         f"the corpus with `planaria data prepare` (it holds out documents) or set eval.every: 0")
    return _bin_dataset(source, seq_len, vocab_size, dtype)


def dataset_for(cfg, split: str = "train") -> TokenDataset:
    """The dataset of a job's config (`planaria.runtime.config.sections.Config`) for one split.

    A problem with the data is the user's to fix, like one in the config: it is raised as
    a `ConfigError`, which the trainer reports in one line (exit 2), not as a traceback."""
    try:
        return build_dataset(cfg.data.source, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size,
                             seed=cfg.data.seed, dtype=cfg.data.dtype, split=split)
    except ValueError as err:
        raise ConfigError(str(err)) from None
