"""One GPU: the trainer with compiled blocks and fused AdamW (`train.compile`,
`train.optimizer_impl: fused`) in bf16 follows the trainer without them, step for step
within bf16's rounding, and its process compiles the blocks once (docs/gpu.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.gpu.conftest import gpus_or_skip
from tests.launch import TINY

STEPS = 12


def _train(tmp_path, name: str, overrides: list[str]) -> list[float]:
    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "planaria.train", str(TINY), f"train.steps={STEPS}",
                           "train.dtype=bfloat16", "parallel.pp=1", "comm.backend=nccl", f"output.dir={out}",
                           "output.save_final=false", *overrides],
                          capture_output=True, text=True, timeout=280,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "peak GPU memory:" in proc.stdout, proc.stdout[-2000:]
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_compiled_blocks_and_fused_adamw_follow_the_eager_step_on_one_gpu(tmp_path):
    gpus_or_skip(1)
    eager = _train(tmp_path, "eager", [])
    compiled = _train(tmp_path, "compiled", ["train.compile=true", "train.optimizer_impl=fused"])
    print({"eager": eager, "compiled": compiled})  # for docs/gpu.md: `pytest -s` shows it
    assert len(eager) == len(compiled) == STEPS
    # bf16 rounds each product to 8 bits of mantissa, and the compiled block fuses and
    # orders its operations its own way: the runs agree to bf16's precision, and both learn.
    assert max(abs(a - b) for a, b in zip(eager, compiled)) < 0.02 * eager[0]
    assert compiled[-1] < compiled[0] - 0.1 and eager[-1] < eager[0] - 0.1
