"""Tests for planaria.runtime.data.token_datasets: sources, determinism, slicing, epochs, errors."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from planaria.runtime.data.token_datasets import TokenDataset, build_dataset


def _synthetic(seed=0, vocab=512, seq_len=32, num_samples=256):
    return build_dataset("synthetic", seq_len=seq_len, vocab_size=vocab, seed=seed, num_samples=num_samples)


# ------------------------------------------------------------ determinism


def test_same_iteration_same_tokens_across_objects():
    a, b = _synthetic(seed=3), _synthetic(seed=3)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    for k in (0, 1, 7, 100):
        xa, ya = a.batch(k, 16, seed=11)
        xb, yb = b.batch(k, 16, seed=11)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # A different data seed reorders samples.
    assert not np.array_equal(a.sample_indices(0, 16, 11), a.sample_indices(0, 16, 12))


def test_synthetic_depends_on_seed():
    assert not np.array_equal(_synthetic(seed=0).tokens, _synthetic(seed=1).tokens)


def test_batch_shapes_and_shift():
    ds = _synthetic(seq_len=8)
    x, y = ds.batch(2, 4, seed=0)
    assert x.dtype == torch.long and y.dtype == torch.long
    assert x.shape == (4, 8) and y.shape == (4, 8)
    idx = ds.sample_indices(2, 4, seed=0)
    for row, i in enumerate(idx):
        window = torch.from_numpy(ds.tokens[i * 8 : i * 8 + 9].astype(np.int64))
        assert torch.equal(x[row], window[:-1])
        assert torch.equal(y[row], window[1:])


def test_slices_concatenate_to_full_batch():
    ds = _synthetic()
    full_x, full_y = ds.batch(5, 12, seed=4)
    # Uneven pipeline split: 5 + 4 + 3 samples.
    parts = [ds.batch(5, 12, seed=4, start=s, count=c) for s, c in ((0, 5), (5, 4), (9, 3))]
    assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
    assert torch.equal(torch.cat([p[1] for p in parts]), full_y)
    # count defaults to the rest of the batch.
    tail_x, _ = ds.batch(5, 12, seed=4, start=9)
    assert torch.equal(tail_x, full_x[9:])


# ------------------------------------------------------------ epochs


def test_epochs_wrap_with_fresh_permutations():
    ds = _synthetic(num_samples=100, seq_len=4)
    n, b, seed = ds.num_samples, 7, 9
    assert n == 100
    # 100 iterations of 7 = 700 positions = exactly 7 epochs; batches straddle boundaries.
    stream = np.concatenate([ds.sample_indices(k, b, seed) for k in range(100)])
    epochs = stream.reshape(7, n)
    for e, order in enumerate(epochs):
        assert np.array_equal(np.sort(order), np.arange(n)), f"epoch {e} is not a permutation"
        assert np.array_equal(order, np.random.default_rng([seed, e]).permutation(n))
    assert not np.array_equal(epochs[0], epochs[1])


def test_global_batch_larger_than_dataset():
    ds = _synthetic(num_samples=10, seq_len=4)
    idx = ds.sample_indices(1, 25, seed=0)  # positions 25..49 span epochs 2, 3 and 4
    expected = np.concatenate([np.random.default_rng([0, e]).permutation(10) for e in range(2, 5)])[5:30]
    np.testing.assert_array_equal(idx, expected)


def test_fresh_object_matches_late_iteration():
    # No hidden state: jumping straight to iteration k (as after a restart) gives
    # the same samples as walking there.
    a, b = _synthetic(num_samples=50), _synthetic(num_samples=50)
    for k in range(40):
        a.sample_indices(k, 8, seed=1)
    np.testing.assert_array_equal(a.sample_indices(39, 8, 1), b.sample_indices(39, 8, 1))


# ------------------------------------------------------------ sources


def _conditional_entropy(tokens: np.ndarray, vocab: int) -> tuple[float, float]:
    """(unigram entropy, bigram conditional entropy H(next | prev)) in nats."""
    t = tokens.astype(np.int64)
    uni = np.bincount(t, minlength=vocab).astype(float)
    p = uni[uni > 0] / uni.sum()
    h_uni = float(-(p * np.log(p)).sum())
    pair = np.bincount(t[:-1] * vocab + t[1:], minlength=vocab * vocab).astype(float)
    prev = np.bincount(t[:-1], minlength=vocab).astype(float)
    nz = np.nonzero(pair)[0]
    p_joint = pair[nz] / pair.sum()
    p_cond = pair[nz] / prev[nz // vocab]
    h_bi = float(-(p_joint * np.log(p_cond)).sum())
    return h_uni, h_bi


@pytest.mark.parametrize("vocab", [256, 4096])
def test_synthetic_is_learnable(vocab):
    ds = build_dataset("synthetic", seq_len=64, vocab_size=vocab, seed=0)
    assert ds.num_samples == 4096  # default size
    assert int(ds.tokens.max()) < vocab and int(ds.tokens.min()) >= 0
    h_uni, h_bi = _conditional_entropy(ds.tokens, vocab)
    assert h_uni < math.log(vocab)
    assert h_bi < 0.5 * math.log(vocab), (h_bi, math.log(vocab))


def test_synthetic_deterministic_in_its_parameters():
    a = build_dataset("synthetic", seq_len=16, vocab_size=100, seed=5, num_samples=64)
    b = build_dataset("synthetic", seq_len=16, vocab_size=100, seed=5, num_samples=64)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert len(a.tokens) >= 64 * 16 + 1 and a.num_samples == 64


def test_stdlib_corpus():
    ds = build_dataset("stdlib", seq_len=128, vocab_size=256, seed=0, max_bytes=2**20)
    assert ds.tokens.dtype == np.uint8
    assert 0 < len(ds.tokens) <= 2**20
    assert ds.num_samples > 0
    assert "files" in ds.description and "stdlib" in ds.description
    n_files = int(ds.description.rsplit(",", 1)[1].split()[0].replace(",", ""))
    assert n_files > 0
    # Real source text: mostly ASCII, and Python keywords present.
    assert b"def " in ds.tokens[:200_000].tobytes()
    x, y = ds.batch(0, 4, seed=0)
    assert x.shape == (4, 128) and int(x.max()) < 256
    again = build_dataset("stdlib", seq_len=128, vocab_size=256, seed=0, max_bytes=2**20)
    np.testing.assert_array_equal(ds.tokens, again.tokens)


def test_bin_round_trip(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50_000, size=10 * 32 + 1).astype("<u2")
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    ds = build_dataset(str(path), seq_len=32, vocab_size=50_304, seed=0, dtype="uint16")
    assert isinstance(ds.tokens, np.memmap) and ds.num_samples == 10
    np.testing.assert_array_equal(np.asarray(ds.tokens), tokens)
    x, y = ds.batch(3, 4, seed=2)
    for row, i in enumerate(ds.sample_indices(3, 4, 2)):
        window = tokens[i * 32 : i * 32 + 33].astype(np.int64)
        assert np.array_equal(x[row].numpy(), window[:-1])
        assert np.array_equal(y[row].numpy(), window[1:])


# ------------------------------------------------------------ errors


def test_error_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"data\.source: .*nope\.bin.* not found.*'synthetic' or 'stdlib'"):
        build_dataset(str(tmp_path / "nope.bin"), seq_len=8, vocab_size=256, seed=0, dtype="uint16")


def test_error_empty_file(tmp_path):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"data\.source: .* is empty"):
        build_dataset(str(path), seq_len=8, vocab_size=256, seed=0, dtype="uint16")


def test_error_odd_length(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x00" * 20 + b"\x01")
    with pytest.raises(ValueError, match=r"data\.source: .*byte length \(41\) that is not a multiple of 2"):
        build_dataset(str(path), seq_len=8, vocab_size=256, seed=0, dtype="uint16")


def test_error_too_short(tmp_path):
    path = tmp_path / "short.bin"
    np.arange(8, dtype="<u2").tofile(path)
    with pytest.raises(ValueError, match=r"data\.source: .*holds 8 tokens, too short for one sample.*needs 9"):
        build_dataset(str(path), seq_len=8, vocab_size=256, seed=0, dtype="uint16")


def test_error_token_out_of_vocab(tmp_path):
    path = tmp_path / "big.bin"
    np.array([1, 2, 3, 700, 5] * 10, dtype="<u2").tofile(path)
    with pytest.raises(ValueError, match=r"vocab_size: .*token id 700.*vocab_size=512.*>= 701"):
        build_dataset(str(path), seq_len=4, vocab_size=512, seed=0, dtype="uint16")


def test_error_directory(tmp_path):
    with pytest.raises(ValueError, match=r"data\.source: .*manifest\.json: no manifest of a prepared corpus here; "
                                         r"run `planaria data prepare`"):
        build_dataset(str(tmp_path), seq_len=4, vocab_size=512, seed=0)


def test_error_stdlib_small_vocab():
    with pytest.raises(ValueError, match=r"vocab_size: the 'stdlib' corpus is byte-level and needs vocab_size >= 256, got 100"):
        build_dataset("stdlib", seq_len=8, vocab_size=100, seed=0)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(seq_len=0, vocab_size=256, seed=0), r"seq_len: must be >= 1, got 0"),
        (dict(seq_len=8, vocab_size=1, seed=0), r"vocab_size: must be >= 2, got 1"),
        (dict(seq_len=8, vocab_size=256, seed=-1), r"data\.seed: must be >= 0, got -1"),
        (dict(seq_len=8.0, vocab_size=256, seed=0), r"seq_len: expected an integer"),
    ],
)
def test_error_bad_parameters(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        build_dataset("synthetic", **kwargs)


def test_error_batch_slice_out_of_range():
    ds = _synthetic()
    for start, count in ((0, 17), (10, 7), (16, None), (-1, 2)):
        with pytest.raises(ValueError, match=r"start"):
            ds.batch(0, 16, seed=0, start=start, count=count)
    with pytest.raises(ValueError, match=r"count: must be >= 1, got 0"):
        ds.batch(0, 16, seed=0, start=0, count=0)
    with pytest.raises(ValueError, match=r"iteration: must be >= 0"):
        ds.sample_indices(-1, 16, seed=0)
    with pytest.raises(ValueError, match=r"global_batch: must be >= 1"):
        ds.sample_indices(0, 0, seed=0)


def test_tokendataset_rejects_too_few_tokens():
    with pytest.raises(ValueError, match=r"seq_len: the data has 4 tokens, fewer than one sample"):
        TokenDataset(np.arange(4), seq_len=4, description="tiny")


def test_the_largest_token_is_computed_once_per_version_of_the_file(tmp_path):
    """Workers of an elastic job start again and again; each read the whole corpus for
    its largest token id. It is kept beside the file, and a changed file is read again."""
    path = tmp_path / "train.bin"
    np.array([1, 2, 3, 300, 5] * 10, dtype="<u2").tofile(path)
    build_dataset(str(path), seq_len=4, vocab_size=512, seed=0, dtype="uint16")
    sidecar = tmp_path / "train.bin.maxtoken"
    assert sidecar.read_text().endswith(" 300")
    sidecar.write_text(sidecar.read_text().rsplit(" ", 1)[0] + " 7")  # what a later start reads
    build_dataset(str(path), seq_len=4, vocab_size=8, seed=0, dtype="uint16")  # trusted: no pass over the file
    np.array([1, 2, 3, 700, 5] * 10, dtype="<u2").tofile(path)  # the file changes: read again
    os.utime(path, ns=(0, 10**9))
    with pytest.raises(ValueError, match=r"token id 700"):
        build_dataset(str(path), seq_len=4, vocab_size=512, seed=0, dtype="uint16")
    (tmp_path / "train.bin.maxtoken").write_text("garbage")
    with pytest.raises(ValueError, match=r"token id 700"):
        build_dataset(str(path), seq_len=4, vocab_size=512, seed=0, dtype="uint16")


def test_a_shuffle_prepared_ahead_is_the_one_the_batch_then_reads(monkeypatch):
    """A joiner prepares its data's shuffle while it waits (`TokenDataset.prepare`): the
    batch of that iteration then shuffles nothing more, and is the batch a dataset that
    prepared nothing reads."""
    tokens = np.arange(10_000) % 251
    prepared = TokenDataset(tokens, seq_len=8, description="prepared")
    fresh = TokenDataset(tokens, seq_len=8, description="fresh")
    iteration, batch = 700, 4  # data epoch 2 of 1,249 samples
    prepared.prepare(iteration, batch, seed=3)
    shuffles = []
    real = np.random.default_rng
    monkeypatch.setattr(np.random, "default_rng", lambda *a, **k: (shuffles.append(a), real(*a, **k))[1])
    got = prepared.batch(iteration, batch, 3)
    assert shuffles == []
    want = fresh.batch(iteration, batch, 3)
    assert len(shuffles) == 1 and all(torch.equal(a, b) for a, b in zip(got, want))
