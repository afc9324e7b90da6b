"""`benchmarks/kernels.py --smoke`: the GPU benchmark's script runs every case end to end
on CPU (the kernels through Triton's interpreter), so a GPU session spends its time on
figures, not on finding a bug in the script."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planaria.kernels import dispatch

if dispatch.triton is None:
    pytest.skip("Triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

if dispatch.interpreter_problem() is not None:
    pytest.skip(dispatch.interpreter_problem(), allow_module_level=True)

pytestmark = pytest.mark.timeout(300)
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"
OPERATIONS = {"rms_norm", "swiglu", "apply_rotary", "cross_entropy", "linear_cross_entropy"}


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_kernel_benchmark_runs_every_case(dtype, tmp_path):
    report = tmp_path / "kernels.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--dtype", dtype, "--json", str(report)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(report.read_text())
    assert result["failures"] == {}
    rows = result["rows"]
    passes = {(op, p) for op in OPERATIONS for p in ("forward", "forward+backward")}
    passes |= {(op, "forward+backward, gradient 1") for op in ("cross_entropy", "linear_cross_entropy")}
    assert {(r["operation"], r["pass"]) for r in rows} == passes
    for r in rows:
        assert r["planaria_ms"] > 0 and r["eager_ms"] > 0 and r["compile_ms"] > 0
        assert r["relative_error"] < (1e-5 if dtype == "float32" else 1e-2), r
