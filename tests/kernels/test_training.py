"""`configs/tiny.yaml` trains the same with the Triton kernels (through the interpreter
on CPU; compiled, too, on a machine with a GPU) as with the PyTorch references, in
float32: the same losses step by step."""
from __future__ import annotations

import pytest
import torch

from planaria.kernels import dispatch
from tests.launch import cases_with_slow, read_metrics, torchrun_train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
if dispatch.triton is None:
    pytest.skip("Triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

STEPS = 3
JOB = [f"train.steps={STEPS}", "train.global_batch=4", "train.log_every=100"]
CPU_INTERPRETER = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
"""On CPU through the interpreter, also on a machine with a GPU (where two ranks would
not find two GPUs, and the kernels would otherwise be compiled)."""
CASES = {
    # rms_norm, apply_rotary, swiglu and the fused head + loss over a vocabulary split in
    # two (tp=2); the plain vocabulary-parallel cross-entropy has its own test over gloo
    # (test_vocab_parallel.py), and this is the suite's longest kernel test already.
    # pp=1: the plan is given, so neither run spends its start profiling for the planner.
    "tp2-fused-head": (2, ["parallel.tp=2", "parallel.pp=1", "model.fused_head_loss=true"], CPU_INTERPRETER,
                       "kernels: Triton through its interpreter"),
}
if torch.cuda.is_available():
    # The compiled kernels in training on the GPU: one process, the whole vocabulary.
    CASES["gpu-fused-head"] = (1, ["parallel.pp=1", "model.fused_head_loss=true"], {}, "kernels: Triton")


@pytest.mark.parametrize("case", cases_with_slow(CASES, {"tp2-fused-head"}))
def test_tiny_trains_the_same_with_the_kernels_as_with_the_references(case, tmp_path):
    nproc, overrides, env, said_for_triton = CASES[case]
    if env is CPU_INTERPRETER and dispatch.interpreter_problem() is not None:
        pytest.skip(dispatch.interpreter_problem())
    runs = {}
    for mode in ("reference", "triton"):
        proc = torchrun_train(nproc, JOB + overrides, tmp_path / mode, env={**env, dispatch.ENV: mode},
                              timeout=540)
        assert "runs its PyTorch reference" not in proc.stderr, proc.stderr[-2000:]
        said = said_for_triton if mode == "triton" else "kernels: PyTorch references"
        assert said in proc.stdout, proc.stdout[-2000:]
        runs[mode] = [m["loss"] for m in read_metrics(tmp_path / mode)]
    assert len(runs["triton"]) == STEPS
    assert runs["triton"] == pytest.approx(runs["reference"], rel=1e-5)
