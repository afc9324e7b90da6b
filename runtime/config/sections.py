"""Job configuration: its sections as frozen dataclasses, and what follows from them.

A job's YAML file has the sections `model`, `data`, `train`, `parallel`, `comm`,
`fault_tolerance`, `audit`, `eval`, `checkpoint`, `output` and `logging`; each is a
dataclass here whose fields are its keys, with their defaults and what they mean. A key
whose choices are a closed set is a `Literal`, checked by the loader itself
(`planaria.runtime.config.loading`); the checks across keys are
`planaria.runtime.config.validation`'s. What follows from the sections alone (the
planner's view of the model, its parameter count, the leader's status timeout, whether
the planner chooses the plan) is here too: a node's agent reads it, so nothing in this
package imports torch (tests/test_import_graph.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from planaria.templates.costs import ModelShape, llama_ffn_dim
from planaria.templates.plan import ScheduleName

TrainDtype = Literal["float32", "float64", "bfloat16"]
KernelMode = Literal["auto", "triton", "reference"]
KERNEL_MODES = get_args(KernelMode)
"""`planaria.kernels.MODES`, written out: importing the kernels package imports torch and
Triton, which a node's agent (it checks configs, never computes) does without.
tests/runtime/test_config.py checks that the two agree."""


class ConfigError(ValueError):
    """A configuration a user must fix; the message names the key."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder (`planaria.runtime.models.llama` builds it), checked by `check_config`."""

    n_layers: int = 4
    """Transformer blocks (the plan has n_layers + 2 layers: embedding and head too)."""
    d_model: int = 64
    """Hidden size."""
    n_heads: int = 4
    """Attention (query) heads; must divide d_model and be divisible by parallel.tp."""
    n_kv_heads: int = 0
    """Key/value heads: fewer than n_heads is grouped-query attention (1: multi-query), each
    serving n_heads/n_kv_heads query heads; 0 means n_heads. Must divide n_heads. parallel.tp
    splits them (tp divides n_kv_heads) or replicates each on tp/n_kv_heads ranks."""
    vocab_size: int = 256
    """Vocabulary size; must be divisible by parallel.tp."""
    seq_len: int = 64
    """Tokens per sequence."""
    ffn_hidden: int = 0
    """SwiGLU hidden size; 0 means LLaMA's rule from multiple_of and ffn_dim_multiplier."""
    multiple_of: int = 256
    """LLaMA's FFN rounding: int(8/3 * d_model), times ffn_dim_multiplier if set, rounded
    up to a multiple of this (d_model 4096: 11008)."""
    ffn_dim_multiplier: float = 0.0
    """LLaMA's FFN scale before rounding (LLaMA 2 70B and LLaMA 3: 1.3); 0: none."""
    norm_eps: float = 1e-5
    """RMSNorm's epsilon."""
    rope_theta: float = 10000.0
    """Rotary base (LLaMA 3: 500000)."""
    rope_scaling: dict | None = None
    """None, or Hugging Face's mapping for LLaMA 3.1's long-context rotary scaling:
    {rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0,
    original_max_position_embeddings: 8192}; rope_type 'default' means no scaling."""
    init_std: float = 0.02
    kernels: KernelMode = "auto"
    """Fused Triton kernels (planaria.kernels): "auto" where Triton and a GPU are present,
    "triton" the same but warning when they cannot run, "reference" plain PyTorch.
    PLANARIA_KERNELS=triton runs them through Triton's interpreter on CPU (for tests)."""
    fused_head_loss: bool = False
    """The output projection and the loss as one operation over chunks of tokens
    (planaria.kernels.linear_cross_entropy): the full logits never exist. The last
    layer then outputs the normalised hidden states and the loss applies the head."""
    tie_embeddings: bool = False
    """The output head's weight is the token embedding's (LLaMA 3.2 1B/3B). The embedding
    and the head are different layers, often on different stages: each keeps a copy,
    initialised alike, and their gradients are summed over every rank holding either, so
    the copies stay bit-identical and train as one weight (counted once in the norm)."""
    init_from: str = ""
    """A Hugging Face LLaMA checkpoint directory (config.json, safetensors) to start
    from instead of the seeded init; the `model` keys left out are taken from its
    config.json, and those given must agree with it (planaria.runtime.models.hf_weights)."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads, n_kv_heads resolved (0 -> n_heads)."""
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return llama_ffn_dim(self.d_model, self.multiple_of, self.ffn_dim_multiplier)

    @property
    def rope_scaling_factors(self) -> tuple[float, float, float, int] | None:
        """(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) of
        LLaMA 3.1's scaling, as `planaria.kernels.rotary_tables` takes them; None: none."""
        if not self.rope_scaling or rope_type(self.rope_scaling) in ROPE_NO_SCALING:
            return None
        r = self.rope_scaling
        return (float(r["factor"]), float(r["low_freq_factor"]), float(r["high_freq_factor"]),
                int(r["original_max_position_embeddings"]))

    @property
    def num_layers(self) -> int:
        return self.n_layers + 2


@dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"
    """'synthetic', 'stdlib' (byte-level corpus of the Python standard library), a directory
    prepared by `planaria data prepare` (or its manifest.json), or a headerless .bin file."""
    dtype: Literal["", "uint16", "uint32"] = ""
    """Token width of a headerless nanoGPT .bin: 'uint16' or 'uint32' (required for one);
    empty for prepared shards, whose header says it (a contradicting value is refused)."""
    seed: int = 1234
    """Seed of the sample permutation: iteration k reads samples [k*B, (k+1)*B) of it."""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 20
    """Optimizer steps to run; 0 saves the initial model (output.save_final) untrained."""
    global_batch: int = 8
    """Sequences per step, all pipelines together."""
    micro_batch: int = 1
    """Sequences per microbatch."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float | None = None
    """Learning rate at the end of the cosine decay; unset, lr * min_lr_ratio (so a
    config that changes lr keeps the shape of its schedule)."""
    min_lr_ratio: float = 0.1
    """min_lr as a fraction of lr when min_lr is not given: 0.1, as LLaMA's schedules."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    """'cosine' or 'constant'."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on norm gains)."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay."""
    adam_beta2: float = 0.95
    """AdamW's second-moment decay (0.95 as LLaMA and GPT-3)."""
    adam_eps: float = 1e-8
    """AdamW's epsilon (LLaMA trained with 1e-5)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables."""
    seed: int = 0
    """Seed of the parameter initialisation."""
    dtype: TrainDtype = "float32"
    """'float32' or 'float64' (CPU exactness), 'bfloat16' (mixed precision over float32
    master weights, as `mixed_precision` says)."""
    mixed_precision: Literal["autocast", "bf16-params"] = "autocast"
    """How a bfloat16 job computes (`planaria.runtime.parallel.precision`): 'autocast'
    (float32 parameters, each matmul under torch.autocast reading a bfloat16 cast of its
    weight, made once per step; torchtitan's recipe on one GPU), or 'bf16-params' (the
    forward reads bfloat16 copies of every parameter, made once per step from the
    float32 masters, so activations and the residual stream are bfloat16; gradients
    summed in float32 or wider; FSDP's and Megatron's recipe). The masters, AdamW's
    state and everything that moves or saves them are float32 either way. Only with
    dtype 'bfloat16'."""
    recompute: bool = False
    """Recompute each block's activations in the backward pass instead of storing them."""
    compile: bool = False
    """Compile each transformer block with torch.compile (regional compilation, as
    torchtitan does): one graph serves every block of every stage and epoch, so a
    reconfiguration does not recompile (with tp > 1 the block is compiled in pieces
    around its all-reduces, which run outside: each epoch's group is a new object).
    Refused with the zb1f1b schedule (`check_config`).
    Inside a compiled block the operations are PyTorch's and the compiler
    fuses them; the head's kernels stay as `model.kernels` says."""
    optimizer_impl: Literal["for-loop", "foreach", "fused"] = "for-loop"
    """How each layer's AdamW runs (torch.optim's `foreach` and `fused` flags): a kernel
    per tensor and operation, one per operation over the layer's tensors, or one fused
    kernel. Each layer keeps its own optimizer whatever this is."""
    exact_reduction: bool = True
    """Accumulate gradients over microbatches and pipelines in float64 (and the gradient
    norm too), so that the step does not depend on how the batch is spread over
    pipelines: a job that re-plans after a failure takes bit for bit the float32 steps
    of one that never failed. Costs a float64 copy of the worker's gradients and twice
    the gradient all-reduce's bytes; false keeps them in the parameters' dtype."""
    log_every: int = 1
    """Print progress every this many steps."""

    @property
    def final_lr(self) -> float:
        """Where the cosine decay ends: min_lr, or lr * min_lr_ratio when it is unset."""
        return self.lr * self.min_lr_ratio if self.min_lr is None else self.min_lr


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree: workers per stage."""
    pp: int = 0
    """Stages per pipeline of a homogeneous plan; 0 (with dp 0): the planner decides."""
    dp: int = 0
    """Pipelines of a homogeneous plan; 0 with pp > 0: as many as the processes allow."""
    schedule: ScheduleName = "1f1b"
    """'gpipe', '1f1b', 'interleaved' or 'zb1f1b' (1F1B with split backward)."""
    virtual_stages: int = 1
    """Chunks per stage, for the interleaved schedule."""
    layout: list | None = None
    """Explicit pipelines: transformer blocks per model stage, e.g. [[4], [2, 2]]."""
    microbatches: list | None = None
    """Microbatches per pipeline, e.g. [3, 5]; default: an even split."""
    min_stages: int = 1
    """The planner gives every pipeline at least this many stages."""
    profile_cache: str = ""
    """Where the planner keeps the layer profiles it measures (a job with no layout, pp or
    dp); empty: `output.dir`/profile-cache. A profile is keyed by everything that changes
    it (model, micro batch, dtype, device, threads, torch's version), so one directory can
    serve every job of a machine type and spare each new run the measurement."""


@dataclass(frozen=True)
class CommConfig:
    """Communication and its timeouts."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """'auto': nccl when CUDA is present, else gloo."""
    timeout_s: float = 300.0
    """Collective timeout in seconds."""
    heartbeat_timeout_s: float = 5.0
    """An elastic worker whose process shows no sign of life (its heartbeat thread, which
    beats every second whatever the worker computes or waits for, is frozen with it:
    SIGSTOP, a swapping machine) for this long is killed by its agent, so that the job
    recovers in seconds rather than at its collective timeout; 0: timeout_s."""
    stopped_timeout_s: float = 0.5
    """An elastic worker whose process is stopped (SIGSTOP, SIGTSTP: its state in /proc)
    this long is killed by its agent, without waiting for its heartbeat to lapse; its node
    starts fresh workers that join again (`elastic.worker_supervisor`). 0: only the
    heartbeat."""
    stuck_factor: float = 10.0
    """An elastic worker that makes no progress within a step, outside any collective,
    for this many times the median of its recent steps (at least `stuck_floor_s`) is
    stuck (a deadlock, a call that never returns; on GPUs, what holds the host thread:
    runtime/worker/progress_watch.py says what it cannot see) and killed by its agent; its node
    starts fresh workers that join again (`runtime/worker/progress_watch.py`). A step a
    few times slower than usual is nowhere near it."""
    stuck_floor_s: float = 30.0
    """The least time without progress that counts as stuck, whatever the step time (and
    the whole bound until the epoch's first steps were measured); 0: no stuck check."""
    release: bool = True
    """When the control plane declares an epoch failed, every survivor releases the
    epoch's blocked collectives at once (`planaria.runtime.parallel.release`: gloo's connections
    shut down, NCCL's communicators aborted), so that a peer that stopped answering
    without closing anything (frozen, cut off) holds nobody up for timeout_s; false:
    survivors wait for their collectives to fail or time out."""
    release_stuck_s: float = 10.0
    """A worker whose collectives are still blocked this long after their release (a node
    cut off and back finds its connections already reset, and gloo may wait on them until
    timeout_s) exits, and its agent starts it again as a new worker; time spent building
    layers is not counted. 0: never."""
    connect_timeout_s: float = 30.0
    """Seconds an elastic epoch's process groups get to connect (at most timeout_s): a peer
    that died after the epoch's rendezvous fails the epoch this soon."""


@dataclass(frozen=True)
class FaultToleranceConfig:
    """How many failures a job survives in place."""

    f: int = 1
    """Failures to survive without a checkpoint: the planner keeps f+1 replicas of every
    layer (Oobleck's f)."""
    cut_wait_s: float = 60.0
    """When the nodes the leader can reach hold neither every layer nor a peer snapshot
    as new as the job, but nodes out of reach may (cut off by a partition, or out of
    etcd with no probe finding their agent gone), the job waits this long for them to
    come back before it trains steps again from older state (`elastic.cut_wait`); a
    machine that vanished looks the same, so this bounds what a lost one costs. 0: never
    waits."""


@dataclass(frozen=True)
class AuditConfig:
    """The replica audit: are the replicas of each layer still bit-identical?"""

    every: int = 0
    """Every this many steps, compare checksums of each layer across its replicas; 0: never."""
    repair: bool = False
    """On a mismatch, overwrite the minority from the majority of the replicas."""


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0
    """Compute the validation loss (data's `val` split, forward only) every this many
    steps and after the last; 0: never."""
    batches: int = 4
    """Batches of train.global_batch sequences per evaluation: the same samples every time
    (the first batches of the split's seeded order), so evaluations compare."""

    def due(self, iteration: int, steps: int) -> bool:
        """Whether the validation loss is computed after step `iteration` of `steps`."""
        return bool(self.every) and ((iteration + 1) % self.every == 0 or iteration == steps - 1)


@dataclass(frozen=True)
class OutputConfig:
    dir: str = "runs/default"
    """Where metrics.jsonl and the final model go."""
    save_final: bool = True
    """Write the final parameters (one file per layer and tp rank) to `dir`/final."""


@dataclass(frozen=True)
class TensorBoardConfig:
    enabled: bool = False
    """Write the training metrics as TensorBoard event files, each committed step exactly
    once whichever worker writes it (docs/training_metrics.md)."""
    dir: str = ""
    """The run's TensorBoard directory; empty: `output.dir`/tensorboard. Shared by every
    node that can become the plan's rank 0 (the writer), as checkpoint.dir is."""


@dataclass(frozen=True)
class WandbConfig:
    enabled: bool = False
    """Also send what is written to the event files to a Weights & Biases run (needs the
    `wandb` package and logging.tensorboard.enabled: the event files record what was
    written)."""
    project: str = "planaria"
    entity: str = ""
    """The W&B team or user; empty: W&B's default for the logged-in user."""
    mode: Literal["online", "offline"] = "online"
    """'offline' keeps the run on disk, for `wandb sync` later."""
    name: str = ""
    """The run's display name; empty: W&B's."""
    id: str = ""
    """The run's id, the same for every writer of the job; empty: derived from the job's
    run id."""
    dir: str = ""
    """Where wandb keeps its files; empty: `output.dir`."""


@dataclass(frozen=True)
class LoggingConfig:
    """Where the training metrics go besides the logs (metrics.jsonl, commits-*.jsonl)."""

    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0
    """Save a checkpoint after every this many steps, in the background; 0: never. Only
    used when some layer has no surviving replica (more failures than replicas)."""
    dir: str = ""
    """Where checkpoints go; empty: `output.dir`/checkpoints. Must be shared by all nodes."""
    keep: int = 2
    """Complete checkpoints kept; older ones are deleted once a newer one is complete."""
    memory_every: int = 1
    """Keep a peer snapshot of every layer's state after every this many steps, in host
    memory: the worker's own copy and `memory_copies` on other nodes (docs/recovery.md,
    "Peer snapshots"); when some layer loses every replica, the job goes back to it
    rather than to the disk checkpoint. 0: never (elastic jobs only)."""
    memory_copies: int = 2
    """Nodes, other than the layer's own, that keep each shard's peer snapshot: a layer
    with replicas on R nodes loses its state to memory only when R + memory_copies nodes
    fail together (fewer when the job has fewer nodes)."""


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.output.dir) / "checkpoints"

    @property
    def tensorboard_dir(self) -> Path | None:
        """The run's TensorBoard directory, or None when logging.tensorboard is off."""
        t = self.logging.tensorboard
        if not t.enabled:
            return None
        return Path(t.dir) if t.dir else Path(self.output.dir) / "tensorboard"


ROPE_NO_SCALING = (None, "default")
"""rope_scaling types that leave the rotary frequencies as they are."""
ROPE_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_type(scaling: dict):
    return scaling.get("rope_type", scaling.get("type"))  # "type": older Hugging Face configs


def normalized_rope_scaling(scaling: dict | None) -> dict | None:
    """What a rope_scaling means, in one spelling: None for no scaling (absent, empty,
    or of type 'default'), else the mapping with `rope_type` (never the older `type`)."""
    if not scaling or rope_type(scaling) in ROPE_NO_SCALING:
        return None
    rest = {k: v for k, v in scaling.items() if k not in ("rope_type", "type")}
    return {"rope_type": rope_type(scaling), **rest}


def uses_planner(cfg: Config) -> bool:
    """No explicit layout and no pp/dp: the planner chooses the plan for the processes at hand."""
    p = cfg.parallel
    return p.layout is None and p.pp == 0 and p.dp == 0


# gloo retries a connection refused by a dead peer (its retry limit is 3), each attempt
# under the connect timeout, and connects to the dead peers one after another.
GLOO_CONNECT_ATTEMPTS = 4


def connect_timeout_s(p: "CommConfig") -> float:
    """How long an elastic epoch's connections may take: its process groups' to their
    peers, a rank's to the epoch's bootstrap store (`connect_timeout_s`, at most `timeout_s`)."""
    return min(p.connect_timeout_s, p.timeout_s)


def job_store_timeout_s(p: "CommConfig") -> float:
    """A worker's waits on the job's store (a key another worker publishes: an epoch's
    bootstrap store address, say): the collective timeout and a minute, so that a wait
    for a peer's word outlasts the peer's own collectives."""
    return p.timeout_s + 60.0


def status_timeout_s(p: "CommConfig") -> float:
    """How long the leader waits for a live worker's status after a failure before it
    kills the worker as hung: the collective timeout, plus what an epoch's connection to
    peers that died after its rendezvous can take (gloo's retries of the connect timeout),
    plus margin. A shorter wait killed every survivor of a triple node loss in the p3
    replay while they were still failing their connections, and with them the job."""
    return p.timeout_s + GLOO_CONNECT_ATTEMPTS * connect_timeout_s(p) + 15.0


def parameter_count(m: ModelConfig) -> int:
    """The model's parameters, a tied weight once."""
    tied = m.vocab_size * m.d_model if m.tie_embeddings else 0  # a tied weight counts once
    return model_shape(m).parameters - tied


def model_shape(model: ModelConfig) -> ModelShape:
    """The planner's view of a `model` config section."""
    return ModelShape(n_layers=model.n_layers, d_model=model.d_model, n_heads=model.n_heads,
                      vocab_size=model.vocab_size, seq_len=model.seq_len,
                      ffn_hidden=model.ffn_hidden, n_kv_heads=model.n_kv_heads,
                      multiple_of=model.multiple_of, ffn_dim_multiplier=model.ffn_dim_multiplier)
