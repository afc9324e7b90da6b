"""The engine's state API (held_layers, shard, empty_shard, install_shards, drop_shard):
what transfers, checkpoints and the audit use instead of the engine's own members.

One process, a real gloo group of one. A shard exported into a fresh shell and installed
in place of the original trains on exactly as the original would have (the same losses
and parameters, to the bit, in float64): nothing of its state is left behind. And the
training loop's components see every committed step in order.
"""
from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from planaria.runtime.config.loading import load_config
from planaria.runtime.config.validation import plan_from_config
from planaria.runtime.data.token_datasets import dataset_for
from planaria.runtime.parallel.loop import Call, Evaluation, Every, run_steps
from planaria.runtime.state.checkpoints import load_layer, snapshot_layer
from planaria.runtime.state.layer_sources import FromReplicas
from planaria.runtime.worker.build import start_engine
from tests.launch import TINY

OVERRIDES = ["train.dtype=float64", "train.steps=4", "data.source=synthetic", "parallel.pp=1", "parallel.dp=1"]


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def engine_and_data(overrides=()):
    cfg = load_config(TINY, [*OVERRIDES, *overrides])
    engine = start_engine(cfg, plan_from_config(cfg, world_size=1), 0, torch.device("cpu"))
    return cfg, engine, dataset_for(cfg)


def parameters(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for layer in engine.held_layers() for p in engine.shard(layer).module.parameters()]


@pytest.mark.timeout(120)
def test_a_shard_moved_out_and_back_in_trains_on_bit_for_bit(world):
    cfg, moved, data = engine_and_data()
    _, kept, _ = engine_and_data()
    assert moved.held_layers() == list(range(cfg.model.n_layers + 2))
    for engine in (moved, kept):
        engine.train_step(0, data, cfg.data.seed)
    layer = 1
    shell = moved.empty_shard(layer)
    assert shell is not moved.shard(layer) and layer in moved.held_layers()
    load_layer(shell, snapshot_layer(moved.shard(layer)))  # parameters and AdamW state
    moved.drop_shard(layer)
    assert layer not in moved.held_layers()
    with pytest.raises(RuntimeError, match=f"holds no shard of layer {layer}"):
        moved.shard(layer)
    moved.install_shards({layer: shell})
    # The pipeline still holds the old module: both move to a next epoch of the same plan,
    # which rebuilds it from the shards held.
    for engine in (moved, kept):
        engine.enter_epoch(replace(engine.plan, epoch=1, first_iteration=1), 0, layers=FromReplicas([]))
    losses = [[e.train_step(i, data, cfg.data.seed).loss for i in (1, 2)] for e in (moved, kept)]
    assert losses[0] == losses[1]
    assert all(torch.equal(a, b) for a, b in zip(parameters(moved), parameters(kept)))
    for engine in (moved, kept):
        engine.destroy()


@pytest.mark.timeout(120)
def test_the_loop_hands_each_step_to_its_components_in_order(world):
    cfg, engine, data = engine_and_data(["eval.every=2", "eval.batches=1"])
    seen, evaluated, saved = [], [], []
    evaluation = Evaluation(dataset_for(cfg, "val"), cfg.data.seed, cfg.eval.batches, cfg.eval.due,
                            report=lambda step, val_loss: evaluated.append(step))
    components = [Call(lambda e, ctx: seen.append(("before", ctx.step, ctx.val_loss))), evaluation,
                  Call(lambda e, ctx: seen.append(("after", ctx.step, ctx.val_loss is not None))),
                  Every(3, lambda e, step: saved.append(step), before_last=True)]
    assert run_steps(engine, data, cfg.data.seed, 0, cfg.train.steps, components)
    assert [s for s in seen if s[0] == "before"] == [("before", i, None) for i in range(4)]
    assert [s for s in seen if s[0] == "after"] == [("after", 0, False), ("after", 1, True),
                                                    ("after", 2, False), ("after", 3, True)]
    assert evaluated == [1, 3] and saved == [2]
    engine.destroy()


@pytest.mark.timeout(120)
def test_an_epoch_whose_ranks_drop_no_layer_enters_without_the_barrier_after_the_copy(world, monkeypatch):
    """The barrier after a copy guards the layers a rank drops (none is dropped before every
    rank has what it needs); an epoch in which no rank drops any, restoring nothing,
    leaves it out, and trains on as it would have."""
    cfg, engine, data = engine_and_data()
    engine.train_step(0, data, cfg.data.seed)
    barriers = []
    real = dist.barrier
    monkeypatch.setattr(dist, "barrier", lambda *args, **kw: (barriers.append(kw.get("group")), real(*args, **kw)))
    engine.enter_epoch(replace(engine.plan, epoch=1, first_iteration=1), 0, layers=FromReplicas([]))
    assert barriers == [] and engine.held_layers() == list(range(cfg.model.n_layers + 2))
    assert engine.train_step(1, data, cfg.data.seed).loss > 0
    engine.destroy()


class CountedReads:
    """A dataset that records which iteration's batch was read, and when (during which of
    the engine's steps)."""

    def __init__(self, dataset):
        self.dataset, self.reads, self.step = dataset, [], None

    def batch(self, iteration, *args, **kw):
        self.reads.append((iteration, self.step))
        return self.dataset.batch(iteration, *args, **kw)


@pytest.mark.timeout(120)
def test_the_next_batch_is_fetched_during_the_step_before_and_trains_the_same(world):
    """`EngineSettings.fetch_ahead` (on by default on GPUs): each step reads the next
    iteration's batch while its own computation runs, once, and the losses are those of
    an engine that reads each batch in its own step."""
    losses = {}
    for ahead in (False, True):
        cfg, engine, data = engine_and_data()
        engine.settings = replace(engine.settings, fetch_ahead=ahead)
        counted = CountedReads(data)
        losses[ahead] = []
        for iteration in range(3):
            counted.step = iteration
            losses[ahead].append(engine.train_step(iteration, counted, cfg.data.seed).loss)
        engine.destroy()
        if ahead:
            assert counted.reads == [(0, 0), (1, 0), (2, 1), (3, 2)]
        else:
            assert counted.reads == [(0, 0), (1, 1), (2, 2)]
    assert losses[True] == losses[False]
