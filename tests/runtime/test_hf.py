"""Hugging Face LLaMA in and out (planaria.runtime.models.hf_weights): logits equal to
transformers.LlamaForCausalLM in float64 through `model.init_from` and through
`planaria export hf`, a round trip under pp=2 x tp=2, and one-line refusals.

The Hugging Face side runs in true float64: see tests/runtime/hf_helpers.py for the
two float32 computations of transformers that the tests patch, and how.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from planaria.runtime.config.hf_config import check_init_from
from planaria.runtime.config.loading import load_config
from planaria.runtime.config.sections import ConfigError, ModelConfig
from planaria.runtime.data.token_datasets import dataset_for
from planaria.runtime.models.hf_weights import HFCheckpoint, from_hf_rows, to_hf_rows
from planaria.runtime.models.llama import LayerModel
from planaria.runtime.models.tensor_parallel import TensorParallel
from planaria.runtime.state.hf_export import export_hf, find_saved_model
from tests.launch import REPO, TINY, assert_final_parameters, read_metrics, reference_run, torchrun_train
from tests.runtime.hf_helpers import float64_llama, random_llama

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# name: (random_llama arguments, the same model as Planaria's overrides)
CASES = {
    "multi-head": ({}, []),
    "grouped-query": ({"n_kv_heads": 2}, ["model.n_kv_heads=2"]),
    "tied-embeddings": ({"tied": True}, ["model.tie_embeddings=true"]),
    "rope-scaling": ({"rope_scaling": LLAMA3_SCALING}, ["model.rope_scaling=" + json.dumps(LLAMA3_SCALING)]),
}


def planaria_logits(model: ModelConfig, tokens: torch.Tensor, seed: int = 0,
                    states: dict | None = None) -> torch.Tensor:
    """Planaria's layers at tp = 1, float64, PyTorch reference kernels, run in order;
    `states` (layer -> state_dict) replaces the parameters the layers are built with."""
    layer_model = LayerModel(replace(model, kernels="reference"), seed=seed)
    x = tokens
    with torch.no_grad():
        for i in range(layer_model.num_layers):
            layer = layer_model.build_layer(i, TensorParallel(), torch.float64, torch.device("cpu"),
                                            pretrained=True)
            if states is not None:
                layer.load_state_dict(states[i])
            x = layer(x)
    return x


def tokens_for(vocab: int, batch: int = 2, length: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_rotary_permutation_round_trips_and_matches_the_conversion_script():
    w = torch.randn(4 * 8, 5)
    hf = to_hf_rows(w, heads=4)
    assert torch.equal(from_hf_rows(hf, heads=4), w)
    # convert_llama_weights_to_hf's permute, written out for one head of size 8: row
    # (half a, index i) of Hugging Face's layout is Planaria's pair i, element a.
    head = w[:8]
    assert torch.equal(hf[:8], torch.stack([head[2 * i + a] for a in (0, 1) for i in range(4)]))


@pytest.mark.parametrize("case", list(CASES))
def test_init_from_gives_hugging_face_logits_in_float64(case, tmp_path, monkeypatch):
    hf = random_llama(**CASES[case][0])
    hf.save_pretrained(tmp_path / "hf")
    cfg = load_config(None, [f"model.init_from={tmp_path / 'hf'}", "model.seq_len=16"])
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.ffn_dim, cfg.model.vocab_size) == (2, 32, 72, 96)
    tokens = tokens_for(96)
    expected = float64_llama(hf, monkeypatch)(tokens).logits
    got = planaria_logits(cfg.model, tokens)
    assert (got - expected).abs().max().item() <= 1e-10


@pytest.mark.parametrize("n_kv_heads,tp", [(4, 2), (2, 2), (2, 4), (1, 2)],
                         ids=["multi-head-tp2", "gqa-split-tp2", "gqa-replicated-tp4", "mqa-tp2"])
def test_init_from_reads_a_sharded_checkpoint_and_only_its_tp_shard(n_kv_heads, tp, tmp_path):
    """Each tp rank's layer, read from a checkpoint saved in several files, is its shard
    of the layer read whole (`LayerModel.shard` of the full parameters), key/value
    heads split or replicated."""
    hf = random_llama(n_kv_heads=n_kv_heads)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    cfg = load_config(None, [f"model.init_from={tmp_path / 'hf'}", "model.seq_len=16",
                             f"parallel.tp={tp}"]).model
    layer_model = LayerModel(cfg, seed=0)
    for index in range(layer_model.num_layers):
        full = layer_model.build_layer(index, TensorParallel(), torch.float64, torch.device("cpu"), pretrained=True)
        for rank in range(tp):
            piece = layer_model.build_layer(index, TensorParallel(rank=rank, size=tp), torch.float64,
                                            torch.device("cpu"), pretrained=True)
            for name, value in piece.state_dict().items():
                expected = layer_model.shard(index, name, full.state_dict()[name], rank, tp)
                assert torch.equal(value, expected), (index, name, rank)


def _train(tmp_path: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    """One process of `python -m planaria.train` (tp = 1)."""
    cmd = [sys.executable, "-m", "planaria.train", str(TINY), "data.source=synthetic",
           "model.seq_len=16", "train.global_batch=4", "train.micro_batch=2", "train.log_every=100",
           "parallel.pp=1", *overrides, f"output.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_export_gives_the_same_logits_in_transformers(case, tmp_path, monkeypatch):
    """Planaria's model, trained two steps (norm gains no longer ones), exported, loaded
    by transformers in float64: the same logits."""
    _train(tmp_path / "run", ["model.n_layers=2", "model.d_model=32", "model.n_heads=4",
                              "model.vocab_size=96", "model.rope_theta=5000", "train.steps=2",
                              "train.dtype=float64", "train.lr=0.01", *CASES[case][1]])
    saved, what = find_saved_model(tmp_path / "run")
    assert saved.kind == "final" and "final" in what
    export_hf(saved, tmp_path / "hf", max_shard_size=10_000)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64,
                                                           attn_implementation="sdpa")
    tokens = tokens_for(96)
    expected = float64_llama(hf, monkeypatch)(tokens).logits
    got = planaria_logits(saved.model, tokens, states=dict(saved.layers()))
    assert (got - expected).abs().max().item() <= 1e-10


def _read_all(directory: Path) -> dict[str, torch.Tensor]:
    with HFCheckpoint(directory) as ckpt:
        return {name: ckpt.read(name) for name in ckpt._files}


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_round_trip_under_pp2_tp2(tmp_path):
    """HF checkpoint -> init_from under pp=2 x tp=2 -> 0 steps -> export: the same
    tensors, bit for bit. Then 3 steps in float32: the exported model's loss in
    transformers on the validation batch equals Planaria's last evaluation of it."""
    transformers = pytest.importorskip("transformers")
    # One key/value head (multi-query): replicated on both tp ranks.
    hf = random_llama(n_layers=4, seed=3, n_kv_heads=1).to(torch.float32)
    for p in hf.parameters():  # a model that trains: small weights, unit norm gains
        p.data = torch.ones_like(p) if p.dim() == 1 else p.data * 0.1
    hf.save_pretrained(tmp_path / "hf")
    # No model section but the checkpoint and the training length: the shape is config.json's.
    config = tmp_path / "job.yaml"
    config.write_text(f"model:\n  init_from: {tmp_path / 'hf'}\n  seq_len: 16\n")
    job = ["data.source=synthetic", "train.global_batch=8", "train.micro_batch=2",
           "train.dtype=float32", "train.lr=0.01", "train.log_every=100", "parallel.pp=2", "parallel.tp=2"]
    torchrun_train(4, [*job, "train.steps=0"], tmp_path / "zero", config=config, timeout=400)
    saved, _ = find_saved_model(tmp_path / "zero")
    assert saved.tp == 2
    export_hf(saved, tmp_path / "zero-hf")
    original, exported = _read_all(tmp_path / "hf"), _read_all(tmp_path / "zero-hf")
    assert sorted(original) == sorted(exported)
    for name, value in original.items():
        assert torch.equal(exported[name], value), name

    torchrun_train(4, [*job, "train.steps=3", "checkpoint.every=2", "eval.every=3", "eval.batches=1"],
                   tmp_path / "run", config=config, timeout=400)
    saved, what = find_saved_model(tmp_path / "run")
    assert saved.kind == "final"
    export_hf(saved, tmp_path / "run-hf")
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run-hf", dtype=torch.float32)
    # Planaria's last evaluation: the validation split's first global batch, after step 3.
    last_eval = read_metrics(tmp_path / "run")[-1]["val_loss"]
    cfg = load_config(config, [*job, f"output.dir={tmp_path / 'run'}"])
    inputs, targets = dataset_for(cfg, "val").batch(0, cfg.train.global_batch, cfg.data.seed)
    with torch.no_grad():
        hf_loss = torch.nn.functional.cross_entropy(trained(inputs).logits.flatten(0, 1).double(),
                                                    targets.flatten()).item()
    assert abs(hf_loss - last_eval) < 1e-5, (hf_loss, last_eval)
    assert not torch.equal(_read_all(tmp_path / "run-hf")["lm_head.weight"], original["lm_head.weight"])

    checkpoint, what = find_saved_model(tmp_path / "run" / "checkpoints")
    assert checkpoint.kind == "checkpoint" and "iteration 1" in what
    export_hf(checkpoint, tmp_path / "checkpoint-hf")
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-hf")


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_init_from_under_a_heterogeneous_plan_trains_as_one_process(tmp_path):
    """Every replica of a layer reads it from the checkpoint: pipelines [[2],[1,1]] (the
    first holds both blocks, the second splits them over two stages) train a GQA
    checkpoint in float64 exactly as a single process does."""
    random_llama(n_kv_heads=2).save_pretrained(tmp_path / "hf")
    config = tmp_path / "job.yaml"
    config.write_text(f"model:\n  init_from: {tmp_path / 'hf'}\n  seq_len: 16\n")
    job = ["data.source=synthetic", "train.steps=3", "train.global_batch=8", "train.micro_batch=1",
           "train.dtype=float64", "train.lr=0.01", "train.log_every=100",
           "parallel.layout=[[2],[1,1]]", "parallel.microbatches=[3,5]"]
    torchrun_train(3, job, tmp_path / "run", config=config)
    reference = reference_run(job, config=config)
    losses = [m["loss"] for m in read_metrics(tmp_path / "run")]
    assert len(losses) == 3
    for loss, expected in zip(losses, reference.losses):
        assert abs(loss - expected) < 1e-9, (loss, expected)
    assert_final_parameters(tmp_path / "run" / "final", reference)


# ------------------------------------------------------------------ refusals
def _refusal(overrides: list[str]) -> str:
    """The message of the refusal at start (`load_config`, then `check_init_from`, which
    the trainer and the elastic launcher run before any process group)."""
    with pytest.raises(ConfigError) as err:
        check_init_from(load_config(None, overrides))
    message = str(err.value)
    assert "\n" not in message
    return message


def test_refusals_are_one_line_and_name_the_fix(tmp_path):
    hf = random_llama()
    hf.save_pretrained(tmp_path / "hf")
    init = f"model.init_from={tmp_path / 'hf'}"

    assert "is not a directory" in _refusal([f"model.init_from={tmp_path / 'nowhere'}"])
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in _refusal([f"model.init_from={tmp_path / 'empty'}"])

    agreeing = load_config(None, [init, "model.n_layers=2", "model.n_kv_heads=0", "model.seq_len=16"])
    assert (agreeing.model.n_layers, agreeing.model.kv_heads, agreeing.model.d_model) == (2, 4, 32)
    assert "model.n_layers=3 disagrees with" in _refusal([init, "model.n_layers=3"])
    assert "num_hidden_layers=2" in _refusal([init, "model.n_layers=3"])

    other = tmp_path / "mistral"
    other.mkdir()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"],
                                                   "model_type": "mistral"}))
    assert "MistralForCausalLM" in _refusal([f"model.init_from={other}"])

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "hidden_size"}))
    assert "lacks hidden_size" in _refusal([f"model.init_from={partial}"])

    wrong = tmp_path / "wrong-ffn"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    (wrong / "model.safetensors").symlink_to(tmp_path / "hf" / "model.safetensors")
    message = _refusal([f"model.init_from={wrong}"])
    assert "model.layers.0.mlp.gate_proj.weight is (72, 32)" in message
    assert "gives (80, 32): set model.ffn_hidden=72" in message

    from safetensors.torch import load_file, save_file

    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text(json.dumps(config))
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    assert "has no tensor model.layers.0.mlp.up_proj.weight" in _refusal([f"model.init_from={missing}"])
    job = tmp_path / "job.yaml"
    job.write_text(f"model:\n  init_from: {missing}\n  seq_len: 16\n")
    train = [sys.executable, "-m", "planaria.train", str(job), "data.source=synthetic", "parallel.pp=1"]
    proc = subprocess.run(train, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "has no tensor model.layers.0.mlp.up_proj.weight" in proc.stdout
    assert "process group" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr

    index = tmp_path / "bad-index"
    index.mkdir()
    (index / "config.json").write_text(json.dumps(config))
    (index / "model.safetensors.index.json").write_text('{"metadata": {}}')
    message = _refusal([f"model.init_from={index}"])
    assert "model.safetensors.index.json is not a safetensors index" in message
    (index / "model.safetensors.index.json").write_text('{"weight_map": ')
    assert "model.safetensors.index.json is not a safetensors index" in _refusal([f"model.init_from={index}"])
    (index / "model.safetensors.index.json").write_text('{"weight_map": {"model.norm.weight": "x.safetensors"}}')
    (index / "x.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    assert "x.safetensors is not a safetensors file" in _refusal([f"model.init_from={index}"])


def test_an_explicit_rope_scaling_in_the_older_type_spelling_agrees_with_the_checkpoint(tmp_path):
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf = random_llama(rope_scaling={"rope_type": "llama3", **scaling})
    hf.save_pretrained(tmp_path / "hf")
    older = "{" + ", ".join(f"{k}: {v}" for k, v in {"type": "llama3", **scaling}.items()) + "}"
    cfg = load_config(None, [f"model.init_from={tmp_path / 'hf'}", "model.seq_len=16",
                             f"model.rope_scaling={older}"]).model
    assert cfg.rope_scaling_factors == (8.0, 1.0, 4.0, 64)


def test_export_refuses_a_save_without_its_model_config(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "manifest.json").write_text(json.dumps({"num_layers": 4, "tp": 1, "shard_dims": {}}))
    with pytest.raises(ConfigError, match="--config CONFIG.yaml"):
        find_saved_model(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no final model"):
        find_saved_model(tmp_path / "empty")
    with pytest.raises(ConfigError, match="is not a directory"):
        find_saved_model(tmp_path / "nowhere")


def test_layers_read_from_init_from_skip_the_seeded_draw(tmp_path, monkeypatch):
    """The random init would be thrown away: it is not drawn (torch.randn is never
    called), and the layers still hold the checkpoint's tensors."""
    random_llama(tied=True).save_pretrained(tmp_path / "hf")
    cfg = load_config(None, [f"model.init_from={tmp_path / 'hf'}", "model.seq_len=16"]).model
    layers = LayerModel(cfg, seed=0)
    seeded = [layers.build_layer(i, TensorParallel(), torch.float64, torch.device("cpu"), pretrained=False)
              for i in range(layers.num_layers)]

    def no_draw(*args, **kwargs):
        raise AssertionError("a layer filled from model.init_from drew its random init")

    monkeypatch.setattr(torch, "randn", no_draw)
    with HFCheckpoint(cfg.init_from) as ckpt:
        embed = ckpt.read("model.embed_tokens.weight")
    for index, other in enumerate(seeded):
        layer = layers.build_layer(index, TensorParallel(), torch.float64, torch.device("cpu"), pretrained=True)
        assert not any(torch.equal(p, q) for p, q in zip(layer.parameters(), other.parameters()) if p.dim() > 1)
    assert torch.equal(layer.output.weight, embed)  # the tied head: the checkpoint's embedding


def _hand_made_final_save(directory: Path) -> ModelConfig:
    """A final save as `save_model_shards` lays it out (tp = 1), without a training job."""
    from planaria.runtime.contract.checkpoint_layout import write_model_record

    model = load_config(TINY, ["model.n_layers=1", "model.d_model=32", "model.n_heads=4"]).model
    layers = LayerModel(model, seed=0)
    directory.mkdir(parents=True)
    for index in range(layers.num_layers):
        layer = layers.build_layer(index, TensorParallel(), torch.float32, torch.device("cpu"), pretrained=False)
        torch.save(layer.state_dict(), directory / f"layer{index:04d}-tp0.pt")
    write_model_record(directory, asdict(model))
    (directory / "manifest.json").write_text(json.dumps({"num_layers": layers.num_layers, "tp": 1}))
    return model


def test_export_of_a_damaged_save_is_refused_in_one_line_naming_the_file(tmp_path):
    final = tmp_path / "final"
    _hand_made_final_save(final)
    assert export_hf(find_saved_model(final)[0], tmp_path / "whole")  # the save itself exports
    manifest = (final / "manifest.json").read_text()

    (final / "layer0001-tp0.pt").write_bytes(b"not a torch file")
    cmd = [sys.executable, "-m", "planaria.cli", "export", "hf", str(final), str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "layer0001-tp0.pt is not a readable shard file" in proc.stderr
    assert not (tmp_path / "out").exists()

    (final / "manifest.json").write_text(json.dumps({"num_layers": 3}))
    with pytest.raises(ConfigError, match=r"manifest.json lacks tp"):
        find_saved_model(final)
    (final / "manifest.json").write_text(manifest[:-3])
    with pytest.raises(ValueError, match=r"final/manifest.json is not valid JSON") as err:
        find_saved_model(final)
    assert "\n" not in str(err.value)


def _byte_level_bpe(directory: Path, vocab: int) -> Path:
    """A tokenizer.json trained here (byte-level BPE, `vocab` ids) on a few lines of text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"] * 20
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


@pytest.mark.timeout(300)
def test_export_command_ships_the_data_tokenizer_and_transformers_generates(tmp_path):
    """`planaria export hf` on a run whose data directory's manifest names a tokenizer:
    the export carries it, and transformers tokenizes, generates and decodes."""
    transformers = pytest.importorskip("transformers")
    _train(tmp_path / "run", ["model.n_layers=2", "model.d_model=32", "model.n_heads=4",
                              "model.vocab_size=288", "train.steps=1"])
    data = tmp_path / "data"
    _byte_level_bpe(data / "tok", vocab=288)
    # What `planaria data prepare` records: the tokenizer's file and the end-of-text id.
    (data / "manifest.json").write_text(json.dumps({"tokenizer": "tok/tokenizer.json", "eos_id": 0}))
    record_path = tmp_path / "run" / "final" / "model.json"
    record = json.loads(record_path.read_text())
    assert record["model"]["vocab_size"] == 288 and record["data_source"] == "synthetic"
    # As if the run had trained on that directory's shards (the save records the source).
    record_path.write_text(json.dumps({**record, "data_source": str(data)}))

    proc = _export_command(tmp_path / "run", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    assert "exporting the final model" in proc.stdout and "tokenizer from the data manifest" in proc.stdout
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 5)
    assert tokenizer.decode(out[0]).startswith("def fibonacci(n):")
    assert model.config.eos_token_id == 0 and tokenizer.eos_token == "<eos>"

    again = _export_command(tmp_path / "run", tmp_path / "hf")
    assert again.returncode == 2 and "already exists and is not empty" in again.stderr


def _export_command(source: Path, out: Path) -> subprocess.CompletedProcess:
    """`planaria export hf SOURCE OUT` as a user runs it, in a process of its own."""
    cmd = [sys.executable, "-m", "planaria.cli", "export", "hf", str(source), str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.timeout(300)
def test_export_of_a_checkpoint_of_a_run_on_prepared_shards_ships_its_tokenizer(tmp_path):
    """A run trained on `planaria data prepare`'s shards, exported from its checkpoint
    directory: the checkpoint records the data source, so the tokenizer and the end of
    text id come along as with the final model."""
    transformers = pytest.importorskip("transformers")
    tok = _byte_level_bpe(tmp_path / "tok", vocab=288)
    text = tmp_path / "text"
    text.mkdir()
    for i in range(8):
        (text / f"{i}.py").write_text(f"def f{i}(n):\n    return n * {i} + fibonacci(n - {i})\n" * 20)
    data = tmp_path / "data"
    prepare = [sys.executable, "-m", "planaria.cli", "data", "prepare", str(text), "--out", str(data),
               "--tokenizer", str(tok), "--eos", "<eos>", "--val-fraction", "0", "--quiet"]
    proc = subprocess.run(prepare, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    cmd = [sys.executable, "-m", "planaria.train", str(TINY), f"data.source={data}", "model.seq_len=16",
           "model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.vocab_size=288",
           "train.global_batch=4", "train.micro_batch=2", "train.steps=3", "checkpoint.every=2",
           "output.save_final=false", "parallel.pp=1", f"output.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    proc = _export_command(tmp_path / "run" / "checkpoints", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    assert "the checkpoint of iteration 1" in proc.stdout and "tokenizer from the data manifest" in proc.stdout
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert tokenizer.eos_token == "<eos>" and config.eos_token_id == tokenizer.convert_tokens_to_ids("<eos>")
    assert tokenizer.decode(tokenizer("def f1(n):").input_ids) == "def f1(n):"


@pytest.mark.timeout(300)
def test_a_resumed_job_does_not_read_init_from_again(tmp_path):
    """Its checkpoint's state wins: with the checkpoint's weights gone (config.json kept),
    a job resumed from its Planaria checkpoint still runs."""
    random_llama().to(torch.float32).save_pretrained(tmp_path / "hf")
    config = tmp_path / "job.yaml"
    config.write_text(f"model:\n  init_from: {tmp_path / 'hf'}\n  seq_len: 16\n")
    job = [sys.executable, "-m", "planaria.train", str(config), "data.source=synthetic",
           "train.global_batch=4", "train.micro_batch=2", "checkpoint.every=2", "parallel.pp=1",
           f"output.dir={tmp_path / 'run'}"]
    first = subprocess.run([*job, "train.steps=3"], capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    (tmp_path / "hf" / "model.safetensors").unlink()
    resumed = subprocess.run([*job, "train.steps=5"], capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from the checkpoint of iteration 1" in resumed.stdout
