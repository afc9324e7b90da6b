"""The analytic cost model and the hardware presets (planaria.templates.analytic)."""
from __future__ import annotations

import os

import pytest

from planaria.templates.analytic import (
    HARDWARE_NAMES,
    all_reduce_time,
    analytic_cost_model,
    bytes_per_parameter,
    hardware,
    layer_activation_bytes,
    layer_forward_flops,
)
from planaria.templates.costs import Hardware, LayerCost, ModelShape

# A shape small enough to count by hand: d=8, ffn=32, T=4, V=16.
SHAPE = ModelShape(n_layers=2, d_model=8, n_heads=2, vocab_size=16, seq_len=4, ffn_hidden=32)
# Round numbers, no measurement: 1 TFLOP/s at full efficiency, 1 GB/s links.
HW = Hardware(name="test", device_memory_bytes=10**12, peak_flops=1e12, gpus_per_node=8,
              intra_node_bandwidth=1e9, inter_node_bandwidth=1e9, matmul_efficiency=1.0,
              link_latency_s=1e-5)


def test_forward_flops_by_hand():
    # micro_batch 2: 8 tokens.
    # block: 2 * 8 * (4*8*8 + 3*8*32) = 16384 matmul FLOPs, attention 4 * 2 * 4*4 * 8 = 1024.
    assert layer_forward_flops(SHAPE, 1, tp=1, micro_batch=2) == 16384 + 1024
    # head: 8 tokens x 16 logits; 2*8 FLOPs each for the matmul, 5 for cross-entropy.
    assert layer_forward_flops(SHAPE, 3, tp=1, micro_batch=2) == 128 * 2 * 8 + 128 * 5
    assert layer_forward_flops(SHAPE, 0, tp=1, micro_batch=2) == 0
    assert layer_forward_flops(SHAPE, 1, tp=2, micro_batch=2) == (16384 + 1024) / 2


def test_backward_is_twice_forward_three_times_with_recompute():
    plain = analytic_cost_model(SHAPE, HW, micro_batch=2, dtype="float32")
    again = analytic_cost_model(SHAPE, HW, micro_batch=2, dtype="float32", recompute=True)
    for i in (1, 2):
        assert plain.layers[i].forward_s == pytest.approx((16384 + 1024) / 1e12)
        assert plain.layers[i].backward_s == pytest.approx(2 * plain.layers[i].forward_s)
        assert again.layers[i].backward_s == pytest.approx(3 * again.layers[i].forward_s)
    # Recomputation applies to blocks only.
    assert again.layers[3].backward_s == pytest.approx(2 * again.layers[3].forward_s)
    assert plain.compute_time(0, 4) == pytest.approx(sum(l.forward_s + l.backward_s for l in plain.layers))


def test_tensor_parallel_halves_compute_and_state_and_adds_all_reduces():
    one = analytic_cost_model(SHAPE, HW, tp=1, micro_batch=2, dtype="float32")
    two = analytic_cost_model(SHAPE, HW, tp=2, micro_batch=2, dtype="float32")
    hidden = 2 * 4 * 8 * 4  # b*T*d float32 bytes
    ring = 2 * (2 - 1) / 2 * hidden / 1e9 + 1e-5
    assert all_reduce_time(hidden, 2, HW) == pytest.approx(ring)
    assert all_reduce_time(hidden, 1, HW) == 0
    block1, block2 = one.layers[1], two.layers[1]
    assert block2.forward_s == pytest.approx(block1.forward_s / 2 + 2 * ring)
    assert block2.backward_s == pytest.approx(block1.backward_s / 2 + 2 * ring)
    # Matrices split, the two norm gains (2*d parameters) stay whole.
    assert block2.state_bytes == ((4 * 64 + 3 * 8 * 32) // 2 + 16) * 16
    assert two.layers[0].state_bytes == one.layers[0].state_bytes // 2
    assert two.layers[0].forward_s == pytest.approx(ring)  # the embedding's one all-reduce
    assert two.layers[3].backward_s > one.layers[3].backward_s / 2  # head: input-gradient all-reduce
    # The split share of the block's activations shrinks, the replicated share does not.
    assert block1.activation_bytes / 2 < block2.activation_bytes < block1.activation_bytes


def test_bytes_per_parameter_by_dtype():
    assert bytes_per_parameter("float32") == 16
    assert bytes_per_parameter("bfloat16") == 16  # float32 masters under autocast
    assert bytes_per_parameter("float64") == 32
    for dtype, per in (("float32", 16), ("bfloat16", 16), ("float64", 32)):
        model = analytic_cost_model(SHAPE, HW, dtype=dtype)
        assert model.state_bytes(0, 4) == SHAPE.parameters * per
    with pytest.raises(ValueError, match="train.dtype"):
        bytes_per_parameter("float16")


def test_activations_and_outputs():
    b, t, d = 2, 4, 8
    f32 = analytic_cost_model(SHAPE, HW, micro_batch=b, dtype="float32")
    assert f32.layers[1].activation_bytes == b * t * d * 34 * 2  # (10 + 24) * 16-bit bytes * 2
    assert f32.layers[1].output_bytes == b * t * d * 4
    assert f32.layers[3].output_bytes == 0  # the head sends nothing
    bf16 = analytic_cost_model(SHAPE, HW, micro_batch=b, dtype="bfloat16")
    assert bf16.layers[1].activation_bytes == b * t * d * 34
    assert bf16.layers[1].output_bytes == b * t * d * 4  # the residual stream stays float32
    recomputed = analytic_cost_model(SHAPE, HW, micro_batch=b, dtype="float32", recompute=True)
    assert recomputed.layers[1].activation_bytes == b * t * d * 4  # the block input only
    # No s^2 attention-score term: activations grow linearly with the sequence.
    longer = ModelShape(n_layers=2, d_model=8, n_heads=2, vocab_size=16, seq_len=64, ffn_hidden=32)
    assert (layer_activation_bytes(longer, 1, tp=1, micro_batch=b, dtype="float32")
            == 16 * f32.layers[1].activation_bytes)


def test_bad_jobs_are_refused_naming_the_key():
    with pytest.raises(ValueError, match="model.n_heads"):
        analytic_cost_model(SHAPE, HW, tp=4)
    with pytest.raises(ValueError, match="model.vocab_size"):
        analytic_cost_model(ModelShape(n_layers=1, d_model=8, n_heads=2, vocab_size=15, seq_len=4), HW, tp=2)
    with pytest.raises(ValueError, match="model.ffn_hidden"):
        analytic_cost_model(ModelShape(n_layers=1, d_model=8, n_heads=2, vocab_size=16, seq_len=4,
                                       ffn_hidden=33), HW, tp=2)
    with pytest.raises(ValueError, match="train.micro_batch"):
        analytic_cost_model(SHAPE, HW, micro_batch=0)
    with pytest.raises(ValueError, match="parallel.tp"):
        analytic_cost_model(SHAPE, HW, tp=0)
    with pytest.raises(ValueError, match="model.seq_len"):
        ModelShape(n_layers=1, d_model=8, n_heads=2, vocab_size=16, seq_len=0)


def test_presets():
    assert set(HARDWARE_NAMES) == {"a100", "h100", "h200", "v100", "t4", "cpu"}
    # The spot traces' instances: one 16 GB GPU each, fp16 peaks of the vendor spec.
    v100, t4 = hardware("v100"), hardware("t4")
    assert v100.gpus_per_node == t4.gpus_per_node == 1
    assert v100.peak_flops == 125e12 and t4.peak_flops == 65e12
    assert v100.device_memory_bytes == t4.device_memory_bytes < 16e9
    a100, h100, h200 = hardware("a100"), hardware("h100"), hardware("h200")
    assert a100.peak_flops == 312e12 and h100.peak_flops == h200.peak_flops == 989e12
    assert a100.gpus_per_node == h100.gpus_per_node == 8
    assert 70e9 < h100.device_memory_bytes <= 80e9 < h200.device_memory_bytes <= 141e9
    assert h100.intra_node_bandwidth > a100.intra_node_bandwidth > a100.inter_node_bandwidth
    assert h100.inter_node_bandwidth == 2 * a100.inter_node_bandwidth  # 400 vs 200 Gb/s
    assert hardware("h100", gpus_per_node=4).gpus_per_node == 4
    with pytest.raises(ValueError, match=r"valid names are \['a100', 'h100', 'h200', 'v100', 't4', 'cpu'\]"):
        hardware("b200")


def test_cpu_is_measured():
    cpu = hardware("cpu")
    assert cpu.name == "cpu" and cpu.gpus_per_node == 1
    assert 1e8 < cpu.peak_flops < 1e14
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert cpu.device_memory_bytes == physical
    assert hardware("cpu", gpus_per_node=2).device_memory_bytes == physical // 2
    assert cpu.intra_node_bandwidth > 1e7 and 0 < cpu.link_latency_s < 1e-2
    assert hardware("cpu") is cpu  # measured once per process


def test_175b_model_on_h100_fits_tens_of_gigabytes_per_stage():
    # GPT-3 175B: 96 layers, d 12288, 96 heads, T 2048; 8 stages of 12 blocks, tp 8.
    shape = ModelShape(n_layers=96, d_model=12288, n_heads=96, vocab_size=51200, seq_len=2048,
                       ffn_hidden=4 * 12288)
    model = analytic_cost_model(shape, hardware("h100"), tp=8, micro_batch=1, dtype="bfloat16")
    stage = (1, 13)  # 12 blocks
    state, activations = model.state_bytes(*stage), model.activation_bytes(*stage)
    assert 10e9 < state < 80e9  # ~2.7B parameters per worker x 16 bytes
    assert 1e9 < activations < 20e9
    # 1F1B keeps up to 8 microbatches in flight on the first stage: still tens of GB.
    assert 10e9 < state + 8 * activations < 200e9
    with pytest.raises(ValueError, match="inside a node"):
        analytic_cost_model(shape, hardware("h100", gpus_per_node=4), tp=8)


# --- per-iteration and per-message costs ---------------------------------------------


def test_new_cost_fields_default_to_zero_and_refuse_negatives():
    layer = LayerCost(forward_s=1.0, backward_s=2.0, state_bytes=0, activation_bytes=0,
                      output_bytes=0)
    assert layer.optimizer_s == 0.0
    assert HW.message_overhead_s == 0.0 and HW.collective_latency_s == 0.0
    with pytest.raises(ValueError, match="optimizer_s"):
        LayerCost(1.0, 2.0, 0, 0, 0, optimizer_s=-1.0)
    for name in ("message_overhead_s", "collective_latency_s", "link_latency_s"):
        with pytest.raises(ValueError, match=name):
            Hardware(name="bad", device_memory_bytes=1, peak_flops=1, gpus_per_node=1,
                     intra_node_bandwidth=1, inter_node_bandwidth=1, **{name: -1e-6})
    # The analytic model measures no update and the presets no message work: as before.
    model = analytic_cost_model(SHAPE, HW, micro_batch=2, dtype="float32")
    assert model.update_time(0, model.num_layers) == 0.0
    assert model.boundary_overhead() == 0.0 and model.commit_time() == 0.0
    assert all(hardware(name).message_overhead_s == 0.0 for name in ("a100", "h100", "h200"))


def test_update_time_boundary_overhead_and_commit():
    from dataclasses import replace

    from planaria.templates.costs import CostModel

    hw = replace(HW, message_overhead_s=2e-4, collective_latency_s=5e-4)
    layers = tuple(LayerCost(forward_s=1e-3, backward_s=2e-3, state_bytes=0, activation_bytes=0,
                             output_bytes=100, optimizer_s=1e-4 * (i + 1)) for i in range(4))
    model = CostModel(SHAPE, hw, 1, 2, layers)
    assert model.update_time(0, 4) == pytest.approx(1e-4 * (1 + 2 + 3 + 4))
    assert model.update_time(1, 3) == pytest.approx(1e-4 * (2 + 3))
    assert model.update_time(2, 2) == 0.0
    assert model.boundary_overhead() == pytest.approx(4e-4)  # one message out, one in
    assert model.commit_time() == pytest.approx(5e-4)
    # The send term is unchanged: latency plus bytes / bandwidth, each way, once.
    assert model.send_time(1) == pytest.approx(2 * (100 / 1e9 + 1e-5))
