"""A LLaMA-style decoder, built as an ordered list of layers so any contiguous run is a stage.

Layer 0 is the token embedding, layers 1..n_layers are transformer blocks (RMSNorm,
causal self-attention with rotary embeddings, grouped-query where n_kv_heads <
n_heads, RMSNorm, SwiGLU MLP), and the last layer is the final norm plus the output
head. Each layer is built on its own from a generator seeded by (seed, layer index),
full size, then sharded for tensor parallelism: a layer's initial values do not
depend on where it is placed. With `tie_embeddings` the head's output weight starts
as a copy of the embedding's (drawn from layer 0's generator); `LayerModel.tied_parameters`
names the two copies, which the runtime keeps equal by summing their gradients.

Other models plug in through the same protocol (see `LayerModel`): `build_layer(index,
tp)` returning an `nn.Module`; `shard`, `unshard` and `counts_in_norm`, which say how
a parameter is split over tp ranks; and a loss over the last layer's output.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from planaria.kernels import apply_rotary, linear_cross_entropy, rms_norm, rotary_tables, swiglu
from planaria.runtime.config.sections import ModelConfig
from planaria.runtime.models.tensor_parallel import (ColumnParallelLinear, HeadParallelLinear, RowParallelLinear,
                                                     TensorParallel, VocabParallelEmbedding, copy_to_tp,
                                                     first_head_replica, shard_heads, split, unshard_heads,
                                                     vocab_parallel_cross_entropy)
from planaria.templates.costs import kv_heads_of_rank


def torch_dtypes(name: str) -> tuple[torch.dtype, torch.dtype | None]:
    """(parameter dtype, autocast dtype or None) for `train.dtype`."""
    if name == "bfloat16":
        return torch.float32, torch.bfloat16  # fp32 master weights, bf16 compute
    return getattr(torch, name), None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: str = "auto"):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, kernels=self.kernels)


def initial(rows: int, cols: int, gen: torch.Generator | None, std: float) -> torch.Tensor:
    """A full weight's seeded initial value, N(0, std) from `gen`; with no `gen`, an
    uninitialised tensor of that shape, for a layer whose parameters are about to be
    overwritten (`model.init_from`): drawing them first would cost as much as the
    checkpoint read (LLaMA 3 70B: 4 GB for the embedding alone)."""
    if gen is None:
        return torch.empty(rows, cols)
    return torch.randn(rows, cols, generator=gen) * std


def embedding_init(cfg: ModelConfig, gen: torch.Generator | None) -> torch.Tensor:
    """The embedding's full initial weight (V, C): also the tied head's."""
    return initial(cfg.vocab_size, cfg.d_model, gen, cfg.init_std)


class Embedding(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, C), vocabulary split across tp ranks."""

    TP_SHARD_DIMS = {"embed.weight": 0}

    def __init__(self, cfg: ModelConfig, gen: torch.Generator | None, tp: TensorParallel):
        super().__init__()
        self.embed = VocabParallelEmbedding(embedding_init(cfg, gen), tp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)


class Attention(nn.Module):
    """Causal self-attention, grouped-query where n_kv_heads < n_heads: query head i uses
    key/value head i // (n_heads / n_kv_heads). Heads split across tp ranks (q, k, v
    column-, out row-parallel); key/value heads are replicated where tp exceeds them."""

    def __init__(self, cfg: ModelConfig, gen: torch.Generator | None, tp: TensorParallel, out_std: float):
        super().__init__()
        c, kv_dim = cfg.d_model, cfg.kv_heads * cfg.head_dim
        self.local_heads = cfg.n_heads // tp.size
        self.local_kv_heads = len(kv_heads_of_rank(cfg.kv_heads, tp.rank, tp.size))
        self.head_dim = cfg.head_dim
        self.kernels = cfg.kernels
        self.wq = ColumnParallelLinear(initial(c, c, gen, cfg.init_std), tp)
        self.wk = HeadParallelLinear(initial(kv_dim, c, gen, cfg.init_std), cfg.kv_heads, tp)
        self.wv = HeadParallelLinear(initial(kv_dim, c, gen, cfg.init_std), cfg.kv_heads, tp)
        self.wo = RowParallelLinear(initial(c, c, gen, out_std), tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rotary(self.wq(x).view(b, t, self.local_heads, self.head_dim), cos, sin, kernels=self.kernels)
        kv_shape = (b, t, self.local_kv_heads, self.head_dim)
        k = apply_rotary(self.wk(x).view(kv_shape), cos, sin, kernels=self.kernels)
        v = self.wv(x).view(kv_shape)
        group = self.local_heads // self.local_kv_heads
        if group > 1:  # each key/value head to its query heads: (B, T, H_local, hd)
            # Repeated rather than SDPA's enable_gqa, which not every attention backend takes.
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        # (B, H, T, hd) for scaled_dot_product_attention
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: gate and up column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, gen: torch.Generator | None, tp: TensorParallel, out_std: float):
        super().__init__()
        c, h = cfg.d_model, cfg.ffn_dim
        self.kernels = cfg.kernels
        self.w_gate = ColumnParallelLinear(initial(h, c, gen, cfg.init_std), tp)
        self.w_up = ColumnParallelLinear(initial(h, c, gen, cfg.init_std), tp)
        self.w_down = RowParallelLinear(initial(c, h, gen, out_std), tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(swiglu(self.w_gate(x), self.w_up(x), kernels=self.kernels))


class Block(nn.Module):
    """One transformer block, pre-norm, residual stream (B, T, C) in and out."""

    TP_SHARD_DIMS = {
        "attn.wq.weight": 0, "attn.wk.weight": 0, "attn.wv.weight": 0, "attn.wo.weight": 1,
        "mlp.w_gate.weight": 0, "mlp.w_up.weight": 0, "mlp.w_down.weight": 1,
    }
    TP_KV_HEADS = ("attn.wk.weight", "attn.wv.weight")
    """Split by key/value heads (`HeadParallelLinear`): replicated where tp exceeds them."""

    def __init__(self, cfg: ModelConfig, gen: torch.Generator | None, tp: TensorParallel,
                 recompute: bool = False, compiled: bool = False):
        """`compiled`: the block's forward runs as `compiled_block_forward` (build it from a
        config whose kernels are PyTorch's: the compiler fuses those)."""
        super().__init__()
        self.compiled = compiled
        # GPT-2's scaling of the residual projections keeps the stream's variance flat in depth.
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.kernels)
        self.attn = Attention(cfg, gen, tp, out_std)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.kernels)
        self.mlp = FeedForward(cfg, gen, tp, out_std)
        self.recompute = recompute
        cos, sin = rotary_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta, torch.float64,
                                 scaling=cfg.rope_scaling_factors)
        # Not parameters and not saved: rebuilt from the config wherever the layer lands.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), self.rope_cos, self.rope_sin)
        return x + self.mlp(self.mlp_norm(x))

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return compiled_block_forward()(self, x) if self.compiled else self._forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._run, x, use_reentrant=False)
        return self._run(x)


@functools.cache
def compiled_block_forward():
    """`Block._forward` under torch.compile, made once per process. The block is an
    argument, and torch.compile traces modules' parameters as inputs (its default
    `inline_inbuilt_nn_modules`), so one graph serves every block of the same shape:
    whichever layers a stage holds, in any epoch, nothing recompiles."""
    return torch.compile(Block._forward)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (recompilations
    included): what a worker reports so that a reconfiguration is seen not to recompile."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class Head(nn.Module):
    """Final norm and output projection: (B, T, C) -> logits (B, T, V/tp), split by
    vocabulary; with `fused_head_loss`, (B, T, C) normalised, and `loss` projects."""

    TP_SHARD_DIMS = {"output.weight": 0}

    def __init__(self, cfg: ModelConfig, gen: torch.Generator | None, tp: TensorParallel,
                 tied: torch.Tensor | None = None):
        """`tied`: the embedding's full initial weight, which the output weight copies
        (`tie_embeddings`); otherwise the output weight is drawn from `gen`."""
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.kernels)
        full = embedding_init(cfg, gen) if tied is None else tied
        self.output = ColumnParallelLinear(full, tp)
        self.fused_loss, self.kernels = cfg.fused_head_loss, cfg.kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.norm(x)
        return normed if self.fused_loss else self.output(normed)

    def loss(self, output: torch.Tensor, target: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        """Mean token cross-entropy of this head's `output` (see `forward`)."""
        if not self.fused_loss:
            return vocab_parallel_cross_entropy(output, target, tp, kernels=self.kernels)
        # Megatron's f before the vocabulary-parallel projection: the input's gradient
        # shares are summed over the tp ranks in the backward.
        return linear_cross_entropy(copy_to_tp(output, tp), self.output.weight, target,
                                    tp.group if tp.size > 1 else None, kernels=self.kernels)


class LayerModel:
    """The layer protocol the runtime uses: build layer i for a tp rank, and the loss."""

    def __init__(self, cfg: ModelConfig, seed: int, recompute: bool = False, compile: bool = False):
        """`compile`: blocks run compiled (`train.compile`, `compiled_block_forward`)."""
        self.cfg = cfg
        self.seed = seed
        self.recompute = recompute
        self.compile = compile

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def layer_class(self, index: int) -> type[nn.Module]:
        if not 0 <= index < self.num_layers:
            raise ValueError(f"layer {index} does not exist; the model has {self.num_layers}")
        if index == 0:
            return Embedding
        return Head if index == self.num_layers - 1 else Block

    def shard_dims(self, index: int) -> dict[str, int]:
        """Parameter name -> the dimension tensor parallelism splits; absent means replicated.
        Key/value heads split along dimension 0 but by whole heads (see `shard`)."""
        return dict(getattr(self.layer_class(index), "TP_SHARD_DIMS", {}))

    def _kv_heads(self, index: int, name: str) -> bool:
        return name in getattr(self.layer_class(index), "TP_KV_HEADS", ())

    def replicated_kv_heads(self, index: int, tp_size: int) -> tuple[str, ...]:
        """Names of layer `index`'s parameters that are key/value heads replicated across
        tp ranks (more ranks than heads): their gradients are summed over the replicas."""
        if tp_size <= 1 or self.cfg.kv_heads % tp_size == 0:
            return ()
        return tuple(getattr(self.layer_class(index), "TP_KV_HEADS", ()))

    def shard(self, index: int, name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        """Tp rank `tp_rank`'s piece of parameter `name` of layer `index`, from its full
        tensor: the rule the layers' constructors split by."""
        if self._kv_heads(index, name):
            return shard_heads(full, self.cfg.kv_heads, tp_rank, tp_size)
        dim = self.shard_dims(index).get(name)
        return full.clone() if dim is None else split(full, dim, tp_rank, tp_size)

    def unshard(self, index: int, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor of parameter `name` of layer `index` from the pieces of tp ranks
        0..tp-1 (one copy of each replicated key/value head)."""
        if self._kv_heads(index, name):
            return unshard_heads(shards, self.cfg.kv_heads)
        dim = self.shard_dims(index).get(name)
        return shards[0].clone() if dim is None else torch.cat(shards, dim=dim)

    def counts_in_norm(self, index: int, name: str, tp_rank: int, tp_size: int) -> bool:
        """Whether tp rank `tp_rank` counts its piece of `name` in the global gradient norm,
        so that each distinct piece is counted once: split parameters on every rank,
        replicated ones (norm gains) on rank 0, a replicated key/value head on the first
        rank holding it."""
        if self._kv_heads(index, name):
            return first_head_replica(self.cfg.kv_heads, tp_rank, tp_size)
        return name in self.shard_dims(index) or tp_rank == 0

    def tied_parameters(self) -> tuple[tuple[int, str], ...]:
        """(layer, parameter name) of each copy of the one tied weight: the embedding's
        and the head's (the same shape and tp sharding); empty when nothing is tied."""
        if not self.cfg.tie_embeddings:
            return ()
        return ((0, "embed.weight"), (self.num_layers - 1, "output.weight"))

    def _generator(self, index: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 100_003 + index)

    def build_layer(self, index: int, tp: TensorParallel, dtype: torch.dtype,
                    device: torch.device, *, pretrained: bool, initialised: bool = True) -> nn.Module:
        """Layer `index`'s shard for `tp`. With `model.init_from` and `pretrained`, its
        parameters are the Hugging Face checkpoint's (`planaria.runtime.models.hf_weights`) instead of
        the seeded init, which is then not drawn; a layer about to receive state (a
        checkpoint, a replica) passes pretrained=False and the checkpoint is not read for it.
        `initialised=False`: its parameters left as allocated, neither drawn nor read, for
        a throwaway copy whose values do not matter (`warm_up`)."""
        cls = self.layer_class(index)
        from_checkpoint = initialised and pretrained and bool(self.cfg.init_from)
        gen = None if from_checkpoint or not initialised else self._generator(index)
        if cls is Block:
            cfg = replace(self.cfg, kernels="reference") if self.compile else self.cfg
            layer = Block(cfg, gen, tp, recompute=self.recompute, compiled=self.compile)
        elif cls is Head and self.cfg.tie_embeddings:
            tied_gen = None if from_checkpoint or not initialised else self._generator(0)
            layer = Head(self.cfg, gen, tp, tied=embedding_init(self.cfg, tied_gen))
        else:
            layer = cls(self.cfg, gen, tp)
        layer = layer.to(device=device, dtype=dtype)
        if from_checkpoint:
            from planaria.runtime.models.hf_weights import load_pretrained_layer  # hf imports this module

            load_pretrained_layer(self, index, layer, tp)  # after .to: float64 keeps every bit
        return layer

    def stage_examples(self, start: int, stop: int, micro_batch: int, tp_size: int, param_dtype: torch.dtype,
                       autocast_dtype: torch.dtype | None, requires_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) of layers start..stop-1 run as one pipeline stage on one
        microbatch, as tensors on the meta device: shape, dtype and layout, nothing else
        (torch's static stage metadata, which spares a new stage's first step the
        inference of it). Token ids (B, T) into layer 0; between layers the residual
        stream (B, T, C), contiguous, in the parameters' dtype: the embedding returns it,
        and each block adds its sublayers' outputs, autocast to a dtype no wider, to its
        input; out of the head, with `fused_head_loss` its normed stream (same dtype),
        else the logits (B, T, V/tp) its linear makes (the autocast dtype, when on).
        `requires_grad`: the floating tensors' flag, as training makes them."""
        shape, act = (micro_batch, self.cfg.seq_len), torch.promote_types(param_dtype, autocast_dtype or param_dtype)

        def example(size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            grad = requires_grad and dtype.is_floating_point
            return torch.empty(size, dtype=dtype, device="meta", requires_grad=grad)

        inputs = example(shape, torch.int64) if start == 0 else example((*shape, self.cfg.d_model), act)
        if self.layer_class(stop - 1) is not Head or self.cfg.fused_head_loss:
            return inputs, example((*shape, self.cfg.d_model), act)
        return inputs, example((*shape, self.cfg.vocab_size // tp_size), autocast_dtype or act)

    def loss(self, output: torch.Tensor, target: torch.Tensor, tp: TensorParallel,
             head: nn.Module | None = None) -> torch.Tensor:
        """Mean token cross-entropy of the last layer's `output`: vocabulary-parallel
        logits, or with `fused_head_loss` the hidden states that `head` (the last layer,
        which then must be given) projects inside the loss."""
        if head is not None:
            return head.loss(output, target, tp)
        if self.cfg.fused_head_loss:
            raise ValueError("model.fused_head_loss: the loss needs the head layer, whose projection it applies")
        return vocab_parallel_cross_entropy(output, target, tp, kernels=self.cfg.kernels)
