"""LLaMA 3.1's rotary scaling: the tables against Meta's per-frequency formula, and
against Hugging Face's `llama3` inverse frequencies where transformers is installed."""
from __future__ import annotations

import math

import pytest
import torch

from planaria import kernels as K

SCALING = (8.0, 1.0, 4.0, 8192)  # factor, low_freq_factor, high_freq_factor, original context
HEAD_DIM, THETA = 128, 500000.0


def meta_apply_scaling(freqs: list[float], factor, low_freq_factor, high_freq_factor, old_context_len):
    """LLaMA 3.1's `apply_scaling`, frequency by frequency, in plain Python floats."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    scaled = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            scaled.append(freq)
        elif wavelen > low_freq_wavelen:
            scaled.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            scaled.append((1 - smooth) * freq / factor + smooth * freq)
    return scaled


def test_scaled_tables_follow_metas_formula():
    freqs = [1.0 / THETA ** (i / HEAD_DIM) for i in range(0, HEAD_DIM, 2)]
    expected = meta_apply_scaling(freqs, *SCALING)
    # All three regimes occur: kept, divided by the factor, interpolated.
    kinds = {"kept" if e == f else "divided" if e == f / SCALING[0] else "between" for e, f in zip(expected, freqs)}
    assert kinds == {"kept", "divided", "between"}
    positions = [0, 1, 17, 4095, 100_000]
    cos, sin = K.rotary_tables(max(positions) + 1, HEAD_DIM, THETA, torch.float64, scaling=SCALING)
    for t in positions:
        angles = torch.tensor([t * f for f in expected], dtype=torch.float64)
        torch.testing.assert_close(cos[t], angles.cos(), rtol=0, atol=1e-10)
        torch.testing.assert_close(sin[t], angles.sin(), rtol=0, atol=1e-10)
    plain_cos, _ = K.rotary_tables(max(positions) + 1, HEAD_DIM, THETA, torch.float64)
    assert not torch.allclose(plain_cos[4095], cos[4095])


def test_scaled_frequencies_match_hugging_faces_llama3():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    factor, low, high, original = SCALING
    config = transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": THETA, "factor": factor, "low_freq_factor": low,
                         "high_freq_factor": high, "original_max_position_embeddings": original})
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    freqs = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    ours = K.llama3_inverse_frequencies(freqs, *SCALING)
    assert attention_factor == 1.0
    # Hugging Face computes the frequencies in float32.
    torch.testing.assert_close(ours.float(), theirs, rtol=2e-6, atol=0)
