"""A joiner's warm-up (`planaria.runtime.parallel.warm_up`): it runs the computation of
the rank it is planned as, for every layout, dtype and schedule a job can have, and
leaves nothing of the job's behind it changed (its random state; no process group)."""
from __future__ import annotations

import pytest
import torch

from planaria.runtime.config.loading import load_config
from planaria.runtime.models.tensor_parallel import TensorParallel
from planaria.runtime.parallel.optim import build_optimizer
from planaria.runtime.parallel.warm_up import _forward_backward, _layer, _step, warm_up
from planaria.runtime.worker.build import build_engine
from planaria.templates.layout import plan_from_layout
from tests.launch import TINY


@pytest.mark.parametrize("overrides, virtual_stages", [
    ([], 1),
    (["train.dtype=float64", "train.exact_reduction=true"], 1),
    (["model.fused_head_loss=true", "train.recompute=true"], 1),
    (["train.dtype=bfloat16"], 1),
    ([], 2),
])
def test_every_rank_of_a_plan_warms_up_without_touching_the_jobs_random_state(overrides, virtual_stages):
    cfg = load_config(TINY, overrides)
    engine = build_engine(cfg, torch.device("cpu"))
    layout = [[1, 1, 1, 1]] if virtual_stages == 2 else [[1, 2, 1]]
    plan = plan_from_layout(layout=layout, n_blocks=cfg.model.n_layers, tp=1, schedule="1f1b" if virtual_stages == 1
                            else "interleaved", virtual_stages=virtual_stages, global_batch=8, micro_batch=2)
    state = torch.get_rng_state()
    for rank in range(plan.world_size):
        assert warm_up(engine.model, engine.optim, engine.settings, plan, rank) > 0
    assert torch.equal(torch.get_rng_state(), state)
    assert engine.held_layers() == []  # the engine holds nothing of it: its layers were throwaway copies


def test_a_tensor_parallel_rank_is_not_warmed_up():
    """Its layers' forward all-reduces over the epoch's tp group, which does not exist yet."""
    cfg = load_config(TINY, ["parallel.tp=2"])
    engine = build_engine(cfg, torch.device("cpu"))
    plan = plan_from_layout(layout=[[2, 2]], n_blocks=cfg.model.n_layers, tp=2, schedule="1f1b", virtual_stages=1,
                            global_batch=8, micro_batch=2)
    assert warm_up(engine.model, engine.optim, engine.settings, plan, 0) is None


def test_with_wide_gradient_sums_the_optimizer_step_is_warmed_up_too():
    """`train.exact_reduction` sums gradients in `main_grad` and leaves `grad` empty until
    the sync rounds them into it: the warm-up does the same, or its optimizer step would
    skip every parameter and warm nothing."""
    cfg = load_config(TINY, ["train.dtype=float32", "train.exact_reduction=true"])
    engine = build_engine(cfg, torch.device("cpu"))
    assert engine.settings.wide_sums == torch.float64
    tp = TensorParallel()
    layer = _layer(engine.model, engine.settings, 1, tp)
    optimizer = build_optimizer(layer, engine.optim)
    _forward_backward(engine.model, engine.settings, [layer], 1, 2, 2, tp)
    assert all(p.grad is None and p.main_grad is not None for p in layer.parameters())
    _step(layer, optimizer, engine.settings.wide_sums)
    assert all(optimizer.state[p] for p in layer.parameters())

