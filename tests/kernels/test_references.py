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
