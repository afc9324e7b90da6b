"""The cost model's data: model shape, hardware, and per-layer costs.

Everything the planner knows about a job is here, as plain numbers: how long each
layer's forward and backward take for one microbatch on one worker of a stage, how
long its parameter update takes once per iteration, how many bytes of state it pins,
how many bytes of activations it keeps per microbatch in flight, and how many bytes it
hands to the next stage; and, for the links, what a message costs besides its latency
and bandwidth, and what the iteration's small commit all-reduce costs. Two sources fill a `CostModel`:
the analytic estimate from FLOPs and bytes (`planaria.templates.analytic`) and the
profiler that measures real layers (`planaria.templates.profiler`).

No torch import: a plan for 1,024 H100 nodes can be made on a laptop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate


def llama_ffn_dim(d_model: int, multiple_of: int = 256, ffn_dim_multiplier: float = 0.0) -> int:
    """LLaMA's SwiGLU width: 2/3 of 4 * d_model, scaled by `ffn_dim_multiplier` (0: not),
    rounded up to a multiple of `multiple_of` (d_model 4096 gives 11008; LLaMA 3 8B's
    1.3 gives 14336)."""
    hidden = int(2 * 4 * d_model / 3)
    if ffn_dim_multiplier:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


def check_kv_heads(n_heads: int, n_kv_heads: int, tp: int) -> None:
    """Refuse key/value heads that grouped-query attention or tensor parallelism cannot split."""
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"model.n_kv_heads={n_kv_heads} must divide model.n_heads={n_heads} "
                         "(each key/value head serves a group of query heads); 0 means n_heads")
    if n_kv_heads % tp and tp % n_kv_heads:
        raise ValueError(f"model.n_kv_heads={n_kv_heads} and parallel.tp={tp}: tensor parallelism splits "
                         "the key/value heads (tp divides n_kv_heads) or replicates each on tp/n_kv_heads "
                         "ranks (n_kv_heads divides tp); pick such a tp")


def kv_heads_of_rank(n_kv_heads: int, tp_rank: int, tp: int) -> range:
    """The key/value heads tp rank `tp_rank` holds: a contiguous n_kv_heads/tp of them, or,
    with more ranks than heads, the one head r * n_kv_heads // tp its query heads use
    (each head then lives on tp/n_kv_heads ranks)."""
    if n_kv_heads % tp == 0:
        per_rank = n_kv_heads // tp
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    head = tp_rank * n_kv_heads // tp
    return range(head, head + 1)


@dataclass(frozen=True)
class ModelShape:
    """The decoder's shape, as the planner needs it (mirrors the `model` config section)."""

    n_layers: int
    """Transformer blocks."""
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    ffn_hidden: int = 0
    """SwiGLU hidden size; 0 means LLaMA's rule (`llama_ffn_dim`)."""
    n_kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means n_heads."""
    multiple_of: int = 256
    ffn_dim_multiplier: float = 0.0

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len", "multiple_of"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("ffn_hidden", "n_kv_heads", "ffn_dim_multiplier"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.{name} must not be negative, got {getattr(self, name)}")

    @property
    def num_layers(self) -> int:
        """Planned layers: embedding, blocks, final norm plus head."""
        return self.n_layers + 2

    @property
    def ffn_dim(self) -> int:
        return self.ffn_hidden or llama_ffn_dim(self.d_model, self.multiple_of, self.ffn_dim_multiplier)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def kv_dim(self) -> int:
        """Rows of wk and of wv: key/value heads times the head size."""
        return self.kv_heads * (self.d_model // self.n_heads)

    def layer_kind(self, index: int) -> str:
        if not 0 <= index < self.num_layers:
            raise ValueError(f"layer {index} does not exist; the model has {self.num_layers}")
        if index == 0:
            return "embedding"
        return "head" if index == self.num_layers - 1 else "block"

    def layer_parameters(self, index: int) -> int:
        """Parameter count of layer `index`, all tp shards together."""
        d = self.d_model
        kind = self.layer_kind(index)
        if kind == "embedding":
            return self.vocab_size * d
        if kind == "head":
            return self.vocab_size * d + d
        return 2 * d * d + 2 * d * self.kv_dim + 3 * d * self.ffn_dim + 2 * d

    def block_parameters_per_rank(self, tp: int) -> int:
        """A block's parameters on one of `tp` workers: the matrices split, the norm gains
        whole, and with more ranks than key/value heads one head's wk and wv each."""
        d = self.d_model
        kv_rows = self.kv_dim // tp if self.kv_heads % tp == 0 else self.kv_dim // self.kv_heads
        return (2 * d * d + 3 * d * self.ffn_dim) // tp + 2 * d * kv_rows + 2 * d

    @property
    def parameters(self) -> int:
        return sum(self.layer_parameters(i) for i in range(self.num_layers))


@dataclass(frozen=True)
class Hardware:
    """One kind of node: its devices and links."""

    name: str
    device_memory_bytes: int
    """Usable memory of one device."""
    peak_flops: float
    """Peak dense FLOP/s of one device in the training precision."""
    gpus_per_node: int
    """Devices (workers) per node; a stage's tp workers live on one node."""
    intra_node_bandwidth: float
    """Bytes/s between two devices of a node (tensor-parallel all-reduce)."""
    inter_node_bandwidth: float
    """Bytes/s from one device to a device of another node (pipeline sends, gradient sync)."""
    matmul_efficiency: float = 0.5
    """Fraction of peak that training layers reach; MFU of a well-run job."""
    link_latency_s: float = 1e-5
    """Fixed cost of one message: from the send being posted to the data arriving."""
    host_memory_bytes: int = 0
    """The node's host (CPU) memory, where peer snapshots are kept (0: unknown, not checked)."""
    message_overhead_s: float = 0.0
    """Time a worker is kept busy by each point-to-point message it sends or receives
    (posting it and completing it), on top of the latency, which the receiver can hide
    behind compute. Every stage pays it for every microbatch at every boundary it
    touches, so it is part of the stage time. Negligible where the runtime posts
    messages asynchronously on a separate stream (NCCL on GPUs: 0 in the presets);
    about 0.1 ms with gloo on CPU, where the worker's own thread posts and completes
    every message (measured by `planaria.templates.gloo_links.measure_gloo_links`)."""
    message_overhead_quantiles: tuple[float, ...] = ()
    """The spread of `message_overhead_s`: equally likely values (quantiles of the
    measured per-message costs, their mean `message_overhead_s`). Empty where not
    measured. Only `planaria.templates.replay` uses it: messages that stall delay the
    rank waiting for them, which the mean alone does not show."""
    collective_latency_s: float = 0.0
    """Time of an all-reduce of a few bytes among a job's workers: the per-iteration
    commit all-reduce of [squared gradient norm, loss]. 0 in the GPU presets (tens of
    microseconds, lost in their iteration times); measured on CPU."""
    action_overhead_s: float = 0.0
    """What the pipeline runtime itself costs a worker per action (one chunk's forward,
    backward, or split-backward half for one microbatch), beyond the layers' compute and
    the messages' `message_overhead_s`: the schedule's dispatch, the stage's input and
    output bookkeeping, building the point-to-point ops. Every stage pays it for every
    action, so it is part of the stage time. 0 in the GPU presets (the host runs ahead
    of the device, so it hides behind compute); on CPU a few tenths of a millisecond,
    measured by running the runtime itself on known work
    (`planaria.runtime.planning.pipeline_probe`)."""

    def __post_init__(self) -> None:
        for name in ("device_memory_bytes", "peak_flops", "gpus_per_node",
                     "intra_node_bandwidth", "inter_node_bandwidth", "matmul_efficiency"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware {self.name!r}: {name} must be positive, "
                                 f"got {getattr(self, name)}")
        for name in ("link_latency_s", "message_overhead_s", "collective_latency_s",
                     "action_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"hardware {self.name!r}: {name} must not be negative, "
                                 f"got {getattr(self, name)}")


@dataclass(frozen=True)
class LayerCost:
    """One layer on one worker of a stage (tensor parallelism already applied), one microbatch."""

    forward_s: float
    backward_s: float
    """Input and weight gradients together."""
    state_bytes: int
    """Bytes pinned for the whole run: parameters, gradients, optimizer state (this worker's
    shard), and `wide_sum_bytes`."""
    activation_bytes: int
    """Bytes kept from forward to backward, per microbatch in flight."""
    output_bytes: int
    """Bytes of the layer's output, sent to the next stage when a stage ends here."""
    optimizer_s: float = 0.0
    """Once per iteration, not per microbatch: this layer's share of the parameter
    update on one worker (gradient norm, clipping, the optimizer step, zeroing the
    gradients), and its once-per-step tensor-parallel sums. The analytic model counts
    only the latter (`analytic.tp_step_communication_time`)."""
    gradient_bytes: int | None = None
    """Bytes of this worker's summed gradients: what the sync across pipelines all-reduces.
    None: a quarter of `held_bytes` (float32 gradients of float32 or bf16 training, summed
    in float32)."""
    wide_sum_bytes: int = 0
    """Of `state_bytes`, the float64 sums the gradients accumulate in (`train.exact_reduction`
    below float64): pinned, but neither moved nor snapshotted."""

    @property
    def held_bytes(self) -> int:
        """The layer's state proper: parameters, gradients and moments (what a move copies,
        and a snapshot three quarters of)."""
        return self.state_bytes - self.wide_sum_bytes

    def __post_init__(self) -> None:
        if self.optimizer_s < 0:
            raise ValueError(f"optimizer_s must not be negative, got {self.optimizer_s}")
        if self.gradient_bytes is None:
            object.__setattr__(self, "gradient_bytes", self.held_bytes // 4)


@dataclass(frozen=True)
class CostModel:
    """Per-layer costs of one job shape: a model, a micro batch size, a tp degree, a device."""

    shape: ModelShape
    hardware: Hardware
    tp: int
    micro_batch: int
    layers: tuple[LayerCost, ...]
    source: str = "analytic"
    """'analytic' or 'profiled'."""

    def __post_init__(self) -> None:
        if len(self.layers) != self.shape.num_layers:
            raise ValueError(f"cost model has {len(self.layers)} layer costs for a model of "
                             f"{self.shape.num_layers} layers")
        prefix = lambda values: (0.0, *accumulate(values))  # noqa: E731
        object.__setattr__(self, "_compute", prefix(l.forward_s + l.backward_s for l in self.layers))
        object.__setattr__(self, "_state", prefix(l.state_bytes for l in self.layers))
        object.__setattr__(self, "_activation", prefix(l.activation_bytes for l in self.layers))
        object.__setattr__(self, "_update", prefix(l.optimizer_s for l in self.layers))
        object.__setattr__(self, "_gradient", prefix(l.gradient_bytes for l in self.layers))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def compute_time(self, start: int, stop: int) -> float:
        """Forward plus backward of layers [start, stop) for one microbatch."""
        return self._compute[stop] - self._compute[start]

    def update_time(self, start: int, stop: int) -> float:
        """The once-per-iteration parameter update of layers [start, stop) (`optimizer_s`)."""
        return self._update[stop] - self._update[start]

    def state_bytes(self, start: int, stop: int) -> int:
        return int(self._state[stop] - self._state[start])

    def gradient_bytes(self, start: int, stop: int) -> int:
        """The summed gradients of layers [start, stop) on one worker (`LayerCost.gradient_bytes`)."""
        return int(self._gradient[stop] - self._gradient[start])

    def activation_bytes(self, start: int, stop: int) -> int:
        return int(self._activation[stop] - self._activation[start])

    def send_time(self, last_layer: int) -> float:
        """Forward send plus backward send across a stage boundary after `last_layer`:
        latency plus bytes / bandwidth, each way. Paid once per iteration, on the first
        microbatch's path through the pipeline (later messages overlap with compute)."""
        size = self.layers[last_layer].output_bytes
        return 2 * (size / self.hardware.inter_node_bandwidth + self.hardware.link_latency_s)

    def boundary_overhead(self) -> float:
        """Per microbatch, what one side of a stage boundary keeps its worker busy: one
        message out and one in (the activation one way, its gradient the other), each
        `Hardware.message_overhead_s`. Part of stage time, unlike `send_time`."""
        return 2 * self.hardware.message_overhead_s

    def chunk_overhead(self, schedule: str) -> float:
        """Per microbatch, what the runtime's actions on one chunk cost its worker:
        `Hardware.action_overhead_s` for each (forward and backward; forward, input and
        weight gradient for zb1f1b, whose backward is two actions)."""
        actions = 3 if schedule == "zb1f1b" else 2
        return actions * self.hardware.action_overhead_s

    def commit_time(self) -> float:
        """The per-iteration commit all-reduce (`Hardware.collective_latency_s`)."""
        return self.hardware.collective_latency_s
