"""bfloat16 parameters for compute over float32 masters (`train.mixed_precision=bf16-params`)
train as float32 parameters under autocast do, within bfloat16's tolerance.

Two real 2-stage pipelines (torchrun, gloo, CPU), the same job of 50 steps, one per
recipe. In the bf16-params run the activations sent between the stages are bfloat16:
the stages' static metadata says so and a stage's output is checked against it
(`pipeline.build_stages`), so a forward that read the float32 masters would fail the
job. Both save float32 parameters: the masters are the layers' state either way.
"""
from __future__ import annotations

import math

import pytest
import torch

from planaria.runtime.config.sections import ConfigError
from planaria.runtime.config.loading import load_config
from planaria.runtime.state.saved_model import load_full_model
from tests.launch import TINY, read_metrics, torchrun_train

STEPS = 50
JOB = [
    "model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.vocab_size=256",
    "model.seq_len=32", "data.source=synthetic", f"train.steps={STEPS}", "train.global_batch=8",
    "train.micro_batch=2", "train.dtype=bfloat16", "train.lr=0.003", "train.warmup_steps=5",
    "train.log_every=100", "parallel.pp=2", "parallel.schedule=1f1b",
]
TOLERANCE = 1.6e-2
"""How far apart the two recipes' losses may be, relative: bfloat16's tolerance as
torch.testing states it (`assert_close`'s default rtol for bfloat16). The recipes round
different tensors (autocast keeps the residual stream in float32), and 50 steps of AdamW
carry each step's differences on; measured here: 3.8e-4 at most."""


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_bf16_parameters_train_as_float32_parameters_under_autocast(tmp_path):
    runs = {}
    for recipe in ("autocast", "bf16-params"):
        out = tmp_path / recipe
        torchrun_train(2, [*JOB, f"train.mixed_precision={recipe}"], out)
        runs[recipe] = [m["loss"] for m in read_metrics(out) if "loss" in m]
        saved = load_full_model(out / "final")
        assert {t.dtype for layer in saved.values() for t in layer.values()} == {torch.float32}, recipe
    autocast, bf16 = runs["autocast"], runs["bf16-params"]
    assert len(autocast) == len(bf16) == STEPS
    assert all(math.isfinite(x) for x in autocast + bf16)
    assert bf16[-1] < 0.8 * bf16[0]  # it trains
    worst = max(abs(a - b) / abs(a) for a, b in zip(autocast, bf16))
    print(f"\nlosses (autocast, bf16-params): first {autocast[0]:.4f} {bf16[0]:.4f}, last {autocast[-1]:.4f} "
          f"{bf16[-1]:.4f}; the largest relative difference {worst:.2e}")
    assert worst <= TOLERANCE, list(zip(autocast, bf16))
    assert autocast != bf16  # the recipes computed differently: the copies were read


def test_bf16_params_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="set train.dtype=bfloat16"):
        load_config(TINY, ["train.mixed_precision=bf16-params", "train.dtype=float32"])
    with pytest.raises(ConfigError, match="zb1f1b"):
        load_config(TINY, ["train.mixed_precision=bf16-params", "train.dtype=bfloat16", "parallel.schedule=zb1f1b"])
