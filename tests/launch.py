"""Helpers for tests that launch real training processes with torchrun."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"


def torchrun_train(nproc: int, overrides: list[str], out_dir: Path, *, config: Path = TINY,
                   timeout: float = 240, extra_args: list[str] = (),
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `torchrun -m planaria.train` on loopback; fail with its output if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", *extra_args, "-m", "planaria.train", str(config),
           *overrides, f"output.dir={out_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def read_metrics(out_dir: Path) -> list[dict]:
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def reference_run(overrides: list[str], config: Path = TINY):
    """The job of `overrides` trained by plain single-process PyTorch in float64: the
    oracle multi-process tests compare losses and final parameters with.

    Each step is one forward and backward of the whole global batch, not of the job's
    microbatches: the same step in exact arithmetic (the losses are means over equal
    microbatches), 1e-13 from it in float64, far inside the tests' 1e-9, and several times
    faster: a 120-step reference took 9 to 15 s in microbatches of one sequence."""
    import torch

    from planaria.runtime.config.loading import load_config
    from planaria.runtime.data.token_datasets import build_dataset
    from planaria.runtime.models.llama import LayerModel
    from planaria.runtime.parallel.reference import train_reference
    from planaria.runtime.parallel.optim import optimizer_settings

    cfg = load_config(config, overrides)
    dataset = build_dataset(cfg.data.source, seq_len=cfg.model.seq_len,
                            vocab_size=cfg.model.vocab_size, seed=cfg.data.seed)
    return train_reference(LayerModel(cfg.model, seed=cfg.train.seed), optimizer_settings(cfg.train), dataset,
                           steps=cfg.train.steps, global_batch=cfg.train.global_batch,
                           micro_batch=cfg.train.global_batch, data_seed=cfg.data.seed,
                           grad_clip=cfg.train.grad_clip, dtype=torch.float64)


def assert_final_parameters(directory: Path, reference) -> None:
    """The saved final model (`directory`, tp shards reassembled) equals the reference's."""
    import torch

    from planaria.runtime.state.saved_model import load_full_model

    saved = load_full_model(directory)
    for index, layer in enumerate(reference.model):
        for name, expected in layer.state_dict().items():
            torch.testing.assert_close(saved[index][name], expected, rtol=1e-9, atol=1e-12,
                                       msg=lambda m: f"layer {index} {name}: {m}")


def cases_with_slow(cases, slow: set[str]) -> list:
    """The names of `cases` for `pytest.mark.parametrize`, those in `slow` marked slow
    (run by `make test-slow`, kept out of the default suite's time)."""
    import pytest

    return [pytest.param(name, marks=pytest.mark.slow) if name in slow else name for name in cases]
