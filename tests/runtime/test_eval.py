"""The validation loss (`eval.every`): forward only on the held-out split, the same value
under any plan as the single-process reference's model gives on the same samples."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from planaria.runtime.config.loading import load_config
from planaria.runtime.config.sections import ConfigError
from planaria.runtime.data.token_datasets import dataset_for
from planaria.runtime.models.llama import LayerModel
from planaria.runtime.parallel.optim import optimizer_settings
from planaria.runtime.parallel.reference import train_reference
from tests.launch import TINY, read_metrics, reference_run, torchrun_train

STEPS = 5
EVERY = 2
JOB = [
    "model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.vocab_size=128",
    "model.seq_len=16", "data.source=synthetic", f"train.steps={STEPS}", "train.global_batch=8",
    "train.micro_batch=1", "train.dtype=float64", "train.lr=0.01", "train.grad_clip=0.5",
    "train.log_every=100", f"eval.every={EVERY}", "eval.batches=2", "output.save_final=false",
]


@pytest.fixture(scope="module")
def reference_losses() -> list[float]:
    return reference_run(JOB).losses


@pytest.fixture(scope="module")
def reference_val_losses() -> dict[int, float]:
    """{step: validation loss} of plain PyTorch in float64, after steps 1, 3 and 4 (the
    last): the model trained that far, then the eval batches through it whole."""
    cfg = load_config(TINY, JOB)
    train, val = dataset_for(cfg), dataset_for(cfg, "val")
    out = {}
    for step in range(STEPS):
        if not cfg.eval.due(step, STEPS):
            continue
        run = train_reference(LayerModel(cfg.model, seed=cfg.train.seed), optimizer_settings(cfg.train), train,
                              steps=step + 1, global_batch=8, micro_batch=8, data_seed=cfg.data.seed,
                              grad_clip=cfg.train.grad_clip, dtype=torch.float64)
        with torch.no_grad():
            losses = [F.cross_entropy(run.model(x).flatten(0, 1), y.flatten()).item()
                      for x, y in (val.batch(i, 8, cfg.data.seed) for i in range(cfg.eval.batches))]
        out[step] = sum(losses) / len(losses)
    return out


def test_eval_is_due_every_n_steps_and_after_the_last():
    cfg = load_config(TINY, JOB)
    assert [i for i in range(STEPS) if cfg.eval.due(i, STEPS)] == [1, 3, 4]
    assert not dataclasses.replace(cfg.eval, every=0).due(1, STEPS)
    with pytest.raises(ConfigError, match=r"data\.source: 'stdlib' has no 'val' split; prepare a corpus .* or "
                                          r"set eval\.every: 0"):
        dataset_for(load_config(TINY, [*JOB, "data.source=stdlib"]), "val")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc, overrides", [
    # One process under -m slow (the default suite's time): the pipelined case below keeps
    # the same evaluation, and the harder schedule.
    pytest.param(1, [], marks=pytest.mark.slow),
    (2, ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2"]),
    pytest.param(3, ["parallel.layout=[[4],[2,2]]", "parallel.microbatches=[3,5]"], marks=pytest.mark.slow),
    pytest.param(4, ["parallel.tp=2", "parallel.pp=2", "parallel.schedule=zb1f1b"], marks=pytest.mark.slow),
], ids=["1-process", "pp2-interleaved", "heterogeneous-[[4],[2,2]]", "tp2-pp2-zb1f1b"])
def test_validation_loss_equals_the_reference_under_any_plan(nproc, overrides, reference_val_losses,
                                                              reference_losses, tmp_path):
    torchrun_train(nproc, JOB + overrides, tmp_path)
    metrics = read_metrics(tmp_path)
    got = {m["step"]: m["val_loss"] for m in metrics if "val_loss" in m}
    assert sorted(got) == sorted(reference_val_losses) == [1, 3, 4]
    for step, value in got.items():
        assert abs(value - reference_val_losses[step]) < 1e-9, (step, value, reference_val_losses[step])
    # Evaluating leaves training as it was: the steps' losses are the reference's.
    for m, ref_loss in zip(metrics, reference_losses):
        assert abs(m["loss"] - ref_loss) < 1e-9, (m["step"], m["loss"], ref_loss)
