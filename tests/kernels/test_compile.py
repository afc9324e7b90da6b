"""Every kernel compiles for an H100 (sm_90) with Triton's real compiler, on any machine.

The interpreted tests run the kernels' Python; this one runs the compiler a GPU would:
`python -m planaria.kernels.compile_check` drives each operation's forward and backward at
a 7B model's sizes and at sizes that are powers of two nowhere, and compiles every launch
down to a cubin. It asserts that every operation's forward and backward kernels compiled
that none spills registers to local memory, and that at a 7B model's sizes their global
loads and stores are vectorised.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from planaria.kernels import compile_check, dispatch

if dispatch.triton is None:
    pytest.skip("Triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

pytestmark = pytest.mark.timeout(300)


def test_every_kernel_compiles_for_sm90_without_spills(tmp_path):
    report = tmp_path / "compiled.json"
    env = {**os.environ, **compile_check.ENV}
    done = subprocess.run([sys.executable, "-m", "planaria.kernels.compile_check", "--arch", "90",
                           "--dtype", "bfloat16", "float32", "--model", "llama-7b", "odd",
                           "--json", str(report)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    kernels = json.loads(report.read_text())
    per_case = Counter((k["model"], k["dtype"]) for k in kernels)
    # Per model and dtype: RMSNorm and SwiGLU forward and backward, the rotation both
    # ways, the cross-entropy's statistics and gradient.
    assert per_case == {(m, d): 8 for m in ("llama-7b", "odd") for d in ("bfloat16", "float32")}
    assert {k["op"] for k in kernels} == {"rms_norm", "swiglu", "apply_rotary", "cross_entropy"}
    assert all(k["arch"] == 90 and k["registers"] > 0 for k in kernels)
    assert [k for k in kernels if k["local_bytes"]] == []
    # At a 7B model's sizes (rows of multiples of 16 elements) every kernel moves its
    # rows 16 bytes a thread at once; the elementwise and rotary kernels move nothing
    # else (the rotary kernel once read each pair's lanes one element at a time).
    llama = [k for k in kernels if k["model"] == "llama-7b"]
    assert all(k["wide_accesses"] > 0 for k in llama)
    assert [k for k in llama if k["op"] in ("swiglu", "apply_rotary") and k["narrow_accesses"]] == []
    # The launches are sized as on a GPU, not as for the interpreter.
    norm = next(k for k in kernels if k["model"] == "llama-7b" and k["kernel"] == "_forward_kernel"
                and k["op"] == "rms_norm")
    assert norm["constants"] == "BLOCK_R=1 BLOCK=4096" and norm["num_warps"] == 8


def test_check_refuses_interpreted_kernels():
    if not dispatch.interpreting():
        pytest.skip("this process compiles its kernels (a GPU machine)")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=0"):
        compile_check.check(90, "bfloat16", "llama-7b")
