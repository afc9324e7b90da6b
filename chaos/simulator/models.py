"""The jobs the simulator plans: model presets, or a Planaria config file.

A preset is a model shape and the batch it trains with. GPT-3 shapes are from the
GPT-3 paper's table of model sizes (layers, d_model, heads, context 2048; the
vocabulary padded to 51,200 as Megatron-LM does). Planaria's block is LLaMA-style
(SwiGLU); its default hidden size 8/3·d_model gives the same parameter count and FLOPs
as GPT-3's 4·d_model GELU MLP, so the GPT-3 presets keep the default. LLaMA shapes are
from the LLaMA paper (hidden 11,008 and 13,824, vocabulary 32,000, context 2,048).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from planaria.templates.costs import ModelShape


@dataclass(frozen=True)
class SimJob:
    """What the planner needs of a job, besides the hardware and f."""

    name: str
    shape: ModelShape
    global_batch: int
    """Sequences per optimizer step."""
    micro_batch: int = 1
    dtype: str = "bfloat16"
    recompute: bool = True
    schedule: str = "1f1b"
    virtual_stages: int = 1
    min_stages: int = 1
    exact_reduction: bool = False
    """Float64 gradient sums (`train.exact_reduction`, the cost model's `wide_gradients`):
    off for the jobs of the published comparisons, which sum in float32; a config's
    (`load_job`) says its own."""

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.shape.seq_len


def _gpt3(name: str, layers: int, d_model: int, heads: int, batch: int) -> SimJob:
    return SimJob(name, ModelShape(n_layers=layers, d_model=d_model, n_heads=heads,
                                   vocab_size=51200, seq_len=2048), global_batch=batch)


def _llama(name: str, layers: int, d_model: int, heads: int, ffn: int, batch: int) -> SimJob:
    return SimJob(name, ModelShape(n_layers=layers, d_model=d_model, n_heads=heads, vocab_size=32000,
                                   seq_len=2048, ffn_hidden=ffn), global_batch=batch)


# Global batches: 1,024 sequences (2M tokens of 2,048), the batch LLaMA and GPT-3 6.7B
# trained with, for all presets, so that runs on tens of nodes have enough microbatches
# to keep f+1 pipelines busy.
PRESETS: dict[str, SimJob] = {job.name: job for job in (
    _gpt3("gpt3-medium", 24, 1024, 16, 1024),
    _gpt3("gpt3-2.7b", 32, 2560, 32, 1024),
    _gpt3("gpt3-6.7b", 32, 4096, 32, 1024),
    _llama("llama-7b", 32, 4096, 32, 11008, 1024),
    _llama("llama-13b", 40, 5120, 40, 13824, 1024),
)}


def load_job(spec: str) -> SimJob:
    """A preset by name, or a Planaria config file (its model, train and parallel sections)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if path.suffix not in (".yaml", ".yml") or not path.is_file():
        raise ValueError(f"unknown model {spec!r}: give a preset ({', '.join(PRESETS)}) "
                         "or a Planaria config file (CONFIG.yaml)")
    from planaria.runtime.config.loading import load_config
    from planaria.runtime.config.sections import model_shape  # torch: only for config files

    cfg = load_config(path, [])
    return SimJob(path.stem, model_shape(cfg.model), global_batch=cfg.train.global_batch,
                  micro_batch=cfg.train.micro_batch, dtype=cfg.train.dtype, recompute=cfg.train.recompute,
                  schedule=cfg.parallel.schedule, virtual_stages=cfg.parallel.virtual_stages,
                  min_stages=cfg.parallel.min_stages, exact_reduction=cfg.train.exact_reduction)
