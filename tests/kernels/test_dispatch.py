"""The dispatcher's view of an interpreter that cannot run: Triton before 3.7 with numpy
2.4 or later fails inside every kernel with a loop ("only 0-dimensional arrays can be
converted to Python scalars"). The dispatcher names the versions and the way out, and
runs the reference, instead of letting that error surface from Triton's internals."""
from __future__ import annotations

import types

import pytest
import torch

from planaria import kernels as K
from planaria.kernels import dispatch

if dispatch.triton is None:
    pytest.skip("Triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)


def versions(monkeypatch, triton: str, numpy: str) -> None:
    monkeypatch.setattr(dispatch, "triton", types.SimpleNamespace(__version__=triton))
    monkeypatch.setattr(dispatch, "numpy", types.SimpleNamespace(__version__=numpy))


@pytest.mark.parametrize("triton, numpy, broken", [
    ("3.6.0", "2.4.0", True), ("3.3.1", "2.5.2", True), ("3.6.0", "2.3.5", False),
    ("3.7.0", "2.4.0", False), ("3.9.0+git1a2b3c", "2.5.0rc1", False), ("3.5.1", "1.26.4", False)])
def test_the_interpreter_problem_is_named_for_the_versions_that_have_it(monkeypatch, triton, numpy, broken):
    versions(monkeypatch, triton, numpy)
    problem = dispatch.interpreter_problem()
    assert (problem is not None) == broken
    if broken:
        assert f"Triton {triton}" in problem and f"numpy {numpy}" in problem and "3.7 or later" in problem


def test_a_broken_interpreter_runs_the_reference_and_says_why(monkeypatch):
    if not dispatch.interpreting():
        pytest.skip("this process compiles its kernels (a GPU machine): no interpreter to ask for")
    monkeypatch.setenv(dispatch.ENV, "triton")
    versions(monkeypatch, "3.6.0", "2.4.6")
    monkeypatch.setattr(dispatch, "_warned", set())
    x, weight = torch.randn(3, 64), torch.randn(64)
    with pytest.warns(UserWarning, match=r"rms_norm runs its PyTorch reference: Triton 3\.6\.0's interpreter"):
        out = K.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, K.rms_norm_reference(x, weight, 1e-5))
    assert "numpy 2.4.6" in dispatch.describe("auto") and dispatch.describe("auto").startswith("PyTorch references")
