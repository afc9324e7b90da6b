"""The inputs of `planaria data prepare`: text corpora cut into units of work, their
documents, and the tokenizer (loaded, or trained here).

Plain text files are a document each (a directory is walked in sorted order; hidden
entries, broken links and files with NUL bytes are skipped, and `--include`/`--exclude` patterns
choose among its files); JSON lines (`.jsonl`, `.ndjson`, `.json`)
and Parquet hold a document per line or row in the field `--text-key`; a local Hugging
Face dataset directory (`save_to_disk`) is read with `datasets`. A unit is what one
worker encodes: a group of small files, a byte range of a JSON lines file, a Parquet row
group, a range of dataset rows; units come in a deterministic order.

It writes nothing but a trained tokenizer; `planaria.runtime.data.prepare` runs the job.
"""
from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from planaria.runtime.contract.checkpoint_layout import atomic_write_bytes
from planaria.runtime.data.shards import TOKENIZER_FILE

__all__ = ["PrepareError", "Unit", "discover", "documents", "load_tokenizer", "find_eos", "train_bpe",
           "BPE_EOS"]

JSON_LINES = (".jsonl", ".ndjson", ".json")
PARQUET = (".parquet",)
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
BPE_EOS = "<|endoftext|>"
# Units big enough that a worker's start and the pickling of its result are noise,
# small enough that several workers share a corpus of a few files.
UNIT_BYTES = 8 << 20
UNIT_ROWS = 20_000
_SNIFF = 8192


class PrepareError(ValueError):
    """An input or option a user must fix; the message names it."""


@dataclass(frozen=True)
class Unit:
    """A piece of the input one worker encodes: `kind` text (whole files), jsonl (lines
    starting in bytes [start, stop)), parquet (row group `start`) or hf (rows [start, stop))."""

    kind: str
    paths: tuple[str, ...]
    start: int = 0
    stop: int = 0
    size: int = 0
    """Bytes it covers, for the progress bar (for hf, its rows' share of the text column's bytes)."""


# ---------------------------------------------------------------- inputs


def _is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(_SNIFF)


def _wanted(relative: str, include: tuple[str, ...], exclude: tuple[str, ...]) -> bool:
    """Whether a file found in a directory is input: its path relative to that directory
    matches an `include` pattern (any, when none are given) and no `exclude` one
    (shell-style patterns, `*` crossing `/`: `*.py`, `*-packages/*`)."""
    if include and not any(fnmatch.fnmatchcase(relative, pattern) for pattern in include):
        return False
    return not any(fnmatch.fnmatchcase(relative, pattern) for pattern in exclude)


def _input_files(inputs: list[str], include: tuple[str, ...] = (),
                 exclude: tuple[str, ...] = ()) -> tuple[list[Path], list[Path]]:
    """(files, Hugging Face dataset directories), in a stable sorted order. `include` and
    `exclude` filter the files found by walking a directory; inputs named one by one are
    taken as they are."""
    files, datasets = [], []
    for item in inputs:
        path = Path(item).expanduser()
        if not path.exists():
            raise PrepareError(f"input {item!r} not found; give text, JSON lines or Parquet files, directories "
                               "of them, or a Hugging Face dataset directory (save_to_disk)")
        if _is_hf_dataset(path):
            datasets.append(path)
        elif path.is_dir():
            found = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
                # A broken symbolic link (or a socket, a pipe) is no document: skipped.
                found += [Path(dirpath, name) for name in filenames
                          if not name.startswith(".") and Path(dirpath, name).is_file()]
            found = [f for f in found if _wanted(f.relative_to(path).as_posix(), include, exclude)]
            files += sorted(found, key=lambda p: p.relative_to(path).as_posix())
        else:
            files.append(path)
    return files, datasets


def discover(inputs: list[str], text_key: str, include: tuple[str, ...] = (),
             exclude: tuple[str, ...] = ()) -> list[Unit]:
    """Cut the inputs into units of work, in a deterministic order (`include`, `exclude`:
    see `_input_files`)."""
    files, hf_dirs = _input_files(inputs, include, exclude)
    units: list[Unit] = []
    batch: list[str] = []
    batch_bytes = 0

    def flush():
        nonlocal batch, batch_bytes
        if batch:
            units.append(Unit("text", tuple(batch), size=batch_bytes))
        batch, batch_bytes = [], 0

    for path in files:
        size = path.stat().st_size
        suffix = path.suffix.lower()
        if suffix in JSON_LINES:
            flush()
            for start in range(0, max(size, 1), UNIT_BYTES):
                stop = min(size, start + UNIT_BYTES)
                units.append(Unit("jsonl", (str(path),), start, stop, stop - start))
        elif suffix in PARQUET:
            flush()
            units += _parquet_units(path, text_key)
        elif size and not _looks_binary(path):  # a stray binary file would be noise, not text
            batch.append(str(path))
            batch_bytes += size
            if batch_bytes >= UNIT_BYTES:
                flush()
    flush()
    for directory in hf_dirs:
        units += _hf_units(directory, text_key)
    if not units:
        filters = f" (with --include {list(include)} and --exclude {list(exclude)})" if include or exclude else ""
        raise PrepareError(f"no text found in {inputs}{filters}; give text, JSON lines or Parquet files or a "
                           "Hugging Face dataset directory")
    return units


def _parquet_units(path: Path, text_key: str) -> list[Unit]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path)
    if text_key not in meta.schema_arrow.names:
        raise PrepareError(f"{path}: no column {text_key!r} (columns: {meta.schema_arrow.names}); name the "
                           "text column with --text-key")
    size = path.stat().st_size
    groups = meta.num_row_groups
    return [Unit("parquet", (str(path),), g, g + 1, size // max(groups, 1)) for g in range(groups)]


def _load_hf(directory: str):
    from datasets import DatasetDict, load_from_disk

    data = load_from_disk(directory)
    if isinstance(data, DatasetDict):
        if "train" not in data:
            raise PrepareError(f"{directory}: a dataset dict without a 'train' split ({list(data)}); save the "
                               "split to prepare with Dataset.save_to_disk")
        data = data["train"]
    return data


def _hf_units(directory: Path, text_key: str) -> list[Unit]:
    data = _load_hf(str(directory))
    if text_key not in data.column_names:
        raise PrepareError(f"{directory}: no column {text_key!r} (columns: {data.column_names}); name the "
                           "text column with --text-key")
    n = len(data)
    # The progress bar counts bytes: a range of rows counts its share of the text column's
    # bytes (the Arrow buffers' size, known without reading the rows).
    column_bytes = data.data.column(text_key).nbytes
    return [Unit("hf", (str(directory),), a, min(n, a + UNIT_ROWS),
                 column_bytes * (min(n, a + UNIT_ROWS) - a) // max(n, 1))
            for a in range(0, n, UNIT_ROWS)]


def _json_lines(path: str, start: int, stop: int, text_key: str) -> Iterator[str]:
    """The documents of the lines that begin in bytes [start, stop) of a JSON lines file."""
    with open(path, "rb") as f:
        if start:
            f.seek(start - 1)
            f.readline()  # the line begun before `start` belongs to the unit before
        while f.tell() < stop:
            at = f.tell()
            line = f.readline()
            if not line:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise PrepareError(f"{path}: the line at byte {at} is not JSON ({err.msg}); give JSON lines "
                                   "(one object per line)") from None
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise PrepareError(f"{path}: the line at byte {at} has no text field {text_key!r}; name the "
                                   "field with --text-key")
            yield text


def documents(unit: Unit, text_key: str) -> Iterator[str]:
    if unit.kind == "text":
        for path in unit.paths:
            yield Path(path).read_bytes().decode("utf-8", errors="replace")
    elif unit.kind == "jsonl":
        yield from _json_lines(unit.paths[0], unit.start, unit.stop, text_key)
    elif unit.kind == "parquet":
        import pyarrow.parquet as pq

        column = pq.ParquetFile(unit.paths[0]).read_row_group(unit.start, columns=[text_key]).column(0)
        yield from (text for text in column.to_pylist() if text is not None)
    elif unit.kind == "hf":
        rows = _load_hf(unit.paths[0])[unit.start:unit.stop][text_key]
        yield from (text for text in rows if text is not None)
    else:
        raise AssertionError(unit.kind)


# ---------------------------------------------------------------- tokenizer


def load_tokenizer(spec: str):
    """A `tokenizers.Tokenizer` from a tokenizer.json or a Hugging Face tokenizer directory;
    returns (tokenizer, the tokenizer.json path)."""
    from tokenizers import Tokenizer

    path = Path(spec).expanduser()
    fix = "give a tokenizer.json, a Hugging Face tokenizer directory, or --train-bpe VOCAB"
    if path.is_dir():
        if not (path / TOKENIZER_FILE).is_file():
            extra = (" (a SentencePiece tokenizer.model is not read: save it as tokenizer.json with "
                     "transformers' AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))"
                     if (path / "tokenizer.model").is_file() else "")
            raise PrepareError(f"--tokenizer {spec}: no tokenizer.json in that directory{extra}; {fix}")
        path = path / TOKENIZER_FILE
    elif not path.is_file():
        raise PrepareError(f"--tokenizer {spec}: not found; {fix}")
    try:
        return Tokenizer.from_file(str(path)), path
    except Exception as err:  # tokenizers raises a bare Exception on a bad file
        raise PrepareError(f"--tokenizer {spec}: not a tokenizer.json the tokenizers library reads "
                           f"({str(err).splitlines()[0]}); {fix}") from None


def find_eos(tokenizer, tokenizer_path: Path, eos: str | None) -> int:
    """The id of the end-of-text token: `--eos`, the tokenizer_config.json beside it, or a
    usual name."""
    names = [eos] if eos else []
    config = tokenizer_path.parent / "tokenizer_config.json"
    if not eos and config.is_file():
        try:
            value = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise PrepareError(f"{config}: not a readable tokenizer_config.json ({err}); fix or remove it, or "
                               "name the end-of-text token with --eos TOKEN") from None
        value = value.get("eos_token") if isinstance(value, dict) else None
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            names.append(value)
    names += [] if eos else list(EOS_CANDIDATES)
    for name in names:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    raise PrepareError(f"tokenizer {tokenizer_path}: no end-of-text token among {names}; name the one that "
                       "separates documents with --eos TOKEN")


def train_bpe(units: list[Unit], text_key: str, vocab_size: int, path: Path) -> None:
    """Train a byte-level BPE of `vocab_size` (end-of-text token included) on all the
    documents, and save it as `path` (atomically)."""
    from tokenizers import ByteLevelBPETokenizer

    if vocab_size < 257:
        raise PrepareError(f"--train-bpe {vocab_size}: a byte-level BPE needs at least 257 tokens (256 bytes "
                           "and the end-of-text token)")
    bpe = ByteLevelBPETokenizer()
    texts = (text for unit in units for text in documents(unit, text_key))
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, show_progress=False,
                            special_tokens=[BPE_EOS])
    atomic_write_bytes(path, bpe._tokenizer.to_str().encode())
