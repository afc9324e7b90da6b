"""The engine's pipeline stages are built with static metadata (`LayerModel.stage_examples`),
and train exactly as with the metadata torch infers at a stage's first step.

Each case spawns the plan's processes (gloo on loopback). Every worker trains the same
job twice in one world: engines whose stages get the examples, then engines that build
them without (dynamic mode: `Engine._stage_examples` returns None); each runs two steps,
moves to a next epoch of the same plan (new groups, new stages), runs two more and one
evaluation. The losses, the validation loss and the final parameters must be equal to
the bit, the static engine's stages must hold their metadata before any step and have
run in torch's static mode, and the dynamic engine's in its dynamic mode.
"""
from __future__ import annotations

import queue
import traceback
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planaria.runtime.models.llama import LayerModel
from planaria.runtime.models.tensor_parallel import TensorParallel
from planaria.runtime.state.layer_sources import FromReplicas
from tests.launch import TINY, cases_with_slow

JOB = [
    "model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.vocab_size=128",
    "model.seq_len=16", "data.source=synthetic", "train.global_batch=16", "train.micro_batch=2",
    "train.dtype=float64", "train.lr=0.01", "train.warmup_steps=2", "train.grad_clip=0.5",
]

CASES = {
    "pp3-plain-head": (3, ["parallel.pp=3"]),
    "pp2-fused-head-loss-tied": (2, ["parallel.pp=2", "model.fused_head_loss=true", "model.tie_embeddings=true"]),
    "pp2-interleaved-v2": (2, ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2"]),
    "pp2-zb1f1b-recompute": (2, ["parallel.pp=2", "parallel.schedule=zb1f1b", "train.recompute=true"]),
    "tp2-pp2-tied": (4, ["parallel.tp=2", "parallel.pp=2", "model.tie_embeddings=true"]),
    # A 1-stage pipeline (tokens in, logits out of one stage) beside a 2-stage one.
    "heterogeneous-[[4],[2,2]]": (3, ["parallel.layout=[[4],[2,2]]", "parallel.microbatches=[3,5]"]),
    "pp2-bfloat16-autocast": (2, ["parallel.pp=2", "train.dtype=bfloat16"]),
}


def _metadata_given(stages) -> bool:
    """Whether torch would run these stages in static mode (its own test of the metadata)."""
    from torch.distributed.pipelining._utils import InferenceMode

    return bool(stages) and all(not InferenceMode.needs_dynamic(s._user_meta, True) for s in stages)


def _modes(stages) -> set[str]:
    return {s._inference_mode.value for s in stages}


def _train(cfg, plan, rank: int, data, val) -> dict:
    """Two steps, a next epoch of the same plan, two more steps and an evaluation."""
    from planaria.runtime.worker.build import start_engine

    engine = start_engine(cfg, plan, rank, torch.device("cpu"))
    given = _metadata_given(engine.stages)
    losses = [engine.train_step(i, data, cfg.data.seed).loss for i in (0, 1)]
    modes = _modes(engine.stages)
    engine.enter_epoch(replace(engine.plan, epoch=1, first_iteration=2), rank, layers=FromReplicas([]))
    given = given and _metadata_given(engine.stages)
    losses += [engine.train_step(i, data, cfg.data.seed).loss for i in (2, 3)]
    val_loss = engine.evaluate(val, cfg.data.seed, 1)
    modes |= _modes(engine.stages) | _modes(engine._eval_stages)
    params = [p.detach().clone() for layer in engine.held_layers() for p in engine.shard(layer).module.parameters()]
    engine.destroy()
    return {"given": given, "losses": losses, "val": val_loss, "modes": modes, "params": params}


def _worker(rank: int, world_size: int, overrides: list[str], rendezvous: str, out) -> None:
    try:
        from planaria.runtime.config.loading import load_config
        from planaria.runtime.config.validation import plan_from_config
        from planaria.runtime.data.token_datasets import dataset_for
        from planaria.runtime.parallel.engine import Engine

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
        cfg = load_config(TINY, [*JOB, *overrides])
        plan = plan_from_config(cfg, world_size=world_size)
        data, val = dataset_for(cfg), dataset_for(cfg, "val")
        static = _train(cfg, plan, rank, data, val)
        Engine._stage_examples = lambda self, *args: None  # torch infers the metadata
        dynamic = _train(cfg, plan, rank, data, val)
        out.put({
            "rank": rank, "static_given": static["given"], "dynamic_given": dynamic["given"],
            "static_modes": static["modes"], "dynamic_modes": dynamic["modes"],
            "losses": static["losses"], "same_losses": static["losses"] == dynamic["losses"],
            "same_val": static["val"] == dynamic["val"],
            "same_params": len(static["params"]) == len(dynamic["params"]) > 0 and all(
                torch.equal(a, b) for a, b in zip(static["params"], dynamic["params"])),
        })
        dist.destroy_process_group()
    except BaseException:
        out.put({"rank": rank, "error": traceback.format_exc()})


def _run(world_size: int, overrides: list[str], tmp_path, timeout: float) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(rank, world_size, overrides, str(tmp_path / "rendezvous"), out))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    results = []
    try:
        for _ in procs:
            try:
                result = out.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"a worker did not report within {timeout} s; got {results}")
            assert "error" not in result, f"rank {result['rank']}:\n{result['error']}"
            results.append(result)
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return sorted(results, key=lambda r: r["rank"])


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
# The default exactness tests (tests/runtime/test_exactness.py) now run with static
# metadata against a single process, the interleaved and zb1f1b schedules among them:
# those two cases compare the two modes under `make test-slow`, for the default suite's
# time. The others have no default multi-process test of their pipeline shapes but this.
@pytest.mark.parametrize("case", cases_with_slow(CASES, {"pp2-interleaved-v2", "pp2-zb1f1b-recompute"}))
def test_static_metadata_trains_like_inferred_metadata(case, tmp_path):
    world_size, overrides = CASES[case]
    results = _run(world_size, overrides, tmp_path, timeout=200)
    for r in results:
        assert r["static_given"] and r["static_modes"] == {"static"}, r
        assert not r["dynamic_given"] and r["dynamic_modes"] == {"dynamic"}, r
        assert r["same_losses"] and r["same_val"] and r["same_params"], r
    assert len({tuple(r["losses"]) for r in results}) == 1  # every rank saw the committed losses


class _Alone(TensorParallel):
    """One tp rank's shard computing without its group: sums over tp ranks are skipped."""

    def all_reduce(self, tensor, op=None):
        return tensor


def _examples(model: LayerModel, start: int, stop: int, tp_size: int, dtypes, requires_grad=True):
    return model.stage_examples(start, stop, 2, tp_size, *dtypes, requires_grad=requires_grad)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("dtypes", [(torch.float64, None), (torch.float32, torch.bfloat16)])
def test_examples_match_the_layers_outputs(fused, tp_size, dtypes):
    """The examples' shapes, dtypes and strides are what the layers return, run for real
    under the engine's autocast (with tp = 2, one rank's shards without their group: the
    sums over tp ranks are skipped, which changes no shape or dtype)."""
    from planaria.runtime.config.loading import load_config

    cfg = load_config(TINY, ["model.n_layers=2", "model.d_model=32", "model.vocab_size=128", "model.seq_len=16",
                             f"model.fused_head_loss={str(fused).lower()}"])
    model = LayerModel(cfg.model, seed=0)
    tp = _Alone(rank=0, size=tp_size)
    param_dtype, autocast_dtype = dtypes
    layers = [model.build_layer(i, tp, param_dtype, torch.device("cpu"), pretrained=True)
              for i in range(model.num_layers)]
    x = torch.randint(cfg.model.vocab_size, (2, cfg.model.seq_len))
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        for index, layer in enumerate(layers):
            inputs, outputs = _examples(model, index, index + 1, tp_size, dtypes)
            assert (x.shape, x.dtype, x.stride()) == (inputs.shape, inputs.dtype, inputs.stride())
            x = layer(x)
            assert (x.shape, x.dtype, x.stride()) == (outputs.shape, outputs.dtype, outputs.stride()), index
    whole = _examples(model, 0, model.num_layers, tp_size, dtypes)
    assert (whole[1].shape, whole[1].dtype) == (x.shape, x.dtype)
    assert whole[0].is_meta and not whole[0].requires_grad and whole[1].requires_grad
    assert not _examples(model, 1, 2, tp_size, dtypes, requires_grad=False)[0].requires_grad
