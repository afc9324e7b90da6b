"""The Triton kernels against their PyTorch references, forward and backward.

On a machine without a GPU the kernels run through Triton's interpreter
(`PLANARIA_KERNELS=triton`); with one, they are compiled and run on it. Every case
first checks that the dispatcher really picks the kernel (a silent fall-back to the
reference would compare the reference with itself), and fall-back warnings are errors.

Relative error is norm-wise, ||kernel - reference|| / ||reference||, over the output and
over every input's gradient: under 1e-5 in float32, under 1e-2 in bfloat16. The shapes
include sizes that are not multiples of the kernels' blocks (rows of 100 in blocks of
128, 2100 vocabulary entries in blocks of 1024, 3 heads in blocks of 4, ...).
"""
from __future__ import annotations

import warnings

import pytest
import torch

from planaria import kernels as K
from planaria.kernels import dispatch
from planaria.kernels.cross_entropy import IGNORE_INDEX

if dispatch.triton is None:
    pytest.skip("Triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("error::UserWarning")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and dispatch.interpreter_problem() is not None:
    pytest.skip(dispatch.interpreter_problem(), allow_module_level=True)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = list(TOLERANCE)


@pytest.fixture(autouse=True)
def triton_kernels(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "triton")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp(min=1e-30)).item()


def assert_matches(op: str, kernel, reference, inputs: list[torch.Tensor], dtype: torch.dtype) -> None:
    """Outputs and the gradients of every input agree."""
    assert dispatch.use_triton(op, "auto", *inputs), f"{op} would not run its kernel here"
    runs = []
    for fn in (kernel, reference):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        out = fn(*leaves)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
        (out.float() * weights.float()).sum().backward()
        runs.append((out, [x.grad for x in leaves]))
    (out, grads), (ref_out, ref_grads) = runs
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    tol = TOLERANCE[dtype]
    assert relative_error(out, ref_out) < tol, f"{op} forward: {relative_error(out, ref_out):.2e}"
    for i, (grad, ref_grad) in enumerate(zip(grads, ref_grads)):
        assert relative_error(grad, ref_grad) < tol, f"{op} grad of input {i}: {relative_error(grad, ref_grad):.2e}"


def randn(*shape, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 64), (3, 5, 100), (2, 7, 1000)])
def test_rms_norm(shape, dtype):
    x, weight = randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype, seed=1)
    assert_matches("rms_norm", lambda x, w: K.rms_norm(x, w, 1e-5),
                   lambda x, w: K.rms_norm_reference(x, w, 1e-5), [x, weight], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8, 128), (7, 33), (3, 5, 700)])
def test_swiglu(shape, dtype):
    gate, up = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype, seed=1)
    assert_matches("swiglu", K.swiglu, K.swiglu_reference, [gate, up], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 16, 4, 32), (2, 7, 3, 10), (1, 5, 6, 24)])
def test_rotary(shape, dtype):
    x = randn(*shape, dtype=dtype)
    # Tables longer than the sequence, as the model keeps them (cut to x's length).
    cos, sin = K.rotary_tables(shape[1] + 3, shape[3], 10000.0, torch.float32, DEVICE)
    assert_matches("apply_rotary", lambda x: K.apply_rotary(x, cos, sin),
                   lambda x: K.apply_rotary_reference(x, cos, sin), [x], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab", [(16, 256), (13, 2100), (5, 50)])
def test_cross_entropy(rows, vocab, dtype):
    logits = randn(rows, vocab, dtype=dtype, scale=3.0)
    target = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    target[1] = IGNORE_INDEX  # an ignored token
    assert_matches("cross_entropy", lambda x: K.cross_entropy(x, target),
                   lambda x: K.cross_entropy_reference(x, target), [logits], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden, vocab, chunk", [(16, 32, 256, None), (13, 40, 2100, 4), (9, 24, 50, 2)])
def test_linear_cross_entropy(rows, hidden, vocab, chunk, dtype):
    h = randn(rows, hidden, dtype=dtype)
    weight = randn(vocab, hidden, dtype=dtype, seed=1, scale=hidden ** -0.5)
    target = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    target[0] = IGNORE_INDEX
    assert_matches("linear_cross_entropy", lambda h, w: K.linear_cross_entropy(h, w, target, chunk_rows=chunk),
                   lambda h, w: K.linear_cross_entropy_reference(h, w, target), [h, weight], dtype)


def test_unsupported_shape_falls_back_to_the_reference_with_one_warning():
    gate, up = randn(4, 8, dtype=torch.float32), randn(8, dtype=torch.float32)  # broadcasting: no kernel
    with pytest.warns(UserWarning, match="swiglu runs its PyTorch reference: gate .* and up .* differ"):
        out = K.swiglu(gate, up)
    torch.testing.assert_close(out, K.swiglu_reference(gate, up))
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        K.swiglu(gate, up)
    assert not again, "the same reason is said once"


def test_config_flag_reference_wins_over_the_environment():
    x = randn(3, 64, dtype=torch.float32)
    assert not dispatch.use_triton("rms_norm", "reference", x)
    with pytest.raises(ValueError, match="kernels must be one of"):
        K.rms_norm(x, torch.ones(64), 1e-5, kernels="fast")

