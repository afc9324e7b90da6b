"""The profiler on Planaria's real layers (planaria.runtime.planning.measured_costs;
planaria.templates.profiler, .gloo_links and .profile_cache)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from planaria.runtime.config.loading import load_config
from planaria.runtime.planning.measured_costs import model_shape, profile_model
from planaria.templates.analytic import analytic_cost_model, hardware, tp_communication_times
from planaria.templates.gloo_links import measure_gloo_links
from planaria.templates.partition_cost import pipeline_iteration_time
from planaria.templates.profiler import profile_layers

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def tiny(*overrides: str):
    return load_config(TINY, list(overrides))


def test_model_shape_mirrors_the_config():
    cfg = tiny()
    shape = model_shape(cfg.model)
    assert (shape.n_layers, shape.d_model, shape.vocab_size) == (4, 64, 256)
    assert shape.ffn_dim == cfg.model.ffn_dim
    assert shape.parameters == sum(
        sum(p.numel() for p in layer.parameters()) for layer in _layers(cfg))


def _layers(cfg):
    from planaria.runtime.models.llama import LayerModel
    from planaria.runtime.models.tensor_parallel import TensorParallel

    model = LayerModel(cfg.model, seed=0)
    return [model.build_layer(i, TensorParallel(), torch.float32, torch.device("cpu"), pretrained=True)
            for i in range(model.num_layers)]


def test_profile_tiny_model_on_cpu(tmp_path):
    cfg = tiny()
    profiled = profile_model(cfg, cache_dir=tmp_path)
    analytic = analytic_cost_model(model_shape(cfg.model), hardware("cpu"), micro_batch=cfg.train.micro_batch,
                                   dtype="float32", wide_gradients=cfg.train.exact_reduction)
    assert profiled.source == "profiled" and profiled.num_layers == 6
    assert all(l.forward_s > 0 and l.backward_s > 0 for l in profiled.layers)
    assert len({profiled.layers[i] for i in range(1, 5)}) == 1  # one block measured, reused
    for p, a in zip(profiled.layers, analytic.layers):
        assert a.activation_bytes / 2 <= p.activation_bytes <= 2 * a.activation_bytes
        assert (p.state_bytes, p.gradient_bytes, p.wide_sum_bytes) == (a.state_bytes, a.gradient_bytes,
                                                                         a.wide_sum_bytes)
        assert p.wide_sum_bytes == p.gradient_bytes == p.held_bytes / 2  # float64 sums of float32
        assert p.output_bytes == a.output_bytes
    assert profiled.layers[0].activation_bytes == 2 * 64 * 8  # the token ids, nothing else


def test_cache_is_written_and_read_back(tmp_path):
    cfg = tiny()
    first = profile_model(cfg, cache_dir=tmp_path)
    (cache,) = tmp_path.glob("profile-*.json")
    stamp = cache.stat().st_mtime_ns
    second = profile_model(cfg, cache_dir=tmp_path)
    assert second == first  # same floats: read back, not measured again
    assert cache.stat().st_mtime_ns == stamp
    key = json.loads(cache.read_text())["key"]
    assert key["threads"] == torch.get_num_threads() and key["torch"] == torch.__version__
    # Another thread count is another device setting: a new entry; the setting is restored.
    before = torch.get_num_threads()
    profile_model(cfg, cache_dir=tmp_path, num_threads=1)
    assert torch.get_num_threads() == before
    assert len(list(tmp_path.glob("profile-*.json"))) == (1 if before == 1 else 2)


def test_cached_measurements_are_not_taken_again(tmp_path):
    cfg = tiny()
    built = []
    shape = model_shape(cfg.model)
    layers = _layers(cfg)

    def build(i):
        built.append(i)
        return layers[i]

    def make_input(i):
        return torch.randint(256, (2, 64)) if i == 0 else torch.randn(2, 64, 64)

    kwargs = dict(micro_batch=2, dtype="float32", cache_dir=tmp_path, repeats=2, warmup=1)
    first = profile_layers(build, make_input, shape, hardware("cpu"), **kwargs)
    assert built == [0, 1, 5]  # embedding, one block, head
    assert profile_layers(build, make_input, shape, hardware("cpu"), **kwargs) == first
    assert built == [0, 1, 5]


def test_corrupt_cache_is_ignored_with_a_warning(tmp_path):
    cfg = tiny()
    first = profile_model(cfg, cache_dir=tmp_path)
    (cache,) = tmp_path.glob("profile-*.json")
    cache.write_text('{"key": {"version": 1}, "layers": {"block": [1, 2')
    with pytest.warns(UserWarning, match="unreadable profile cache"):
        again = profile_model(cfg, cache_dir=tmp_path)
    assert again.shape == first.shape and all(l.forward_s > 0 for l in again.layers)
    json.loads(cache.read_text())  # rewritten whole
    assert not list(tmp_path.glob("*.tmp"))


def test_tensor_parallel_is_derived_from_tp1(tmp_path):
    one = profile_model(tiny(), cache_dir=tmp_path)
    two = profile_model(tiny("parallel.tp=2"), cache_dir=tmp_path)  # the same cached tp=1 data
    assert two.tp == 2 and len(list(tmp_path.glob("profile-*.json"))) == 1
    comm_f, comm_b = tp_communication_times(one.shape, 1, two.hardware, tp=2, micro_batch=2,
                                            dtype="float32")
    assert two.layers[1].forward_s == pytest.approx(one.layers[1].forward_s / 2 + comm_f)
    assert two.layers[1].backward_s == pytest.approx(one.layers[1].backward_s / 2 + comm_b)
    assert two.layers[0].state_bytes == one.layers[0].state_bytes // 2
    assert one.layers[1].activation_bytes / 2 < two.layers[1].activation_bytes < one.layers[1].activation_bytes
    assert two.layers[1].output_bytes == one.layers[1].output_bytes  # hidden state is replicated


def test_recompute_keeps_only_block_inputs():
    cfg = tiny("train.recompute=true")
    profiled = profile_model(cfg, repeats=2, warmup=1)
    assert profiled.layers[1].activation_bytes == 2 * 64 * 64 * 4
    plain = profile_model(tiny(), repeats=2, warmup=1)
    assert profiled.layers[5].activation_bytes == plain.layers[5].activation_bytes


def test_bfloat16_excludes_the_weight_casts():
    bf16 = profile_model(tiny("train.dtype=bfloat16"), repeats=2, warmup=1)
    f32 = profile_model(tiny(), repeats=2, warmup=1)
    # bf16 matmul outputs are half the size; autocast's cached bf16 weights are state
    # (counting them would put the block at 2.1x the analytic estimate).
    assert bf16.layers[1].activation_bytes < f32.layers[1].activation_bytes
    analytic = analytic_cost_model(bf16.shape, bf16.hardware, micro_batch=2, dtype="bfloat16")
    assert bf16.layers[1].activation_bytes <= 2 * analytic.layers[1].activation_bytes
    assert bf16.layers[1].output_bytes == f32.layers[1].output_bytes  # float32 residual stream
    assert bf16.layers[1].state_bytes == f32.layers[1].state_bytes


def test_update_is_measured_for_every_layer_and_enters_the_iteration_time(tmp_path):
    from planaria.templates.partition_cost import evaluate_partition

    profiled = profile_model(tiny(), cache_dir=tmp_path)
    assert all(l.optimizer_s > 0 for l in profiled.layers)
    # A block has nine tensors to update, the embedding one.
    assert profiled.layers[1].optimizer_s > profiled.layers[0].optimizer_s
    part = evaluate_partition(profiled, [(0, 3), (3, 6)], 2, num_microbatches=4)
    assert part.update_times == pytest.approx((profiled.update_time(0, 3),
                                               profiled.update_time(3, 6)))
    bare = pipeline_iteration_time(part.stage_times, part.send_times, 4, "1f1b")
    assert part.iteration_time(4) == pytest.approx(bare + max(part.update_times)
                                                   + profiled.commit_time())


def test_gloo_links_are_measured_between_processes_and_replace_the_presets():
    links = measure_gloo_links(32 << 10, rounds=40)
    assert 1e-6 < links.latency_s < 0.05
    assert 1e7 < links.bandwidth < 1e12
    assert links.message_overhead_s >= 0 and 1e-6 < links.collective_latency_s < 0.5
    assert links.message_bytes == 32 << 10
    hw = links.apply(hardware("cpu"))
    assert (hw.link_latency_s, hw.inter_node_bandwidth, hw.intra_node_bandwidth) == (
        links.latency_s, links.bandwidth, links.bandwidth)
    assert (hw.message_overhead_s, hw.collective_latency_s) == (
        links.message_overhead_s, links.collective_latency_s)


def test_profile_measures_links_on_cpu_and_caches_them(tmp_path):
    cfg = tiny()
    measured = profile_model(cfg, cache_dir=tmp_path)
    assert measured.hardware.collective_latency_s > 0  # gloo, not the raw-TCP preset
    cached = profile_model(cfg, cache_dir=tmp_path)
    assert cached.hardware == measured.hardware and cached.layers == measured.layers
    data = json.loads(next(tmp_path.glob("profile-*.json")).read_text())
    assert data["links"]["message_bytes"] == 2 * 64 * 64 * 4  # the block's output
    assert data["links"]["action_overhead_s"] == measured.hardware.action_overhead_s
    plain = profile_model(cfg, measure_links=False, repeats=2, warmup=1)
    assert plain.hardware.message_overhead_s == 0 and plain.hardware.collective_latency_s == 0
    assert plain.hardware.action_overhead_s == 0


def test_the_pipeline_runtime_costs_something_per_action():
    """Two processes measure the links, then run the real schedule runtime on known
    work; what the runtime adds beyond the work and the messages is its own, per action."""
    from planaria.runtime.planning.pipeline_probe import measure_links_and_runtime

    links = measure_links_and_runtime(32 << 10, rounds=40)
    assert links.message_bytes == 32 << 10 and 1e-6 < links.latency_s < 0.05
    # Python dispatch, input and output bookkeeping, building the p2p ops: tens of
    # microseconds at the very least, never tens of milliseconds.
    assert 1e-5 < links.action_overhead_s < 0.02
    assert links.apply(hardware("cpu")).action_overhead_s == links.action_overhead_s
    with pytest.raises(ValueError, match="microbatches, probe_rounds and rounds must be at least 1"):
        measure_links_and_runtime(microbatches=0)


def test_the_action_overhead_is_what_the_step_leaves_after_work_messages_and_transfers():
    from planaria.runtime.planning.pipeline_probe import action_overhead

    link = dict(latency_s=1e-4, bandwidth=1e9, message_bytes=100_000, microbatches=4)
    transfers = 2 * (1e-4 + 1e-4)
    # Four microbatches, two stages: 5 stage-times, each two actions of (work + message
    # 1.3 ms) and of the runtime's own 0.2 ms; round by round, then the mean.
    steps = [5 * 2 * (1.3e-3 + 2e-4) + transfers, 5 * 2 * (1.5e-3 + 4e-4) + transfers]
    assert action_overhead(steps, [1.3e-3, 1.5e-3], **link) == pytest.approx(3e-4)
    assert action_overhead([0.0], [1e-3], **link) == 0.0  # never negative


def test_statistic_is_checked():
    assert profile_model(tiny(), statistic="median", repeats=3, warmup=1,
                         measure_links=False).source == "profiled"
    with pytest.raises(ValueError, match="statistic"):
        profile_model(tiny(), statistic="mode", measure_links=False)


def test_layers_are_profiled_with_the_trainers_wide_gradient_sums(tmp_path):
    """With train.exact_reduction the engine sums gradients in float64 by a hook; the
    profile times backward with that hook, and a profile taken without it is not reused."""
    for exact in ("true", "false"):
        profile_model(tiny(f"train.exact_reduction={exact}"), cache_dir=tmp_path, repeats=1,
                      measure_links=False)
    keys = sorted(json.loads(path.read_text())["key"]["extra"]["grad_accum"]
                  for path in tmp_path.glob("profile-*.json"))
    assert keys == ["None", "float64"]


def test_update_steps_on_the_wide_sums():
    """measure_update on gradients summed wide (main_grad, grad empty) rounds and steps
    on them, as the engine does; stepping on the empty grad would leave SGD's weights."""
    from planaria.runtime.parallel.engine import accumulate_wide
    from planaria.templates.profiler import measure_update

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3, bias=False)
    accumulate_wide(layer, torch.float64)
    for _ in range(2):  # two microbatches, summed in main_grad
        layer(torch.randn(5, 4)).square().sum().backward()
    weight = layer.weight
    summed = weight.main_grad.clone()
    assert weight.grad is None and summed.dtype == torch.float64
    before = weight.detach().clone()
    steps = 1 + 2  # max(warmup, 1) + repeats, every one from the same sums
    measure_update(layer, lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
                   repeats=2, warmup=1)
    scale = min(1.0, 1.0 / (float(summed.norm()) + 1e-6))  # clipped to norm 1
    expected = before - steps * 0.01 * (summed * scale).float()
    torch.testing.assert_close(weight.detach(), expected, rtol=1e-5, atol=1e-6)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_worker_load_computes_beside_the_profile_and_stops_after():
    """concurrent_workers > 1 times the layers beside busy processes, as a torchrun job's
    other workers are; they compute while the body runs and are gone after it."""
    import time

    from planaria.runtime.planning.measured_costs import worker_load

    with worker_load(tiny(), 2, torch.device("cpu")) as pids:
        assert len(pids) == 2
        before = [_cpu_ticks(pid) for pid in pids]
        time.sleep(0.5)
        assert all(_cpu_ticks(pid) > b for pid, b in zip(pids, before))
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_concurrent_workers_enter_the_cache_key_and_are_checked(tmp_path):
    profile_model(tiny(), cache_dir=tmp_path, concurrent_workers=2, repeats=1, measure_links=False)
    (path,) = tmp_path.glob("profile-*.json")
    assert json.loads(path.read_text())["key"]["extra"]["concurrent_workers"] == 2
    with pytest.raises(ValueError, match="concurrent_workers must be at least 1"):
        profile_model(tiny(), concurrent_workers=0)


def test_a_load_process_that_fails_to_start_is_reported_with_its_error(tmp_path):
    import subprocess
    import sys
    import tempfile

    from planaria.runtime.planning.measured_costs import _wait_ready

    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stderr.write('no such model'); sys.exit(3)"],
                                stdout=subprocess.PIPE, stderr=log, text=True)
        with pytest.raises(RuntimeError, match=r"exit code 3\): no such model"):
            _wait_ready(proc, log, timeout_s=60)
        proc.stdout.close()
