"""Token shards: the header is the authority on the token width, damaged shards are
refused with the file and the fix, and many shards read as one stream give exactly the
samples of the same tokens in one array."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from planaria.runtime.config.loading import load_config
from planaria.runtime.config.sections import ConfigError
from planaria.runtime.data import shards
from planaria.runtime.data.token_datasets import TokenDataset, build_dataset, dataset_for


def _prepared(tmp_path, parts: list[np.ndarray], vocab_size: int, eos_id: int = 0, val=None):
    """A prepared directory written with the shard writer and manifest (no tokenizer)."""
    splits = {}
    for split, arrays in (("train", parts), ("val", val or [])):
        entries = []
        for i, tokens in enumerate(arrays):
            name = f"{split}-{i:05d}.tokens"
            checksum = shards.write_shard(tmp_path / name, tokens, vocab_size=vocab_size, eos_id=eos_id)
            entries.append({"file": name, "tokens": len(tokens), "documents": 0,
                            "max_token": int(tokens.max()), "blake2b": checksum})
        splits[split] = entries
    shards.write_manifest(tmp_path, {"format": shards.FORMAT, "version": shards.VERSION,
                                     "vocab_size": vocab_size, "eos_id": eos_id, "splits": splits})
    return tmp_path


def test_token_width_follows_the_vocabulary():
    assert shards.dtype_for_vocab(256) == np.dtype("<u2")
    assert shards.dtype_for_vocab(65_536) == np.dtype("<u2")  # ids 0..65535 fit
    assert shards.dtype_for_vocab(65_537) == np.dtype("<u4")
    assert shards.dtype_for_vocab(128_256) == np.dtype("<u4")


@pytest.mark.parametrize("vocab_size", [4096, 128_256])
def test_shard_round_trip_and_checksum(tmp_path, vocab_size):
    tokens = np.random.default_rng(0).integers(0, vocab_size, size=1000)
    path = tmp_path / "a.tokens"
    checksum = shards.write_shard(path, tokens, vocab_size=vocab_size, eos_id=7)
    header, mapped = shards.open_shard(path)
    assert (header.vocab_size, header.num_tokens, header.eos_id) == (vocab_size, 1000, 7)
    assert header.dtype == shards.dtype_for_vocab(vocab_size)
    np.testing.assert_array_equal(mapped, tokens)
    assert checksum == shards.file_checksum(path)
    assert path.stat().st_size == shards.HEADER_SIZE + 1000 * header.dtype.itemsize


def test_truncated_shard_is_refused_with_the_file_and_the_fix(tmp_path):
    path = tmp_path / "train-00000.tokens"
    shards.write_shard(path, np.arange(100), vocab_size=4096, eos_id=0)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"train-00000\.tokens: shard is truncated \(254 bytes, the header's 100 "
                                         r"uint16 tokens need 264\); run `planaria data prepare` again") as err:
        build_dataset(str(path), seq_len=8, vocab_size=4096, seed=0)
    assert "\n" not in str(err.value)
    _prepared(tmp_path, [np.arange(100)], 4096)
    (tmp_path / "train-00000.tokens").write_bytes((tmp_path / "train-00000.tokens").read_bytes()[:100])
    with pytest.raises(ValueError, match=r"train-00000\.tokens: shard is truncated"):
        build_dataset(str(tmp_path), seq_len=8, vocab_size=4096, seed=0)


def test_uint32_shard_is_never_read_as_uint16(tmp_path):
    tokens = np.array([70_000, 1, 128_000, 5, 65_536, 0] * 20)
    path = tmp_path / "big.tokens"
    shards.write_shard(path, tokens, vocab_size=128_256, eos_id=0)
    # The header says uint32: the ids come back whole, never as pairs of uint16 halves.
    ds = build_dataset(str(path), seq_len=8, vocab_size=128_256, seed=0)
    np.testing.assert_array_equal(np.asarray(ds.tokens), tokens)
    with pytest.raises(ValueError, match=r"data\.dtype: uint16 contradicts .*big\.tokens.*whose header says uint32 "
                                         r"tokens; remove data\.dtype"):
        build_dataset(str(path), seq_len=8, vocab_size=128_256, seed=0, dtype="uint16")
    _prepared(tmp_path, [tokens], 128_256)
    with pytest.raises(ValueError, match=r"data\.dtype: uint16 contradicts .*train-00000\.tokens"):
        build_dataset(str(tmp_path), seq_len=8, vocab_size=128_256, seed=0, dtype="uint16")


def test_headerless_bin_needs_data_dtype(tmp_path):
    path = tmp_path / "corpus.bin"
    np.array([70_000, 1, 2, 3] * 20, dtype="<u4").tofile(path)
    with pytest.raises(ValueError, match=r"data\.dtype: .*corpus\.bin' has no shard header, so its token width is "
                                         r"unknown; set data\.dtype: uint16 .* or uint32"):
        build_dataset(str(path), seq_len=8, vocab_size=128_256, seed=0)
    ds = build_dataset(str(path), seq_len=8, vocab_size=128_256, seed=0, dtype="uint32")
    assert int(np.asarray(ds.tokens).max()) == 70_000
    with pytest.raises(ConfigError, match=r"data\.dtype 'int16' is unknown.*; use uint16 or uint32"):
        load_config(None, ["data.dtype=int16"])


def test_vocabulary_overflow_names_the_shard_and_the_fix(tmp_path):
    _prepared(tmp_path, [np.arange(50), np.arange(950, 1000)], vocab_size=4096)
    with pytest.raises(ValueError, match=r"model\.vocab_size: .*train-00001\.tokens' contains token id 999, which "
                                         r"does not fit vocab_size=512; set model\.vocab_size >= 1000"):
        build_dataset(str(tmp_path), seq_len=8, vocab_size=512, seed=0)
    build_dataset(str(tmp_path), seq_len=8, vocab_size=1000, seed=0)  # the ids fit: accepted


def test_many_shards_give_the_samples_of_one_array(tmp_path):
    """The stream of shards (samples straddle shard ends) yields exactly the batches of
    the same tokens in one array: same permutation, same windows."""
    rng = np.random.default_rng(3)
    parts = [rng.integers(0, 4096, size=n) for n in (37, 100, 5, 64, 211)]
    _prepared(tmp_path, parts, vocab_size=4096)
    ds = build_dataset(str(tmp_path / "manifest.json"), seq_len=8, vocab_size=4096, seed=0)
    assert isinstance(ds.tokens, shards.ShardStream) and len(ds.tokens.parts) == 5
    whole = TokenDataset(np.concatenate(parts), 8, "one array")
    assert ds.num_samples == whole.num_samples == (417 - 1) // 8
    for iteration in range(12):  # several epochs
        for a, b in zip(ds.batch(iteration, 16, seed=9, start=3, count=10), whole.batch(iteration, 16, seed=9, start=3, count=10)):
            assert a.equal(b)


def test_prepared_val_split_and_missing_split(tmp_path):
    _prepared(tmp_path, [np.arange(100) % 50], 4096, val=[np.arange(40) % 7])
    val = build_dataset(str(tmp_path), seq_len=8, vocab_size=4096, seed=0, split="val")
    np.testing.assert_array_equal(np.concatenate(val.tokens.parts), np.arange(40) % 7)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["splits"]["val"] = []
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"data\.source: .* has no 'val' shards; prepare it again .*--val-fraction"):
        build_dataset(str(tmp_path), seq_len=8, vocab_size=4096, seed=0, split="val")


@pytest.mark.parametrize("edit, pattern", [
    (lambda m: m.pop("vocab_size"), r"'vocab_size' is None, not a positive integer"),
    (lambda m: m.update(splits=["train"]), r"'splits' is list, not a mapping of split to shards"),
    (lambda m: m["splits"]["train"][0].pop("file"), r"shard 0 of split 'train' has no valid 'file'"),
    (lambda m: m["splits"]["train"][0].pop("tokens"), r"shard 0 of split 'train' has no valid 'tokens'"),
    (lambda m: m["splits"]["train"][0].pop("max_token"), r"shard 0 of split 'train' has no valid 'max_token'"),
    (lambda m: m["splits"]["train"][0].update(tokens=99),
     r"train-00000\.tokens' holds 100 tokens of vocab 4,096, its manifest says 99 of 4,096"),
])
def test_a_damaged_manifest_is_one_line_naming_it(tmp_path, edit, pattern):
    _prepared(tmp_path, [np.arange(100)], 4096)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    edit(manifest)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    cfg = load_config(None, [f"data.source={tmp_path}", "model.vocab_size=4096", "model.seq_len=8"])
    with pytest.raises(ConfigError, match=r"^data\.source: .*" + pattern + r".*; run `planaria data prepare`") as err:
        dataset_for(cfg, "train")
    assert "\n" not in str(err.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file without read permission")
def test_an_unreadable_shard_is_one_line_naming_it(tmp_path):
    _prepared(tmp_path, [np.arange(100)], 4096)
    (tmp_path / "train-00000.tokens").chmod(0)
    cfg = load_config(None, [f"data.source={tmp_path}", "model.vocab_size=4096", "model.seq_len=8"])
    with pytest.raises(ConfigError, match=r"^data\.source: .*train-00000\.tokens: cannot read the shard "
                                          r"\(Permission denied\); make it readable"):
        dataset_for(cfg, "train")


def test_synthetic_val_split_is_the_same_motifs_in_another_order():
    train = build_dataset("synthetic", seq_len=16, vocab_size=256, seed=1, num_samples=64)
    val = build_dataset("synthetic", seq_len=16, vocab_size=256, seed=1, num_samples=64, split="val")
    assert not np.array_equal(train.tokens, val.tokens)
    motifs = {tuple(train.tokens[i:i + 16]) for i in range(0, len(train.tokens) - 16, 16)}
    assert tuple(val.tokens[:16]) in motifs
