"""Hugging Face LLaMA models for the interop tests: built from a config with random
weights (no download), and run in true float64.

transformers computes two things in float32 whatever the model's dtype, which would
cap the logit agreement near 1e-7:
- the rotary tables: `inv_freq` is built with dtype=torch.float by the RoPE init
  functions, and `LlamaRotaryEmbedding.forward` casts it and the positions with
  `.float()`;
- `LlamaRMSNorm.forward` normalises in float32 and casts back.
`float64_llama` patches both (for the test's duration, through pytest's monkeypatch):
the RoPE init function is called again with `torch.float` pointing at float64, so that
Hugging Face's own formula (llama3 scaling included) runs in float64, and the two
forwards are replaced by the same formulas without the float32 casts. Attention runs
through SDPA, whose softmax stays in the inputs' dtype (the eager path's is float32).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")  # the `test` extra
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402


def _rms_norm_float64(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _rotary_float64(self, x: torch.Tensor, position_ids: torch.Tensor):
    freqs = position_ids[..., None].to(torch.float64) * self.inv_freq.to(torch.float64)
    emb = torch.cat((freqs, freqs), dim=-1)
    return ((emb.cos() * self.attention_scaling).to(x.dtype),
            (emb.sin() * self.attention_scaling).to(x.dtype))


def float64_llama(model: LlamaForCausalLM, monkeypatch) -> LlamaForCausalLM:
    """`model` in float64 with its rotary tables and norms computed in float64 (see above)."""
    model = model.to(torch.float64).eval()
    rotary = model.model.rotary_emb
    init = rotary.compute_default_rope_parameters if rotary.rope_type == "default" \
        else ROPE_INIT_FUNCTIONS[rotary.rope_type]
    with monkeypatch.context() as patch:
        patch.setattr(torch, "float", torch.float64)
        inv_freq, _ = init(model.config)
    assert inv_freq.dtype == torch.float64
    rotary.inv_freq = inv_freq
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", _rotary_float64)
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_float64)
    return model


def random_llama(*, n_layers=2, d_model=32, n_heads=4, n_kv_heads=4, ffn=72, vocab=96,
                 tied=False, rope_scaling=None, seed=0, max_positions=64) -> LlamaForCausalLM:
    """A LlamaForCausalLM with random weights, norm gains included (all ones would hide
    a swapped norm), in float64."""
    rope = {"rope_type": "default", "rope_theta": 5000.0}
    if rope_scaling:
        rope = {**rope_scaling, "rope_theta": 5000.0}
    config = LlamaConfig(vocab_size=vocab, hidden_size=d_model, intermediate_size=ffn,
                         num_hidden_layers=n_layers, num_attention_heads=n_heads,
                         num_key_value_heads=n_kv_heads, max_position_embeddings=max_positions,
                         rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=tied,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model
