"""LLaMA's shapes: grouped-query heads, FFN sizing, rotary scaling settings, the presets
and what the planner makes of them; the tp split of key/value heads and its inverse.
No processes: the multi-process exactness of these models is test_gqa_exactness.py."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from planaria.cli import main
from planaria.runtime.config.loading import load_config
from planaria.runtime.config.sections import ConfigError, model_shape
from planaria.runtime.models.llama import LayerModel
from planaria.runtime.models.tensor_parallel import TensorParallel
from planaria.templates.analytic import layer_state_bytes
from planaria.templates.costs import llama_ffn_dim
from tests.launch import TINY

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def refused(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    return str(err.value)


@pytest.mark.parametrize("d_model, multiple_of, multiplier, ffn", [
    (4096, 256, 0.0, 11008),   # LLaMA 1/2 7B
    (5120, 256, 0.0, 13824),   # 13B
    (8192, 4096, 1.3, 28672),  # LLaMA 2 70B, LLaMA 3 70B
    (4096, 1024, 1.3, 14336),  # LLaMA 3 8B
    (64, 32, 0.0, 192),        # configs/tiny.yaml, as before LLaMA's rounding
])
def test_ffn_width_follows_llamas_rule(d_model, multiple_of, multiplier, ffn):
    assert llama_ffn_dim(d_model, multiple_of, multiplier) == ffn


# name: (parameters as published, n_kv_heads, ffn)
PRESETS = {
    "llama2-7b": (6.74e9, 32, 11008),
    "llama2-13b": (13.02e9, 40, 13824),
    "llama2-70b": (68.98e9, 8, 28672),
    "llama3-8b": (8.03e9, 8, 14336),
    "llama3-70b": (70.55e9, 8, 28672),
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_have_the_published_shapes(name):
    published, kv_heads, ffn = PRESETS[name]
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert (cfg.model.kv_heads, cfg.model.ffn_dim) == (kv_heads, ffn)
    assert model_shape(cfg.model).parameters == pytest.approx(published, rel=0.01)
    assert cfg.train.final_lr == pytest.approx(cfg.train.lr / 10)


def test_planner_plans_llama3_8b(capsys):
    assert main(["plan", str(CONFIGS / "llama3-8b.yaml"), "--nodes", "4", "--gpus-per-node", "8",
                 "--hardware", "h100"]) == 0
    assert "iteration" in capsys.readouterr().out


def test_planner_counts_the_smaller_keys_and_values():
    """LLaMA 2 70B's 8 key/value heads of 64 save 7/8 of wk and wv in every block's state."""
    shape = model_shape(load_config(CONFIGS / "llama2-70b.yaml").model)
    multi_head = model_shape(load_config(CONFIGS / "llama2-70b.yaml", ["model.n_kv_heads=0"]).model)
    d, kv_dim = shape.d_model, 8 * 128
    assert multi_head.layer_parameters(1) - shape.layer_parameters(1) == 2 * d * (d - kv_dim)
    saved = layer_state_bytes(multi_head, 1, 8, "bfloat16") - layer_state_bytes(shape, 1, 8, "bfloat16")
    assert saved == 2 * d * (d - kv_dim) // 8 * 16  # 16 bytes per parameter under bf16 autocast
    # tp 16 > 8 key/value heads: each worker holds one whole head of wk and of wv.
    assert shape.block_parameters_per_rank(16) == (2 * d * d + 3 * d * 28672) // 16 + 2 * d * 128 + 2 * d


@pytest.mark.parametrize("overrides, fragment", [
    (["model.n_kv_heads=3"], "model.n_kv_heads=3 must divide model.n_heads=4"),
    (["model.n_kv_heads=-1"], "must not be"),
    (["model.multiple_of=0"], "model.multiple_of must be at least 1"),
    (["model.d_model=48", "model.n_heads=6", "model.n_kv_heads=3", "parallel.tp=2"],
     "model.n_kv_heads=3 and parallel.tp=2"),
    (["model.rope_scaling=[8.0]"], "model.rope_scaling must be a mapping"),
    (["model.rope_scaling={rope_type: yarn, factor: 4.0}"], "rope_type 'yarn' is not supported"),
    (["model.rope_scaling={factor: 8.0}"], "has no rope_type: add rope_type: llama3"),
    (["model.rope_scaling={rope_type: llama3, factor: 8.0}"], "missing ['low_freq_factor'"),
    (["model.rope_scaling={rope_type: llama3, factor: 8.0, low_freq_factor: 4.0, high_freq_factor: 1.0, "
      "original_max_position_embeddings: 8192}"], "low_freq_factor < high_freq_factor"),
    (["model.rope_scaling={rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
      "original_max_position_embeddings: 8192, beta: 2}"], "unknown ['beta']"),
])
def test_bad_model_shapes_are_refused(overrides, fragment):
    assert fragment in refused(overrides)


def test_rope_scaling_is_read_as_llama3_or_default():
    llama3 = ("{rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
              "original_max_position_embeddings: 8192}")
    assert load_config(TINY, [f"model.rope_scaling={llama3}"]).model.rope_scaling_factors == (8.0, 1.0, 4.0, 8192)
    for no_scaling in ("{rope_type: default}", "{rope_type: null}", "null"):
        assert load_config(TINY, [f"model.rope_scaling={no_scaling}"]).model.rope_scaling_factors is None
    assert load_config(TINY).model.rope_scaling_factors is None


@pytest.mark.parametrize("kv_heads, tp", [(2, 2), (2, 4), (1, 4), (4, 2)])
def test_tp_pieces_are_what_shard_says_and_unshard_inverts(kv_heads, tp):
    """The layers a tp rank builds hold `LayerModel.shard` of the full layer; `unshard`
    gives the full tensors back; each distinct piece is counted once in the norm."""
    cfg = load_config(TINY, ["model.d_model=32", f"model.n_kv_heads={kv_heads}", f"parallel.tp={tp}"])
    model = LayerModel(cfg.model, seed=3)
    for index in range(model.num_layers):
        full = dict(model.build_layer(index, TensorParallel(), torch.float64, torch.device("cpu"), pretrained=False)
                    .named_parameters())
        pieces = [dict(model.build_layer(index, TensorParallel(None, r, tp), torch.float64, torch.device("cpu"),
                                         pretrained=False)
                       .named_parameters()) for r in range(tp)]
        for name, tensor in full.items():
            for r in range(tp):
                assert torch.equal(pieces[r][name], model.shard(index, name, tensor.detach(), r, tp)), (name, r)
            assert torch.equal(model.unshard(index, name, [p[name].detach() for p in pieces]), tensor)
            counted = sum(pieces[r][name].numel() for r in range(tp) if model.counts_in_norm(index, name, r, tp))
            assert counted == tensor.numel(), name


def test_the_small_gqa_config_is_grouped_query():
    cfg = load_config(CONFIGS / "tiny-gqa.yaml", ["parallel.tp=4", "parallel.pp=1"])  # tp 4 > 2 kv heads
    assert (cfg.model.n_heads, cfg.model.kv_heads, cfg.model.ffn_dim) == (4, 2, 256)


def test_plan_prints_and_checks_the_host_memory_of_peer_snapshots(capsys):
    """`planaria plan` prints the host memory peer snapshots take on a node, and refuses a
    job whose nodes have less, with both figures and what to change."""
    import dataclasses

    from planaria.runtime.planning.job_plans import cost_model, plan_job

    assert main(["plan", str(CONFIGS / "llama3-8b.yaml"), "--nodes", "16", "--hardware", "h100"]) == 0
    assert "GiB of host memory per node" in capsys.readouterr().out
    cfg = load_config(CONFIGS / "llama3-8b.yaml")
    costs = cost_model(cfg, hardware_name="h100", gpus_per_node=1)
    report = plan_job(cfg, costs, nodes=16, fault_tolerance=1)
    assert 0 < report.snapshot_host_bytes < costs.hardware.host_memory_bytes
    small = dataclasses.replace(costs, hardware=dataclasses.replace(costs.hardware, host_memory_bytes=2**30))
    with pytest.raises(ValueError, match=r"peer snapshots need \d+\.\d GiB of host memory on a node, "
                                         r"a h100 node has 1\.0 GiB: lower checkpoint.memory_copies"):
        plan_job(cfg, small, nodes=16, fault_tolerance=1).check_host_memory()
    off = load_config(CONFIGS / "llama3-8b.yaml", ["checkpoint.memory_every=0"])
    assert plan_job(off, small, nodes=16, fault_tolerance=1).snapshot_host_bytes == 0


def test_the_plan_counts_and_states_what_the_exact_reduction_costs(capsys):
    """`train.exact_reduction` sums gradients in float64: the planner counts the sync's
    float64 bytes (twice float32's) and the sums' memory (8 bytes a parameter), and
    `planaria plan` says both."""
    from planaria.runtime.planning.job_plans import cost_model, plan_job

    plans = {}
    for exact in (True, False):
        cfg = load_config(CONFIGS / "llama3-8b.yaml", [f"train.exact_reduction={str(exact).lower()}"])
        costs = cost_model(cfg, hardware_name="h100", gpus_per_node=8)
        plans[exact] = plan_job(cfg, costs, nodes=16, fault_tolerance=1)
    wide, narrow = plans[True], plans[False]
    assert [len(p.stages) for p in wide.choice.plan.pipelines] == [len(p.stages) for p in narrow.choice.plan.pipelines]
    assert len(narrow.choice.plan.pipelines) > 1 and narrow.sync_bytes > 0
    assert (wide.sync_dtype, narrow.sync_dtype) == ("float64", "float32")
    assert wide.sync_bytes == pytest.approx(2 * narrow.sync_bytes)
    # The same plan, slower by the float64 sync's extra time, and 8 bytes more per
    # parameter of a worker's stage in memory (an 8B model over 8 tp ranks: 1B each).
    assert wide.choice.iteration_time_s > narrow.choice.iteration_time_s
    assert narrow.wide_sum_bytes == 0 and wide.wide_sum_bytes == pytest.approx(8 * 8.03e9 / 8, rel=0.02)
    assert wide.peak_memory_bytes - narrow.peak_memory_bytes == pytest.approx(wide.wide_sum_bytes, rel=0.01)
    assert main(["plan", str(CONFIGS / "llama3-8b.yaml"), "--nodes", "16", "--gpus-per-node", "8",
                 "--hardware", "h100"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(r"gradient sync across pipelines: [\d.]+ GiB sent per worker per step in float64", out)
    assert re.search(r"the float64 gradient sums take [\d.]+ GiB of the peak memory per device", out)
