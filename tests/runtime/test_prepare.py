"""`planaria data prepare` on real text: a slice of the standard library's source with a
byte-level BPE of 4096 trained here (uint16 shards) and with a 128k vocabulary whose high
ids really occur (uint32 shards); the same documents in every input format give the same
shards; workers, interruptions and reruns do not change the output; every bad input is
one line naming the file or option and the fix; and training on each corpus lowers the
validation loss."""
from __future__ import annotations

import collections
import contextlib
import json
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from planaria.cli import build_parser
from planaria.runtime.config.loading import load_config
from planaria.runtime.data import corpus as inputs
from planaria.runtime.data import prepare as prep
from planaria.runtime.data import shards
from planaria.runtime.data.token_datasets import _stdlib_files, build_dataset, dataset_for
from planaria.runtime.models.llama import LayerModel
from planaria.runtime.parallel.reference import build_reference_model
from tests.launch import TINY, read_metrics, torchrun_train

N_FILES = 300
LLAMA3_VOCAB = 128_256


@contextlib.contextmanager
def one_torch_thread():
    """Tiny models on a small shared machine: threads only contend (16x slower with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _args(*argv):
    return build_parser().parse_args(["data", "prepare", *map(str, argv), "--quiet"])


def _cli(*argv, check=True):
    """The `planaria` command as a user runs it, in a process of its own."""
    proc = subprocess.run([sys.executable, "-m", "planaria.cli", "data", "prepare", *map(str, argv)],
                          capture_output=True, text=True, timeout=240)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def stdlib_slice(tmp_path_factory) -> Path:
    """A few hundred files of the standard library's source, copied with their paths."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root = tmp_path_factory.mktemp("stdlib")
    picked = [p for p in _stdlib_files(stdlib) if 0 < p.stat().st_size < 40_000][:N_FILES]
    for path in picked:
        target = root / path.relative_to(stdlib)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    return root


def _texts(root: Path) -> list[str]:
    files = sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.relative_to(root).as_posix())
    return [p.read_bytes().decode("utf-8", errors="replace") for p in files]


@pytest.fixture(scope="module")
def bpe_corpus(stdlib_slice, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe4096")
    _cli(stdlib_slice, "--out", out, "--train-bpe", 4096, "--shard-tokens", 100_000, "--val-fraction", 0.05)
    return out


@pytest.fixture(scope="module")
def big_tokenizer(bpe_corpus, stdlib_slice, tmp_path_factory) -> Path:
    """The 4096 BPE padded to LLaMA 3's 128,256 tokens; the slice's most frequent
    identifiers are the last ones added, so ids above 65,535 occur all over the text."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(bpe_corpus / "tokenizer.json"))
    words = collections.Counter(w for text in _texts(stdlib_slice) for w in re.findall(r"[A-Za-z_]{7,}", text))
    common = [w for w, _ in words.most_common(300) if tokenizer.token_to_id(w) is None]
    tokenizer.add_tokens([f"<|reserved_{i}|>" for i in range(LLAMA3_VOCAB - 4096 - len(common))])
    tokenizer.add_tokens(common)
    assert tokenizer.get_vocab_size() == LLAMA3_VOCAB
    path = tmp_path_factory.mktemp("tok128k") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def big_corpus(big_tokenizer, stdlib_slice, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("big")
    _cli(stdlib_slice, "--out", out, "--tokenizer", big_tokenizer, "--shard-tokens", 100_000,
         "--val-fraction", 0.05)
    return out


def _decode_docs(corpus: Path, split: str) -> list[str]:
    from tokenizers import Tokenizer

    manifest = shards.read_manifest(corpus)
    tokenizer = Tokenizer.from_file(str(corpus / manifest["tokenizer"]))
    stream = np.concatenate([shards.open_shard(corpus / e["file"])[1] for e in manifest["splits"][split]])
    ends = np.flatnonzero(stream == manifest["eos_id"])
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(stream[a:b].tolist(), skip_special_tokens=False) for a, b in zip(starts, ends)]


def test_bpe_4096_on_the_standard_library(bpe_corpus, stdlib_slice):
    manifest = shards.read_manifest(bpe_corpus)
    assert (manifest["vocab_size"], manifest["dtype"]) == (4096, "uint16")
    assert (bpe_corpus / "tokenizer.json").is_file()
    texts = _texts(stdlib_slice)
    train, val = _decode_docs(bpe_corpus, "train"), _decode_docs(bpe_corpus, "val")
    # Every file is one document, in one split, decoded back to its text; the held-out
    # ones are those the keyed hash picks.
    assert len(train) + len(val) == len(texts) == N_FILES
    assert 0 < len(val) < N_FILES * 0.15
    expected_val = [t for t in texts if prep.in_val(t, 0.05, 0)]
    assert val == expected_val and train == [t for t in texts if not prep.in_val(t, 0.05, 0)]
    for split in shards.SPLITS:
        for entry in manifest["splits"][split]:
            path = bpe_corpus / entry["file"]
            assert shards.file_checksum(path) == entry["blake2b"]
            assert shards.read_header(path).num_tokens == entry["tokens"] <= 100_000
    assert len(manifest["splits"]["train"]) > 3


def test_128k_vocabulary_writes_uint32_and_reads_it_back(big_corpus, bpe_corpus, stdlib_slice):
    manifest = shards.read_manifest(big_corpus)
    assert (manifest["vocab_size"], manifest["dtype"]) == (LLAMA3_VOCAB, "uint32")
    ds = build_dataset(str(big_corpus), seq_len=32, vocab_size=LLAMA3_VOCAB, seed=0)
    tokens = np.concatenate(ds.tokens.parts)
    high = np.count_nonzero(tokens > 65_535)
    assert high > 1000 and tokens.max() < LLAMA3_VOCAB
    texts = _texts(stdlib_slice)
    assert _decode_docs(big_corpus, "train") == [t for t in texts if not prep.in_val(t, 0.05, 0)]
    # The width is in the header: a config that says uint16 is refused, not obeyed.
    with pytest.raises(ValueError, match=r"data\.dtype: uint16 contradicts .*whose header says uint32"):
        build_dataset(str(big_corpus), seq_len=32, vocab_size=LLAMA3_VOCAB, seed=0, dtype="uint16")
    with pytest.raises(ValueError, match=r"model\.vocab_size: .*train-00000\.tokens' contains token id \d+, which "
                                         r"does not fit vocab_size=65536; set model\.vocab_size >= \d+"):
        build_dataset(str(big_corpus), seq_len=32, vocab_size=65_536, seed=0)


def _shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.tokens"))}


def test_workers_interruptions_and_reruns_give_the_same_shards(bpe_corpus, stdlib_slice, tmp_path, monkeypatch):
    monkeypatch.setattr(inputs, "UNIT_BYTES", 64 << 10)  # many units, so that two workers share them
    tokenizer = bpe_corpus / "tokenizer.json"
    common = ["--tokenizer", tokenizer, "--shard-tokens", 30_000, "--val-fraction", 0.05]
    prep.prepare(_args(stdlib_slice, "--out", tmp_path / "one", *common))
    prep.prepare(_args(stdlib_slice, "--out", tmp_path / "two", *common, "--workers", 2))
    reference = _shard_bytes(tmp_path / "one")
    assert len(reference) > 10 and _shard_bytes(tmp_path / "two") == reference

    # Interrupted while writing the fourth shard: the rerun keeps the three (verified) and
    # the tokens pending since, and encodes only the units after the last shard.
    real_write, real_encode = shards.write_shard, prep.encode_unit
    written, encoded = [], []

    def write(path, *a, **k):
        if not path.name.startswith(prep.PENDING):
            if len(written) == 3:
                raise KeyboardInterrupt
            written.append(path.name)
        return real_write(path, *a, **k)

    def count(unit):
        encoded.append(unit)
        return real_encode(unit)

    monkeypatch.setattr(shards, "write_shard", write)
    monkeypatch.setattr(prep, "encode_unit", count)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(_args(stdlib_slice, "--out", tmp_path / "cut", *common))
    assert not (tmp_path / "cut" / "manifest.json").exists()
    assert not [p for p in (tmp_path / "cut").iterdir() if ".tmp" in p.name]  # nothing half-written
    n_units = len(inputs.discover([stdlib_slice], "text", (), ()))
    before = len(encoded)
    encoded.clear()

    def record(path, *a, **k):
        if not path.name.startswith(prep.PENDING):
            written.append(path.name)
        return real_write(path, *a, **k)

    monkeypatch.setattr(shards, "write_shard", record)
    prep.prepare(_args(stdlib_slice, "--out", tmp_path / "cut", *common))
    assert _shard_bytes(tmp_path / "cut") == reference
    assert not list((tmp_path / "cut").glob(prep.PENDING + "*"))
    assert len(written) == len(reference)  # the three kept shards were not written again
    # Redone: the units between the third shard and the interruption, no more (a shard
    # spans about two units here).
    assert 0 < before < n_units and before + len(encoded) <= n_units + 3, (before, len(encoded), n_units)

    # A rerun over a finished directory rewrites nothing; a damaged shard is redone.
    written.clear()
    prep.prepare(_args(stdlib_slice, "--out", tmp_path / "cut", *common))
    assert written == []
    victim = tmp_path / "cut" / "train-00004.tokens"
    victim.write_bytes(victim.read_bytes()[:-2] + b"\xff\xff")
    prep.prepare(_args(stdlib_slice, "--out", tmp_path / "cut", *common))
    assert _shard_bytes(tmp_path / "cut") == reference


def test_every_input_format_gives_the_same_shards(bpe_corpus, stdlib_slice, tmp_path):
    """Text files, JSON lines, Parquet and a saved Hugging Face dataset of the same
    documents in the same order are the same corpus."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = _texts(stdlib_slice)[:60]
    (tmp_path / "txt").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "txt" / f"{i:03d}.py").write_text(text, encoding="utf-8")
    with open(tmp_path / "docs.jsonl", "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"body": text, "id": 1}) + "\n")
    pq.write_table(pa.table({"body": texts}), tmp_path / "docs.parquet", row_group_size=17)
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(tmp_path / "hf"))
    common = ["--tokenizer", bpe_corpus / "tokenizer.json", "--shard-tokens", 5000, "--val-fraction", 0.1,
              "--text-key", "body"]
    outputs = {}
    for name in ("txt", "docs.jsonl", "docs.parquet", "hf"):
        prep.prepare(_args(tmp_path / name, "--out", tmp_path / f"out-{name}", *common))
        outputs[name] = _shard_bytes(tmp_path / f"out-{name}")
    assert len(outputs["txt"]) > 4
    assert all(o == outputs["txt"] for o in outputs.values())
    # The progress bar counts bytes for every format (a dataset's rows too).
    text_bytes = sum(len(t.encode()) for t in texts)
    for name in ("txt", "hf"):
        size = sum(u.size for u in inputs.discover([tmp_path / name], "body"))
        assert text_bytes <= size < 1.1 * text_bytes, (name, size, text_bytes)


def _one_line_error(proc, pattern: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(pattern, lines[0]), proc.stderr


def test_include_and_exclude_choose_the_files_of_a_directory(bpe_corpus, tmp_path):
    """A corpus directory with other things in it (here a package directory beside the
    text and a Parquet file of another shape): the patterns pick the text alone."""
    root = tmp_path / "corpus"
    (root / "site-packages" / "pkg").mkdir(parents=True)
    (root / "a.py").write_text("def a():\n    return 1\n")
    (root / "notes.txt").write_text("a note, not code\n")
    (root / "site-packages" / "pkg" / "b.py").write_text("import os\n")
    (root / "site-packages" / "pkg" / "table.parquet").write_bytes(b"PAR1 not a corpus")
    tokenizer = bpe_corpus / "tokenizer.json"
    out = tmp_path / "out"
    prep.prepare(_args(root, "--out", out, "--tokenizer", tokenizer, "--val-fraction", 0,
                       "--include", "*.py", "--exclude", "*-packages/*"))
    assert _decode_docs(out, "train") == ["def a():\n    return 1\n"]
    _one_line_error(_cli(root, "--out", tmp_path / "none", "--tokenizer", tokenizer, "--include", "*.rs",
                         check=False), r"no text found in .* \(with --include \['\*\.rs'\] and --exclude \[\]\)")


def test_bad_inputs_are_one_line_errors(stdlib_slice, bpe_corpus, tmp_path):
    out = tmp_path / "out"
    _one_line_error(_cli(stdlib_slice, "--out", out, "--tokenizer", tmp_path / "nope.json", check=False),
                    r"--tokenizer .*nope\.json: not found; give a tokenizer\.json, a Hugging Face tokenizer "
                    r"directory, or --train-bpe VOCAB")
    sentencepiece = tmp_path / "sp"
    sentencepiece.mkdir()
    (sentencepiece / "tokenizer.model").write_bytes(b"\0")
    _one_line_error(_cli(stdlib_slice, "--out", out, "--tokenizer", sentencepiece, check=False),
                    r"--tokenizer .*sp: no tokenizer\.json in that directory \(a SentencePiece tokenizer\.model")
    _one_line_error(_cli(stdlib_slice, "--out", out, check=False), r"give a tokenizer .* or --train-bpe VOCAB")
    _one_line_error(_cli(stdlib_slice, "--out", out, "--tokenizer", bpe_corpus / "tokenizer.json",
                         "--eos", "<|eot|>", check=False),
                    r"tokenizer .*tokenizer\.json: no end-of-text token among \['<\|eot\|>'\]; name the one")
    (tmp_path / "docs.jsonl").write_text('{"text": "a"}\n{"content": "b"}\n')
    _one_line_error(_cli(tmp_path / "docs.jsonl", "--out", out, "--tokenizer", bpe_corpus / "tokenizer.json",
                         check=False),
                    r"docs\.jsonl: the line at byte 14 has no text field 'text'; name the field with --text-key")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "docs.parquet")
    _one_line_error(_cli(tmp_path / "docs.parquet", "--out", out, "--tokenizer", bpe_corpus / "tokenizer.json",
                         check=False),
                    r"docs\.parquet: no column 'text' \(columns: \['content'\]\); name the text column with --text-key")
    _one_line_error(_cli(tmp_path / "missing", "--out", out, "--train-bpe", 512, check=False),
                    r"input .*missing' not found")
    bad_config = tmp_path / "bad-config"
    bad_config.mkdir()
    shutil.copyfile(bpe_corpus / "tokenizer.json", bad_config / "tokenizer.json")
    (bad_config / "tokenizer_config.json").write_text("{not json")
    _one_line_error(_cli(stdlib_slice, "--out", out, "--tokenizer", bad_config, check=False),
                    r"bad-config/tokenizer_config\.json: not a readable tokenizer_config\.json \(.*\); fix or "
                    r"remove it, or name the end-of-text token with --eos TOKEN")
    _one_line_error(_cli(stdlib_slice, "--out", stdlib_slice / "shards", "--train-bpe", 512, check=False),
                    r"--out .*shards: inside the input directory .*; write the shards elsewhere")
    assert not (stdlib_slice / "shards").exists()
    _one_line_error(_cli(stdlib_slice, "--out", tmp_path / "docs.jsonl" / "out", "--train-bpe", 512, check=False),
                    r"--out .*docs\.jsonl/out: cannot make the directory \(Not a directory\); give a directory")


def test_a_broken_link_in_an_input_directory_is_skipped(bpe_corpus, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("def f():\n    return 1\n" * 50)
    (docs / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    manifest = prep.prepare(_args(docs, "--out", tmp_path / "out", "--tokenizer", bpe_corpus / "tokenizer.json",
                                  "--val-fraction", 0))
    assert sum(e["documents"] for e in manifest["splits"]["train"]) == 1


# ---------------------------------------------------------------- training on the corpora


def _untrained_val_loss(cfg, batches: int) -> float:
    """The validation loss of the model as initialised, on the samples the trainer's
    evaluations use (the first `batches` global batches of the split's order)."""
    val = dataset_for(cfg, "val")
    net = build_reference_model(LayerModel(cfg.model, seed=cfg.train.seed), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        losses = [F.cross_entropy(net(x).flatten(0, 1), y.flatten()).item()
                  for x, y in (val.batch(i, cfg.train.global_batch, cfg.data.seed) for i in range(batches))]
    return sum(losses) / len(losses)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("which, vocab", [("bpe_corpus", 4096),
                                          pytest.param("big_corpus", LLAMA3_VOCAB, marks=pytest.mark.slow)])
def test_training_on_a_prepared_corpus_lowers_the_validation_loss(which, vocab, request, tmp_path):
    """`python -m planaria.train` on the shards, evaluating on the held-out documents."""
    corpus = request.getfixturevalue(which)
    # A step of the 128k head costs thirty of the 4096 one: fewer, smaller steps.
    steps, batch = (40, 8) if vocab < 65_536 else (12, 4)
    job = [f"data.source={corpus}", f"model.vocab_size={vocab}", "model.d_model=64", "model.n_layers=2",
           "model.n_heads=4", "model.seq_len=32", f"train.steps={steps}", f"train.global_batch={batch}",
           f"train.micro_batch={batch}", "train.lr=1e-2", "train.min_lr=1e-3", "train.warmup_steps=0",
           "train.weight_decay=0", "eval.every=4", "eval.batches=4", "output.save_final=false",
           "train.log_every=100"]
    torchrun_train(1, job, tmp_path)
    evals = [m["val_loss"] for m in read_metrics(tmp_path) if "val_loss" in m]
    assert len(evals) == steps // 4
    with one_torch_thread():
        before = _untrained_val_loss(load_config(TINY, job), batches=4)
    print(f"validation loss {before:.3f} untrained, then {', '.join(f'{v:.3f}' for v in evals)}")
    assert before > np.log(vocab) - 1.0  # the untrained model knows nothing of the text
    assert evals[-1] < evals[0] < before and evals[-1] < before - 1.0


def test_a_hugging_face_tokenizer_directory_names_its_end_of_text(bpe_corpus, stdlib_slice, tmp_path):
    """The eos_token of the tokenizer_config.json beside tokenizer.json separates the
    documents, and both files are kept with the shards for export."""
    from tokenizers import AddedToken, Tokenizer

    hf = tmp_path / "hf-tokenizer"
    hf.mkdir()
    tokenizer = Tokenizer.from_file(str(bpe_corpus / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken("<|eot|>", special=True)])
    tokenizer.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|eot|>"}}))
    out = tmp_path / "out"
    prep.prepare(_args(stdlib_slice, "--out", out, "--tokenizer", hf, "--val-fraction", 0.05))
    manifest = shards.read_manifest(out)
    assert manifest["eos_id"] == 4096 == tokenizer.token_to_id("<|eot|>")
    assert (out / "tokenizer_config.json").read_text() == (hf / "tokenizer_config.json").read_text()
    docs = sum(e["documents"] for split in manifest["splits"].values() for e in split)
    assert docs == N_FILES


def test_another_tokenizer_into_the_same_directory_never_pairs_with_the_old_manifest(bpe_corpus, stdlib_slice,
                                                                                      tmp_path):
    """A rerun with another tokenizer leaves no stale tokenizer_config.json to name the
    end-of-text token, and one that fails leaves the manifest with the tokenizer it describes."""
    from tokenizers import AddedToken, Tokenizer

    hf, bare = tmp_path / "hf-tokenizer", tmp_path / "bare"
    hf.mkdir()
    bare.mkdir()
    tokenizer = Tokenizer.from_file(str(bpe_corpus / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken("<|eot|>", special=True)])
    tokenizer.save(str(hf / "tokenizer.json"))
    tokenizer.save(str(bare / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>"}))
    out = tmp_path / "out"
    common = ["--out", out, "--val-fraction", 0.05, "--shard-tokens", 200_000]
    prep.prepare(_args(stdlib_slice, "--tokenizer", hf, *common))
    assert shards.read_manifest(out)["eos_id"] == tokenizer.token_to_id("<|eot|>")

    # Without a config, the usual name separates documents, not the earlier run's <|eot|>.
    prep.prepare(_args(stdlib_slice, "--tokenizer", bare / "tokenizer.json", *common))
    assert shards.read_manifest(out)["eos_id"] == tokenizer.token_to_id("<|endoftext|>") == 0
    assert not (out / "tokenizer_config.json").exists()

    with pytest.raises(inputs.PrepareError, match="no end-of-text token"):
        prep.prepare(_args(stdlib_slice, "--tokenizer", bpe_corpus / "tokenizer.json", "--eos", "<|nope|>",
                           *common))
    if (out / "manifest.json").exists():
        assert (out / "tokenizer.json").read_bytes() == (bare / "tokenizer.json").read_bytes()
