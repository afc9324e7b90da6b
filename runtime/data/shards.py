"""Token shards on disk: the file format, the manifest of a prepared corpus, and a
memory-mapped view of many shards as one token stream.

A shard is a fixed 64-byte header followed by little-endian token ids:

    offset  size  field
    0       8     magic b"PLNRTOK\\0"
    8       4     format version (uint32, 1)
    12      4     bytes per token (uint32: 2 for uint16, 4 for uint32)
    16      8     vocabulary size (uint64)
    24      8     token count (uint64)
    32      8     end-of-text id (uint64): documents are separated by it
    40      24    reserved, zero

The token width follows from the vocabulary: uint16 iff vocab_size <= 65536. The
header is the authority on the width, so a uint32 shard can never be read as uint16.

A prepared corpus is a directory of shards plus `manifest.json` (written last and
atomically): per split (`train`, `val`) the shards with their token counts, document
counts, largest id and blake2b checksum, and the tokenizer (`tokenizer.json`, copied
beside the shards), vocabulary size and end-of-text id.

Free of torch (numpy only): `planaria data prepare` writes shards without it. This
module does not tokenize (`planaria.runtime.data.prepare` does) and does not cut a stream
into samples (`planaria.runtime.data.token_datasets` does).
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from planaria.runtime.contract.checkpoint_layout import atomic_write, atomic_write_bytes

__all__ = ["MAGIC", "VERSION", "HEADER_SIZE", "MANIFEST", "FORMAT", "SPLITS", "ShardHeader", "ShardStream",
           "dtype_for_vocab", "dtype_name", "write_shard", "read_header", "open_shard", "is_shard",
           "file_checksum", "write_manifest", "read_manifest", "manifest_path", "TOKENIZER_FILE"]

MAGIC = b"PLNRTOK\0"
VERSION = 1
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sIIQQQ")  # magic, version, bytes per token, vocab, count, eos
MANIFEST = "manifest.json"
FORMAT = "planaria-token-shards"
SPLITS = ("train", "val")
TOKENIZER_FILE = "tokenizer.json"
CHECKSUM = "blake2b"

_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_NAMES = {2: "uint16", 4: "uint32"}
_REDO = "run `planaria data prepare` again into that directory (it rewrites damaged shards)"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 where every id fits (vocab_size <= 65536), else uint32."""
    if vocab_size < 1 or vocab_size > 2**32:
        raise ValueError(f"vocabulary size {vocab_size} is outside 1..2**32")
    return _DTYPES[2] if vocab_size <= 2**16 else _DTYPES[4]


def dtype_name(dtype: np.dtype) -> str:
    return _NAMES[np.dtype(dtype).itemsize]


@dataclass(frozen=True)
class ShardHeader:
    vocab_size: int
    num_tokens: int
    eos_id: int
    itemsize: int

    @property
    def dtype(self) -> np.dtype:
        return _DTYPES[self.itemsize]

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + self.num_tokens * self.itemsize

    def pack(self) -> bytes:
        head = _HEADER.pack(MAGIC, VERSION, self.itemsize, self.vocab_size, self.num_tokens, self.eos_id)
        return head.ljust(HEADER_SIZE, b"\0")


def write_shard(path: Path, tokens: np.ndarray, *, vocab_size: int, eos_id: int) -> str:
    """Write `tokens` as a shard atomically; returns the file's checksum (hex)."""
    dtype = dtype_for_vocab(vocab_size)
    tokens = np.ascontiguousarray(tokens, dtype=dtype)
    header = ShardHeader(vocab_size, len(tokens), eos_id, dtype.itemsize)
    digest = hashlib.blake2b(digest_size=32)

    def write(f):
        for part in (header.pack(), memoryview(tokens).cast("B")):
            digest.update(part)
            f.write(part)

    atomic_write(path, write)
    return digest.hexdigest()


def is_shard(path: Path) -> bool:
    """Whether the file starts with the shard magic (a headerless .bin does not)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def read_header(path: Path) -> ShardHeader:
    """The header of a shard, checked against the file's size (a truncated copy or an
    interrupted download is refused here, not mid-training)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    except OSError as err:
        raise ValueError(f"{path}: cannot read the shard ({err.strerror}); make it readable by this user, "
                         f"or {_REDO}") from None
    if len(raw) < HEADER_SIZE or raw[:len(MAGIC)] != MAGIC:
        raise ValueError(f"{path}: not a Planaria token shard (no {MAGIC[:-1].decode()} header); "
                         f"{_REDO}, or read a headerless .bin with data.dtype")
    _, version, itemsize, vocab, count, eos = _HEADER.unpack_from(raw)
    if version != VERSION:
        raise ValueError(f"{path}: shard format version {version}, this Planaria reads version {VERSION}; "
                         f"{_REDO}")
    if itemsize not in _DTYPES:
        raise ValueError(f"{path}: the header names {itemsize} bytes per token (uint16 or uint32 only); "
                         f"the file is damaged: {_REDO}")
    header = ShardHeader(vocab, count, eos, itemsize)
    if dtype_for_vocab(vocab).itemsize != itemsize:
        raise ValueError(f"{path}: the header says {_NAMES[itemsize]} tokens for a vocabulary of {vocab:,}, "
                         f"which needs {dtype_name(dtype_for_vocab(vocab))}; the file is damaged: {_REDO}")
    size = path.stat().st_size
    if size != header.file_size:
        state = "truncated" if size < header.file_size else "longer than its header says"
        raise ValueError(f"{path}: shard is {state} ({size:,} bytes, the header's {count:,} "
                         f"{_NAMES[itemsize]} tokens need {header.file_size:,}); {_REDO}")
    return header


def open_shard(path: Path) -> tuple[ShardHeader, np.ndarray]:
    """The header and a read-only memory map of the tokens (no copy into memory)."""
    header = read_header(path)
    if header.num_tokens == 0:
        return header, np.zeros(0, dtype=header.dtype)
    return header, np.memmap(path, dtype=header.dtype, mode="r", offset=HEADER_SIZE, shape=(header.num_tokens,))


def file_checksum(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------- manifest


def manifest_path(source: Path) -> Path:
    """The manifest of a prepared directory, or the manifest file itself."""
    source = Path(source)
    return source / MANIFEST if source.is_dir() else source


def write_manifest(directory: Path, manifest: dict) -> Path:
    path = Path(directory) / MANIFEST
    atomic_write_bytes(path, json.dumps(manifest, indent=1).encode())
    return path


def read_manifest(path: Path) -> dict:
    """A prepared corpus's manifest, checked for the fields the reader relies on."""
    path = manifest_path(path)
    fix = "run `planaria data prepare` to make one"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no manifest of a prepared corpus here; {fix}") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot read the manifest ({err.strerror}); make it readable by this "
                         f"user") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a valid manifest ({err}); {fix}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: not a manifest of Planaria token shards (format {FORMAT!r}); {fix}")
    if manifest.get("version") != VERSION:
        raise ValueError(f"{path}: manifest version {manifest.get('version')}, this Planaria reads "
                         f"{VERSION}; {fix} again")
    _check_manifest_fields(path, manifest, f"{fix} again")
    return manifest


_ENTRY_FIELDS = {"file": str, "tokens": int, "max_token": int}


def _check_manifest_fields(path: Path, manifest: dict, fix: str) -> None:
    """The fields a reader indexes, with their types: a damaged or hand-edited manifest
    is a one-line error naming what is wrong, not a KeyError."""
    vocab = manifest.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise ValueError(f"{path}: 'vocab_size' is {vocab!r}, not a positive integer; {fix}")
    splits = manifest.get("splits")
    if not isinstance(splits, dict):
        raise ValueError(f"{path}: 'splits' is {type(splits).__name__}, not a mapping of split to shards; {fix}")
    for split, entries in splits.items():
        if not isinstance(entries, list):
            raise ValueError(f"{path}: split {split!r} is {type(entries).__name__}, not a list of shards; {fix}")
        for i, entry in enumerate(entries):
            for key, kind in _ENTRY_FIELDS.items():
                value = entry.get(key) if isinstance(entry, dict) else None
                if not isinstance(value, kind) or isinstance(value, bool):
                    raise ValueError(f"{path}: shard {i} of split {split!r} has no valid {key!r} "
                                     f"(got {value!r}); {fix}")


# ---------------------------------------------------------------- many shards, one stream


class ShardStream:
    """Many shards read as one 1-D token stream, each memory-mapped, none copied.

    Supports what `TokenDataset` needs of an array: `len`, `dtype`, `ndim`, and a
    gather `stream[offsets]` with an integer array of any shape (a sample may straddle
    two shards: each id is looked up in its own shard)."""

    ndim = 1

    def __init__(self, parts: list[np.ndarray], names: list[str]):
        if not parts:
            raise ValueError("a shard stream needs at least one shard")
        dtypes = {p.dtype for p in parts}
        if len(dtypes) != 1:
            raise ValueError(f"shards {names} mix token widths {sorted(map(str, dtypes))}; "
                             "prepare them with one tokenizer")
        self.parts = parts
        self.names = names
        self.dtype = parts[0].dtype
        # starts[i] is the stream position of part i's first token; starts[-1] the length.
        self.starts = np.cumsum([0] + [len(p) for p in parts], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __repr__(self) -> str:
        return f"ShardStream({len(self.parts)} shards, {len(self):,} {dtype_name(self.dtype)} tokens)"

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            index = np.arange(start, stop, step, dtype=np.int64)
        offsets = np.asarray(index, dtype=np.int64)
        flat = offsets.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"token positions outside the stream of {len(self):,} tokens")
        part = np.searchsorted(self.starts, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.dtype)
        for p in np.unique(part):
            chosen = part == p
            out[chosen] = self.parts[p][flat[chosen] - self.starts[p]]
        if np.ndim(index) == 0:
            return out[0]
        return out.reshape(offsets.shape)
