"""The references' gradients, which the kernels are held to, checked numerically in float64."""
from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from planaria import kernels as K
from planaria.kernels.cross_entropy import IGNORE_INDEX


def leaf(*shape, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_()


def test_rms_norm_reference():
    assert gradcheck(lambda x, w: K.rms_norm_reference(x, w, 1e-5), (leaf(3, 5, 12), leaf(12, seed=1)))


def test_swiglu_reference():
    assert gradcheck(K.swiglu_reference, (leaf(4, 9), leaf(4, 9, seed=1)))


def test_rotary_reference():
    cos, sin = K.rotary_tables(7, 8, 10000.0, torch.float64)
    assert gradcheck(lambda x: K.apply_rotary_reference(x, cos, sin), (leaf(2, 5, 3, 8),))


def test_cross_entropy_reference():
    target = torch.tensor([3, 0, IGNORE_INDEX, 19, 7])
    assert gradcheck(lambda x: K.cross_entropy_reference(x, target), (leaf(5, 20, scale=2.0),))


def test_linear_cross_entropy_reference():
    target = torch.tensor([3, 0, IGNORE_INDEX, 19])
    assert gradcheck(lambda h, w: K.linear_cross_entropy_reference(h, w, target),
                     (leaf(4, 6), leaf(20, 6, seed=1)))


@pytest.mark.parametrize("chunk_rows", [1, 3, None])
def test_chunked_paths_without_the_kernels(chunk_rows):
    """The chunked linear cross-entropy and the vocabulary-parallel cross-entropy's
    statistics also run on plain PyTorch (the CPU path): their gradients too."""
    target = torch.tensor([3, 0, IGNORE_INDEX, 19, 5])
    assert gradcheck(lambda h, w: K.linear_cross_entropy(h, w, target, chunk_rows=chunk_rows, kernels="reference"),
                     (leaf(5, 6), leaf(20, 6, seed=1)))


@pytest.mark.parametrize("hidden_grad, weight_grad, grad_mode, matmuls", [
    (True, True, True, 3),     # training: the logits, and both gradients in the forward
    (True, False, True, 2),    # a frozen head: no weight gradient
    (False, True, True, 2),
    (True, True, False, 1),    # evaluation under no_grad: the logits only
])
def test_the_fused_head_computes_only_the_gradients_autograd_will_ask_for(hidden_grad, weight_grad,
                                                                          grad_mode, matmuls):
    """Counted in matmul FLOPs (torch's own counter): each gradient is a matmul as large as
    the logits', and evaluation used to pay for both. The loss and the gradients asked for
    still equal the unfused head's."""
    from torch.utils.flop_counter import FlopCounterMode

    rows, hidden, vocab = 12, 16, 40
    target = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(1))
    h, w = leaf(rows, hidden).requires_grad_(hidden_grad), leaf(vocab, hidden, seed=2).requires_grad_(weight_grad)
    with FlopCounterMode(display=False) as counter, torch.set_grad_enabled(grad_mode):
        loss = K.linear_cross_entropy(h, w, target, chunk_rows=5, kernels="reference")
    assert counter.get_total_flops() == matmuls * 2 * rows * vocab * hidden
    h_ref, w_ref = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = K.linear_cross_entropy_reference(h_ref, w_ref, target)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)
    if not grad_mode:
        assert not loss.requires_grad
        return
    loss.backward()
    want.backward()
    for x, x_ref, asked in ((h, h_ref, hidden_grad), (w, w_ref, weight_grad)):
        assert (x.grad is not None) == asked
        if asked:
            torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-14)
