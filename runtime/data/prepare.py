"""`planaria data prepare`: text in, token shards out (`planaria.runtime.data.shards`).

The inputs (text files, JSON lines, Parquet, saved Hugging Face datasets) and the
tokenizer (a `tokenizer.json`, a Hugging Face tokenizer directory, or a byte-level BPE
trained here with `--train-bpe VOCAB`) are `planaria.runtime.data.corpus`'s.

Each document is encoded without special tokens and followed by the end-of-text id. A
document goes to the `val` split when a keyed hash of its text falls below
`--val-fraction`: the split depends on the text alone, never on the order or the
number of workers, and a document repeated in the corpus never straddles the splits.

The input is cut into units (`corpus.discover`); `--workers` processes encode
units in parallel and this process writes their tokens, in unit order, into shards of
`--shard-tokens` tokens: the output is the same for any number of workers. Every file
is written atomically; after each shard a journal records every split's state: its
shards, the position in the input it has taken tokens up to, and those of its tokens not
yet in a shard (in small pending files). An interrupted run resumes from the last such
state (every file verified by checksum), encoding only the units after it; the
manifest comes last. A rerun over a finished directory with the same
inputs and settings verifies the shards and does nothing more.

It does not read shards for training (`planaria.runtime.data.token_datasets` does) and imports no torch.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from planaria.runtime.contract.checkpoint_layout import atomic_write_bytes
from planaria.runtime.data import shards
from planaria.runtime.data.corpus import (BPE_EOS, PrepareError, Unit, discover, documents, find_eos, load_tokenizer,
                                          train_bpe)

__all__ = ["prepare", "in_val", "add_parser", "main"]

JOURNAL = ".prepare-journal.json"
PENDING = ".prepare-pending-"
TOKENIZER_CONFIG = "tokenizer_config.json"
DEFAULT_SHARD_TOKENS = 100_000_000
ENCODE_BATCH_CHARS = 1 << 20


# ---------------------------------------------------------------- encoding (in the workers)


@dataclass(frozen=True)
class EncodeSettings:
    tokenizer_path: str
    text_key: str
    val_fraction: float
    seed: int
    eos_id: int
    vocab_size: int


_worker: dict = {}
"""This process's tokenizer and settings, loaded once per worker by `_init_worker`."""


def _init_worker(settings: EncodeSettings, one_thread: bool = False) -> None:
    """`one_thread` in a pool's worker: the pool is the parallelism, and a thread pool of
    the tokenizer's own in each worker would only contend for the same cores."""
    if one_thread:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _worker["settings"] = settings
    _worker["tokenizer"] = Tokenizer.from_file(settings.tokenizer_path)


def in_val(text: str, val_fraction: float, seed: int) -> bool:
    """Whether a document is held out: a keyed hash of its text, uniform in [0, 1)."""
    if val_fraction <= 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=8,
                             key=seed.to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "little") / 2**64 < val_fraction


def _batches(texts: list[str], chars: int) -> Iterator[list[str]]:
    batch, size = [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode(tokenizer, texts: list[str], eos_id: int, dtype: np.dtype) -> np.ndarray:
    """The documents' ids, each followed by the end-of-text id, as one array."""
    eos = np.array([eos_id], dtype=dtype)
    parts = [np.zeros(0, dtype=dtype)]
    # A tokenizers Encoding keeps offsets and token strings beside the ids (about 100
    # bytes a token): batches of ~1M characters bound that, and keep the batch parallel.
    for batch in _batches(texts, ENCODE_BATCH_CHARS):
        for encoding in tokenizer.encode_batch_fast(batch, add_special_tokens=False):
            parts.append(np.array(encoding.ids, dtype=dtype))
            parts.append(eos)
    return np.concatenate(parts)


def encode_unit(unit: Unit) -> dict:
    """Encode one unit: its train and val tokens and document counts."""
    s: EncodeSettings = _worker["settings"]
    dtype = shards.dtype_for_vocab(s.vocab_size)
    texts = {"train": [], "val": []}
    for text in documents(unit, s.text_key):
        texts["val" if in_val(text, s.val_fraction, s.seed) else "train"].append(text)
    return {split: _encode(_worker["tokenizer"], texts[split], s.eos_id, dtype) for split in shards.SPLITS}


# ---------------------------------------------------------------- writing shards


@dataclass
class SplitWriter:
    """Cuts one split's token stream into shards.

    `position` is the next token this split takes: (unit index, tokens into that unit).
    The tokens taken but not yet in a shard sit in the buffer; `save_pending` copies
    the part of them not saved before into a small pending file, so that a journal can
    record this split's state whenever the other split finishes a shard. A resumed run
    sets `position` and refills the buffer from those files (`restore`)."""

    split: str
    out: Path
    shard_tokens: int
    vocab_size: int
    eos_id: int
    entries: list = field(default_factory=list)
    pending: list = field(default_factory=list)
    position: tuple[int, int] = (0, 0)
    _buffer: np.ndarray | None = None
    _buffered: int = 0
    _saved: int = 0

    def _ensure_buffer(self) -> None:
        if self._buffer is None:
            # Pages of an empty array cost nothing until written: memory grows with the
            # shard, never past one shard's bytes, and no concatenation copies it.
            self._buffer = np.empty(self.shard_tokens, dtype=shards.dtype_for_vocab(self.vocab_size))

    def add(self, unit_index: int, tokens: np.ndarray, on_shard) -> None:
        unit, into = self.position
        if unit_index < unit:
            return  # already taken before the interruption
        if unit_index == unit:
            tokens = tokens[into:]
        else:
            into = 0
        self._ensure_buffer()
        while len(tokens):
            take = min(len(tokens), self.shard_tokens - self._buffered)
            self._buffer[self._buffered:self._buffered + take] = tokens[:take]
            self._buffered += take
            into += take
            tokens = tokens[take:]
            self.position = (unit_index, into)
            if self._buffered == self.shard_tokens:
                self._flush(on_shard)
        self.position = (unit_index + 1, 0)

    def finish(self, on_shard) -> None:
        if self._buffered:
            self._flush(on_shard)

    def save_pending(self) -> None:
        """Write the buffered tokens not yet in a pending file into a new one."""
        if self._buffered == self._saved:
            return
        name = f"{PENDING}{self.split}-{len(self.entries):05d}-{len(self.pending):05d}.tokens"
        tokens = self._buffer[self._saved:self._buffered]
        checksum = shards.write_shard(self.out / name, tokens, vocab_size=self.vocab_size, eos_id=self.eos_id)
        self.pending.append({"file": name, "tokens": int(len(tokens)), shards.CHECKSUM: checksum})
        self._saved = self._buffered

    def restore(self, entries: list, pending: list, position) -> None:
        """Continue from a journal's state (its files verified by the caller)."""
        self.entries, self.pending, self.position = list(entries), list(pending), tuple(position)
        self._ensure_buffer()
        for entry in pending:
            _, tokens = shards.open_shard(self.out / entry["file"])
            self._buffer[self._buffered:self._buffered + len(tokens)] = tokens
            self._buffered += len(tokens)
        self._saved = self._buffered

    def _flush(self, on_shard) -> None:
        tokens = self._buffer[:self._buffered]
        name = f"{self.split}-{len(self.entries):05d}.tokens"
        checksum = shards.write_shard(self.out / name, tokens, vocab_size=self.vocab_size, eos_id=self.eos_id)
        self.entries.append({"file": name, "tokens": int(len(tokens)),
                             "documents": int(np.count_nonzero(tokens == self.eos_id)),
                             "max_token": int(tokens.max()), shards.CHECKSUM: checksum})
        self._buffered = self._saved = 0
        self.pending = []  # its tokens are in the shard now
        on_shard()


# ---------------------------------------------------------------- the job


def _fingerprint(units: list[Unit], settings: dict) -> str:
    """What the output depends on: the inputs as they are now and the settings."""
    files = sorted({p for unit in units for p in unit.paths})
    stats = []
    for p in files:
        st = Path(p).stat()
        stats.append([p, st.st_size, st.st_mtime_ns])
    blob = json.dumps({"inputs": stats, "units": [asdict(u) for u in units], **settings}, sort_keys=True)
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def _verified(out: Path, entries: list[dict]) -> list[dict]:
    """The longest prefix of `entries` whose files are there with their checksums."""
    kept = []
    for entry in entries:
        path = out / entry["file"]
        if not path.is_file() or shards.file_checksum(path) != entry[shards.CHECKSUM]:
            break
        kept.append(entry)
    return kept


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _trained_bpe(args, units: list[Unit], out: Path, say) -> tuple[Path, dict]:
    """The BPE trained on these inputs (reused from an earlier run when its recipe is
    the same), and what the manifest records of it."""
    target = out / shards.TOKENIZER_FILE
    recipe = {"trained_bpe": args.train_bpe, "inputs": _fingerprint(units, {"text_key": args.text_key})}
    previous = _read_json(out / shards.MANIFEST) or _read_json(out / JOURNAL) or {}
    if previous.get("tokenizer_recipe") == recipe and target.is_file():
        say(f"reusing the BPE of {args.train_bpe:,} tokens trained on these inputs: {target}")
        return target, recipe
    say(f"training a byte-level BPE of {args.train_bpe:,} tokens on the inputs")
    _invalidate(out)
    train_bpe(units, args.text_key, args.train_bpe, target)
    return target, recipe


def _invalidate(out: Path) -> None:
    """Before the tokenizer or the shards change: a manifest must never name files it did
    not describe, and an earlier tokenizer's config must not name the end-of-text token."""
    (out / shards.MANIFEST).unlink(missing_ok=True)
    (out / TOKENIZER_CONFIG).unlink(missing_ok=True)


def _ship_tokenizer(source: Path, out: Path) -> Path:
    """Copy the tokenizer (and its tokenizer_config.json) beside the shards: export
    ships it with the model."""
    target = out / shards.TOKENIZER_FILE
    if source.resolve() != target.resolve():
        atomic_write_bytes(target, source.read_bytes())
        config = source.parent / TOKENIZER_CONFIG
        if config.is_file():
            atomic_write_bytes(out / TOKENIZER_CONFIG, config.read_bytes())
    return target


def _output_directory(spec: str, inputs: list[str]) -> Path:
    """--out, made and checked before any work: writable, and not inside an input
    directory (a later run would read its shards and manifest as input)."""
    out = Path(spec).expanduser()
    for item in inputs:
        source = Path(item).expanduser()
        if source.is_dir() and out.resolve().is_relative_to(source.resolve()):
            raise PrepareError(f"--out {spec}: inside the input directory {item}, whose files a later run would "
                               "read as input; write the shards elsewhere")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PrepareError(f"--out {spec}: cannot make the directory ({err.strerror}); give a directory this "
                           "user can write") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise PrepareError(f"--out {spec}: not writable by this user; give a directory this user can write")
    return out


def prepare(args: argparse.Namespace) -> dict:
    """Run `planaria data prepare`; returns the manifest."""
    if bool(args.tokenizer) == bool(args.train_bpe):
        raise PrepareError("give a tokenizer (--tokenizer tokenizer.json or a Hugging Face tokenizer directory) "
                           "or --train-bpe VOCAB to train one, not both and not neither")
    if not 0 <= args.val_fraction < 1:
        raise PrepareError(f"--val-fraction {args.val_fraction}: must be in [0, 1)")
    if args.shard_tokens < 1 or args.workers < 1:
        raise PrepareError("--shard-tokens and --workers must be at least 1")
    say = (lambda msg: None) if args.quiet else (lambda msg: print(f"planaria data prepare: {msg}", file=sys.stderr))
    out = _output_directory(args.out, args.inputs)
    units = discover(args.inputs, args.text_key, tuple(args.include), tuple(args.exclude))
    if args.train_bpe:
        tokenizer_path, recipe = _trained_bpe(args, units, out, say)
    else:  # read where it is: nothing in --out changes before the manifest is invalidated
        _, tokenizer_path = load_tokenizer(args.tokenizer)
        recipe = {"source": str(tokenizer_path)}
    tokenizer, _ = load_tokenizer(str(tokenizer_path))
    eos_id = find_eos(tokenizer, tokenizer_path, args.eos or (BPE_EOS if args.train_bpe else None))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    settings = {"tokenizer": hashlib.blake2b(tokenizer_path.read_bytes(), digest_size=16).hexdigest(),
                "text_key": args.text_key, "val_fraction": args.val_fraction, "seed": args.seed,
                "shard_tokens": args.shard_tokens, "eos_id": eos_id, "version": shards.VERSION}
    fingerprint = _fingerprint(units, settings)

    done = _read_json(out / shards.MANIFEST)
    if done and done.get("fingerprint") == fingerprint and all(
            len(_verified(out, done["splits"][s])) == len(done["splits"][s]) for s in shards.SPLITS):
        say(f"{out} is up to date (same inputs and settings, every shard verified)")
        return done
    if args.train_bpe:
        (out / shards.MANIFEST).unlink(missing_ok=True)  # shards are about to change under it
    elif tokenizer_path.resolve() != (out / shards.TOKENIZER_FILE).resolve():
        _invalidate(out)
        tokenizer_path = _ship_tokenizer(tokenizer_path, out)
    else:
        (out / shards.MANIFEST).unlink(missing_ok=True)

    writers = {s: SplitWriter(s, out, args.shard_tokens, vocab_size, eos_id) for s in shards.SPLITS}
    first_unit = _resume(out, fingerprint, writers, len(units), say)

    def save_journal():
        # Every split's state, not only the one that finished a shard: with 1% held out,
        # a val shard is rare, and without its buffered tokens on disk a resumed run
        # would have to encode again from the first unit whose val tokens are not in a shard.
        for writer in writers.values():
            writer.save_pending()
        body = {"fingerprint": fingerprint, "tokenizer_recipe": recipe,
                "splits": {s: w.entries for s, w in writers.items()},
                "pending": {s: w.pending for s, w in writers.items()},
                "position": {s: list(w.position) for s, w in writers.items()}}
        atomic_write_bytes(out / JOURNAL, json.dumps(body).encode())
        _remove_pending(out, keep={e["file"] for w in writers.values() for e in w.pending})

    encode = EncodeSettings(str(tokenizer_path), args.text_key, args.val_fraction, args.seed, eos_id, vocab_size)
    started = time.perf_counter()
    n_tokens = _run_units(units, first_unit, encode, args.workers, writers, save_journal, quiet=args.quiet)
    for writer in writers.values():
        writer.finish(save_journal)
    elapsed = time.perf_counter() - started

    manifest = {"format": shards.FORMAT, "version": shards.VERSION, "fingerprint": fingerprint,
                "tokenizer": shards.TOKENIZER_FILE, "tokenizer_recipe": recipe, "vocab_size": vocab_size,
                "eos_id": eos_id, "dtype": shards.dtype_name(shards.dtype_for_vocab(vocab_size)),
                "val_fraction": args.val_fraction, "seed": args.seed, "text_key": args.text_key,
                "shard_tokens": args.shard_tokens, "inputs": [str(Path(i).expanduser()) for i in args.inputs],
                "splits": {s: w.entries for s, w in writers.items()}}
    shards.write_manifest(out, manifest)
    (out / JOURNAL).unlink(missing_ok=True)
    _remove_pending(out, keep=set())
    _remove_stale(out, manifest)
    totals = {s: sum(e["tokens"] for e in w.entries) for s, w in writers.items()}
    docs = {s: sum(e["documents"] for e in w.entries) for s, w in writers.items()}
    say(f"{out}: train {totals['train']:,} tokens ({docs['train']:,} documents), val {totals['val']:,} "
        f"tokens ({docs['val']:,} documents), {manifest['dtype']}, vocab {vocab_size:,}; encoded "
        f"{n_tokens:,} tokens in {elapsed:.1f} s ({n_tokens / max(elapsed, 1e-9):,.0f} tokens/s)")
    return manifest


def _run_units(units, first_unit, encode: EncodeSettings, workers: int, writers, on_shard, *, quiet: bool) -> int:
    """Encode units [first_unit, ...) (in `workers` processes) and hand them to the
    writers in unit order; returns the tokens encoded."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    todo = list(enumerate(units))[first_unit:]
    total = sum(u.size for _, u in todo)
    columns = (TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[tokens]} tokens"),
               TimeElapsedColumn(), TimeRemainingColumn())
    n_tokens = 0
    with Progress(*columns, disable=quiet, transient=False) as progress:
        task = progress.add_task("prepare", total=total, tokens="0")
        if workers == 1:
            _init_worker(encode)
            results = map(encode_unit, (u for _, u in todo))
            pool = None
        else:
            # spawn: a forked child of a process that used tokenizers' thread pool
            # would run single-threaded with a warning, or hang.
            pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, (encode, True))
            results = pool.imap(encode_unit, (u for _, u in todo))
        try:
            for (index, unit), encoded in zip(todo, results):
                for split, writer in writers.items():
                    writer.add(index, encoded[split], on_shard)
                n_tokens += sum(len(t) for t in encoded.values())
                progress.update(task, advance=unit.size, tokens=f"{n_tokens:,}")
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
    return n_tokens


def _resume(out: Path, fingerprint: str, writers: dict, n_units: int, say) -> int:
    """Take up an interrupted run's journal, if it is this run's and all its files
    verify: the writers continue where they were at its last shard. Returns the first
    unit to encode (0 when there is nothing to resume)."""
    journal = _read_json(out / JOURNAL)
    if not journal or journal.get("fingerprint") != fingerprint:
        return 0
    try:
        state = {s: (journal["splits"][s], journal["pending"][s], journal["position"][s]) for s in writers}
    except (KeyError, TypeError):
        return 0  # a journal of another version: start over
    for entries, pending, _ in state.values():
        if len(_verified(out, entries)) != len(entries) or len(_verified(out, pending)) != len(pending):
            say("the journal's files do not verify: starting over")
            return 0
    for split, writer in writers.items():
        writer.restore(*state[split])
    first_unit = min(w.position[0] for w in writers.values())
    kept = sum(len(w.entries) for w in writers.values())
    held = sum(w._buffered for w in writers.values())
    say(f"resuming after {kept} finished shard(s) and {held:,} tokens pending, "
        f"from input unit {first_unit} of {n_units}")
    return first_unit


def _remove_pending(out: Path, keep: set) -> None:
    """Pending files no journal names any more."""
    for path in out.glob(f"{PENDING}*.tokens"):
        if path.name not in keep:
            path.unlink(missing_ok=True)


def _remove_stale(out: Path, manifest: dict) -> None:
    """Shards of an earlier, longer run that the manifest does not name."""
    named = {e["file"] for entries in manifest["splits"].values() for e in entries}
    for split in shards.SPLITS:
        for path in out.glob(f"{split}-*.tokens"):
            if path.name not in named:
                path.unlink()


# ---------------------------------------------------------------- command line


def add_parser(sub) -> None:
    """`planaria data prepare ...` under the `planaria` command's subparsers."""
    data = sub.add_parser("data", help="prepare a text corpus as token shards for training")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    p = data_sub.add_parser("prepare", help="tokenize text into shards with a manifest (docs/data.md)")
    p.add_argument("inputs", nargs="+", help="text files, directories, .jsonl, .parquet, or a Hugging Face "
                                             "dataset directory (save_to_disk)")
    p.add_argument("--out", required=True, help="output directory (data.source of the training config)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or a Hugging Face tokenizer directory")
    p.add_argument("--train-bpe", type=int, default=0, metavar="VOCAB",
                   help="train a byte-level BPE of VOCAB tokens on the inputs instead")
    p.add_argument("--include", action="append", default=[], metavar="PATTERN",
                   help="of the files found in a directory, take those whose path in it matches "
                        "(shell-style, e.g. '*.py'; repeatable; default: all)")
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="of the files found in a directory, leave out those whose path in it matches "
                        "(e.g. '*-packages/*'; repeatable)")
    p.add_argument("--text-key", default="text", help="the text field of JSON lines, Parquet and datasets")
    p.add_argument("--eos", default=None, help="the end-of-text token (default: the tokenizer's)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="documents held out for validation")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard")
    p.add_argument("--workers", type=int, default=1, help="processes encoding in parallel")
    p.add_argument("--seed", type=int, default=0, help="keys the hash that picks validation documents")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        prepare(args)
    except PrepareError as err:
        print(f"planaria data prepare: {err}", file=sys.stderr)
        return 2
    return 0
