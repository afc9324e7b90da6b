"""Job configuration: YAML sections as dataclasses, overrides, and validation.

`load_config(path, overrides)` reads a YAML file of sections (`model`, `data`, `train`,
`parallel`, `comm`, `fault_tolerance`, `audit`, `eval`, `checkpoint`, `output`,
`logging`), applies `section.key=value` overrides (values parsed as YAML; a key of a
sub-section, such as `logging.wandb.mode`, is `section.sub.key=value`), and refuses
unknown keys and inconsistent values with a message naming the key and the fix. A key
whose choices are a closed set is a `Literal`, checked by the loader itself.
`plan_from_config` turns the parallel section into a `Plan`. Both run before any process
group exists.

Keys that moved to another section (`MOVED`: `parallel.timeout_s` is `comm.timeout_s`
now, ...) are still read where they were, for one release, with a warning that names
the new key.
"""
from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
import warnings
from typing import Any, Literal, get_args

import yaml

from planaria.templates.costs import ModelShape, check_kv_heads, llama_ffn_dim
from planaria.templates.layout import homogeneous_layout, plan_from_layout
from planaria.templates.plan import Plan, ScheduleName

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
    """Shape of the decoder (`planaria.runtime.model` builds it), checked by `check_config`."""

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
    config.json, and those given must agree with it (planaria.runtime.hf)."""

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
        if not self.rope_scaling or _rope_type(self.rope_scaling) in ROPE_NO_SCALING:
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
    """'float32' or 'float64' (CPU exactness), 'bfloat16' (autocast over float32 master weights)."""
    recompute: bool = False
    """Recompute each block's activations in the backward pass instead of storing them."""
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
    release: bool = True
    """When the control plane declares an epoch failed, every survivor releases the
    epoch's blocked collectives at once (`planaria.runtime.release`: gloo's connections
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


SECTIONS = {f.name: f.default_factory for f in fields(Config)}
CHOICE_HINTS = {
    ("data", "dtype"): "use uint16 or uint32 for a headerless .bin, or leave it empty (a prepared corpus's "
                       "header says it)",
}
"""What to say of a closed set's choices where their names alone do not say enough."""
MOVED = {
    ("parallel", "backend"): ("comm", "backend"),
    ("parallel", "timeout_s"): ("comm", "timeout_s"),
    ("parallel", "heartbeat_timeout_s"): ("comm", "heartbeat_timeout_s"),
    ("parallel", "connect_timeout_s"): ("comm", "connect_timeout_s"),
    ("parallel", "fault_tolerance"): ("fault_tolerance", "f"),
    ("parallel", "audit_every"): ("audit", "every"),
    ("parallel", "audit_repair"): ("audit", "repair"),
}
"""Keys of an earlier release -> where they are now: read for one more release, with a warning."""


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found; give a YAML file such as configs/tiny.yaml")
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); "
                              "give a YAML file such as configs/tiny.yaml") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(err)}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections {sorted(SECTIONS)}")
    _move_old_keys(raw)  # before the overrides: an override of either name wins over the file
    for item in overrides:
        _apply_override(raw, item)
    cfg = _build(raw)
    if cfg.model.init_from:
        from planaria.runtime.hf_config import derive_model_config  # it imports this module

        cfg = replace(cfg, model=derive_model_config(cfg.model, set(raw.get("model") or {})))
    return check_config(cfg)


def _apply_override(raw: dict, item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or key.count(".") not in (1, 2) or "" in key.split("."):
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. train.steps=10 "
                          "(a sub-section's key: section.sub.key=value, e.g. logging.wandb.mode=offline)")
    section, *path, name = key.split(".")
    if not path and (section, name) in MOVED:
        section, name = _moved(section, name)
    if not isinstance(raw.setdefault(section, {}), dict):
        raise ConfigError(f"config section {section!r} must be a mapping")
    target = raw[section]
    for part in path:  # a sub-section (`logging.wandb`)
        if not isinstance(target.setdefault(part, {}), dict):
            raise ConfigError(f"override {item!r}: {section}.{part} is {target[part]!r}, not a sub-section "
                              "of keys")
        target = target[part]
    try:
        target[name] = yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({_yaml_problem(err)}); "
                          "quote it for the shell, e.g. 'parallel.layout=[[4],[2,2]]'") from None


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's complaint on one line, with its line and column (1-based) where it has them."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def _move_old_keys(raw: dict) -> None:
    """Keys of `MOVED` that a config file gives where they were: moved, with a warning
    naming the new key; given both ways in one file, refused."""
    for (section, key), (new_section, new_key) in MOVED.items():
        old = raw.get(section)
        if not isinstance(old, dict) or key not in old:
            continue
        target = raw.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # _build refuses the section
        if new_key in target:
            raise ConfigError(f"{section}.{key} and {new_section}.{new_key} are one setting, given twice; "
                              f"keep {new_section}.{new_key}")
        _moved(section, key)
        target[new_key] = old.pop(key)


def _moved(section: str, key: str) -> tuple[str, str]:
    """Where a key of `MOVED` is now, with the warning that says so."""
    new_section, new_key = MOVED[(section, key)]
    warnings.warn(f"config key {section}.{key} is now {new_section}.{new_key}; the old name is read "
                  "until the next release", FutureWarning, stacklevel=4)
    return new_section, new_key


def _build(raw: dict) -> Config:
    sections = {}
    for name, value in raw.items():
        if name not in SECTIONS:
            raise ConfigError(f"unknown config section {name!r}{_suggest(name, SECTIONS)}; "
                              f"sections are {sorted(SECTIONS)}")
        if not isinstance(value, dict):
            raise ConfigError(f"config section {name!r} must be a mapping of keys to values")
        sections[name] = _build_section(name, SECTIONS[name], value)
    return replace(Config(), **sections)


def _build_section(section: str, factory, values: dict):
    """A section's dataclass from its mapping; a key whose default is itself a dataclass is
    a sub-section (`logging.wandb`), built the same way under its dotted name."""
    default = factory()
    known = {f.name: f for f in fields(default)}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown config key {section}.{key}{_suggest(key, known)}; "
                              f"keys of {section!r} are {sorted(known)}")
    hints = typing.get_type_hints(type(default))
    coerced = {}
    for key, value in values.items():
        sub = getattr(default, key)
        if is_dataclass(sub):
            if not isinstance(value, dict):
                raise ConfigError(f"{section}.{key} must be a mapping of its keys {sorted(f.name for f in fields(sub))}"
                                  f", got {value!r}")
            coerced[key] = _build_section(f"{section}.{key}", type(sub), value)
        else:
            coerced[key] = _coerce(section, key, value, sub, hints[key])
    return replace(default, **coerced)


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               list: "a list", dict: "a mapping"}


def _coerce(section: str, key: str, value, default, hint=None):
    """Check `value` against the key's type: its default's, or for a key that defaults to
    None, the declared one (`float | None`: a number or nothing). YAML reads 1e-2 as a
    string, so a float key takes a string that parses as one."""
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        if value not in choices or isinstance(value, bool):
            raise ConfigError(f"{section}.{key} {value!r} is unknown{_suggest(str(value), choices)}; "
                              + CHOICE_HINTS.get((section, key), f"use one of {', '.join(map(repr, choices))}"))
        return value
    expected = type(default)
    if default is None:
        if value is None:
            return None
        expected = next(t for t in typing.get_args(hint) if t is not type(None))
        expected = typing.get_origin(expected) or expected
    if expected is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    ok = (isinstance(value, (int, float)) if expected is float else isinstance(value, expected))
    if not ok or (isinstance(value, bool) and expected is not bool):
        raise ConfigError(f"{section}.{key} must be {_TYPE_NAMES.get(expected, expected.__name__)}, "
                          f"got {value!r}")
    return float(value) if expected is float else value


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_config(cfg: Config) -> Config:
    """Cross-field checks that need no processes. Returns cfg unchanged."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    _positive(cfg, [("model", "n_layers"), ("model", "d_model"), ("model", "n_heads"),
                    ("model", "vocab_size"), ("model", "seq_len"),
                    ("train", "global_batch"), ("train", "micro_batch"), ("parallel", "tp"),
                    ("parallel", "virtual_stages"), ("parallel", "min_stages")])
    if t.steps < 0:
        raise ConfigError(f"train.steps must be 0 (save the initial model, e.g. one read from "
                          f"model.init_from) or more, got {t.steps}")
    if not t.lr > 0:
        raise ConfigError(f"train.lr must be positive, got {t.lr}")
    if t.min_lr is not None and not 0 <= t.min_lr <= t.lr:
        raise ConfigError(f"train.min_lr must be between 0 and train.lr={t.lr}, got {t.min_lr}; "
                          "or leave it out: it is then lr * train.min_lr_ratio")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio must be between 0 and 1 (the final lr as a fraction of "
                          f"train.lr), got {t.min_lr_ratio}")
    if not (0 <= t.adam_beta1 < 1 and 0 <= t.adam_beta2 < 1) or not t.adam_eps > 0:
        raise ConfigError(f"train.adam_beta1 and adam_beta2 must be in [0, 1) and train.adam_eps positive; "
                          f"got {t.adam_beta1}, {t.adam_beta2}, {t.adam_eps}")
    if t.warmup_steps < 0 or t.weight_decay < 0 or t.grad_clip < 0:
        raise ConfigError("train.warmup_steps, train.weight_decay and train.grad_clip must not be negative "
                          f"(grad_clip 0: off); got {t.warmup_steps}, {t.weight_decay}, {t.grad_clip}")
    if cfg.audit.every < 0:
        raise ConfigError(f"audit.every must be 0 (off) or more, got {cfg.audit.every}")
    if cfg.checkpoint.memory_every < 0 or cfg.checkpoint.memory_copies < 0:
        raise ConfigError(f"checkpoint.memory_every and checkpoint.memory_copies must be 0 (off) or more; got "
                          f"memory_every={cfg.checkpoint.memory_every}, memory_copies={cfg.checkpoint.memory_copies}")
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.every must be 0 (off) or more and checkpoint.keep at least 1; "
                          f"got every={cfg.checkpoint.every}, keep={cfg.checkpoint.keep}")
    c = cfg.comm
    if c.heartbeat_timeout_s < 0:
        raise ConfigError(f"comm.heartbeat_timeout_s must be 0 (the collective timeout) or positive "
                          f"seconds; got {c.heartbeat_timeout_s}")
    if c.timeout_s <= 0 or c.connect_timeout_s <= 0:
        raise ConfigError(f"comm.timeout_s and comm.connect_timeout_s must be positive seconds; "
                          f"got {c.timeout_s} and {c.connect_timeout_s}")
    if c.release_stuck_s < 0:
        raise ConfigError(f"comm.release_stuck_s must be 0 (never) or positive seconds; got {c.release_stuck_s}")
    for key in ("pp", "dp"):
        if getattr(p, key) < 0:
            raise ConfigError(f"parallel.{key} must not be negative, got {getattr(p, key)}")
    if cfg.fault_tolerance.f < 0:
        raise ConfigError(f"fault_tolerance.f must not be negative, got {cfg.fault_tolerance.f}")
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} does not divide model.d_model={m.d_model}; "
                          "pick n_heads among the divisors of d_model")
    if m.head_dim % 2:
        raise ConfigError(f"head size d_model/n_heads = {m.head_dim} must be even for rotary embeddings")
    if m.n_heads % p.tp:
        raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by parallel.tp={p.tp}; "
                          "each tensor-parallel rank needs whole heads")
    _check_model_shape(m, p.tp)
    for key, size in (("model.vocab_size", m.vocab_size), ("model.ffn_hidden", m.ffn_dim)):
        if size % p.tp:
            raise ConfigError(f"{key}={size} is not divisible by parallel.tp={p.tp}")
    if t.global_batch % t.micro_batch:
        raise ConfigError(f"train.global_batch={t.global_batch} is not a multiple of "
                          f"train.micro_batch={t.micro_batch}")
    if uses_planner(cfg) and p.microbatches is not None:
        raise ConfigError("parallel.microbatches splits the batch over the pipelines of parallel.layout "
                          "or parallel.pp; the planner splits it itself: give a layout or pp, or remove it")
    if p.layout and (p.dp and p.dp != len(p.layout) or p.pp and any(len(pipe) != p.pp for pipe in p.layout)):
        raise ConfigError(f"parallel.layout has {len(p.layout)} pipeline(s) of {[len(x) for x in p.layout]} "
                          f"stages, which parallel.pp={p.pp} and parallel.dp={p.dp} contradict; set "
                          "only the layout (pp and dp 0)")
    _check_data_and_eval(cfg)
    _check_logging(cfg.logging)
    if not uses_planner(cfg):
        plan_from_config(cfg)  # layout, microbatch split and schedule shape
    return cfg


def _check_data_and_eval(cfg: Config) -> None:
    if cfg.eval.every < 0 or cfg.eval.batches < 1:
        raise ConfigError(f"eval.every must be 0 (off) or more and eval.batches at least 1; got "
                          f"every={cfg.eval.every}, batches={cfg.eval.batches}")
    # Whether data.source has a validation split is data's to say (`dataset_for(cfg, "val")`):
    # it knows every kind of source.


def _check_logging(log: LoggingConfig) -> None:
    # Found, not imported: this check runs in every process that reads the config, agents too.
    import importlib.util

    if log.tensorboard.enabled and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard.enabled needs the tensorboard package, which is not installed: "
                          "pip install tensorboard (or set logging.tensorboard.enabled=false)")
    w = log.wandb
    if not w.enabled:
        return
    if not log.tensorboard.enabled:
        raise ConfigError("logging.wandb.enabled sends W&B what is written to the TensorBoard event files, "
                          "which record what was written (each step once, docs/training_metrics.md); set "
                          "logging.tensorboard.enabled=true too")
    if not w.project:
        raise ConfigError("logging.wandb.project must name a W&B project, e.g. planaria")
    if any(c in w.id for c in "/\\#?%:"):
        raise ConfigError(f"logging.wandb.id {w.id!r} may not contain / \\ # ? % or : (W&B refuses them)")
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb.enabled needs the wandb package, which is not installed: "
                          "pip install wandb (or set logging.wandb.enabled=false)")


# gloo retries a connection refused by a dead peer (its retry limit is 3), each attempt
# under the connect timeout, and connects to the dead peers one after another.
GLOO_CONNECT_ATTEMPTS = 4


def status_timeout_s(p: "CommConfig") -> float:
    """How long the leader waits for a live worker's status after a failure before it
    kills the worker as hung: the collective timeout, plus what an epoch's connection to
    peers that died after its rendezvous can take (gloo's retries of the connect timeout),
    plus margin. A shorter wait killed every survivor of a triple node loss in the p3
    replay while they were still failing their connections, and with them the job."""
    connect = min(p.connect_timeout_s, p.timeout_s)
    return p.timeout_s + GLOO_CONNECT_ATTEMPTS * connect + 15.0


def uses_planner(cfg: Config) -> bool:
    """No explicit layout and no pp/dp: the planner chooses the plan for the processes at hand."""
    p = cfg.parallel
    return p.layout is None and p.pp == 0 and p.dp == 0


ROPE_NO_SCALING = (None, "default")
"""rope_scaling types that leave the rotary frequencies as they are."""
ROPE_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_type(scaling: dict):
    return scaling.get("rope_type", scaling.get("type"))  # "type": older Hugging Face configs


def normalized_rope_scaling(scaling: dict | None) -> dict | None:
    """What a rope_scaling means, in one spelling: None for no scaling (absent, empty,
    or of type 'default'), else the mapping with `rope_type` (never the older `type`)."""
    if not scaling or _rope_type(scaling) in ROPE_NO_SCALING:
        return None
    rest = {k: v for k, v in scaling.items() if k not in ("rope_type", "type")}
    return {"rope_type": _rope_type(scaling), **rest}


def _check_model_shape(m: ModelConfig, tp: int) -> None:
    """Grouped-query heads, LLaMA's FFN sizing and rotary scaling."""
    if m.n_kv_heads < 0 or m.multiple_of < 1 or m.ffn_dim_multiplier < 0:
        raise ConfigError(f"model.n_kv_heads (0: n_heads) and model.ffn_dim_multiplier (0: none) must not be "
                          f"negative and model.multiple_of must be at least 1; got {m.n_kv_heads}, "
                          f"{m.ffn_dim_multiplier}, {m.multiple_of}")
    try:
        check_kv_heads(m.n_heads, m.kv_heads, tp)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if m.rope_theta <= 0 or m.norm_eps <= 0:
        raise ConfigError(f"model.rope_theta and model.norm_eps must be positive; got {m.rope_theta}, {m.norm_eps}")
    _check_rope_scaling(m.rope_scaling)


def _check_rope_scaling(scaling: dict | None) -> None:
    if scaling and "rope_type" not in scaling and "type" not in scaling:
        raise ConfigError(f"model.rope_scaling {scaling} has no rope_type: add rope_type: llama3 (LLaMA 3.1's "
                          "scaling), or remove model.rope_scaling for none")
    if scaling is None or _rope_type(scaling) in ROPE_NO_SCALING:
        return
    if _rope_type(scaling) != "llama3":
        raise ConfigError(f"model.rope_scaling: rope_type {_rope_type(scaling)!r} is not supported; use 'llama3' "
                          "(LLaMA 3.1's scaling) or 'default', or remove model.rope_scaling")
    missing = [k for k in ROPE_LLAMA3_KEYS if k not in scaling]
    unknown = [k for k in scaling if k not in (*ROPE_LLAMA3_KEYS, "rope_type", "type")]
    if missing or unknown:
        raise ConfigError(f"model.rope_scaling of rope_type llama3 needs the keys {list(ROPE_LLAMA3_KEYS)}; "
                          f"missing {missing}, unknown {unknown}")
    for key in ROPE_LLAMA3_KEYS:
        value = scaling[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"model.rope_scaling.{key} must be a positive number, got {value!r}")
    if scaling["factor"] < 1 or scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
        raise ConfigError(f"model.rope_scaling needs factor >= 1 and low_freq_factor < high_freq_factor; got "
                          f"factor {scaling['factor']}, low_freq_factor {scaling['low_freq_factor']}, "
                          f"high_freq_factor {scaling['high_freq_factor']}")
    if scaling["original_max_position_embeddings"] != int(scaling["original_max_position_embeddings"]):
        raise ConfigError("model.rope_scaling.original_max_position_embeddings must be a whole number of "
                          f"positions, got {scaling['original_max_position_embeddings']}")


def _positive(cfg: Config, keys) -> None:
    for section, key in keys:
        value = getattr(getattr(cfg, section), key)
        if value < 1:
            raise ConfigError(f"{section}.{key} must be at least 1, got {value}")


def plan_from_config(cfg: Config, world_size: int | None = None) -> Plan:
    """The epoch-0 plan of an explicit layout or pp x dp; `world_size`, if given, must match it.

    With pp > 0 and dp = 0, dp is as many pipelines as `world_size` holds (1 if unknown).
    Configs that leave the plan to the planner (`uses_planner`) go through
    `planaria.runtime.planning.plan_for_world` instead.
    """
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if uses_planner(cfg):
        raise ConfigError("this config leaves the plan to the planner (no parallel.layout, pp or dp)")
    total = t.global_batch // t.micro_batch
    if p.microbatches is not None and sum(p.microbatches) != total:
        raise ConfigError(
            f"parallel.microbatches={p.microbatches} adds up to {sum(p.microbatches)}, but "
            f"train.global_batch / train.micro_batch = {t.global_batch} / {t.micro_batch} = {total}; "
            "make them add up"
        )
    try:
        layout = p.layout if p.layout is not None else homogeneous_layout(
            m.n_layers, p.pp or 1, _data_parallel(cfg, world_size), p.virtual_stages)
        plan = plan_from_layout(layout, n_blocks=m.n_layers, tp=p.tp, schedule=p.schedule,
                                virtual_stages=p.virtual_stages, global_batch=t.global_batch,
                                micro_batch=t.micro_batch, microbatches=p.microbatches)
        _check_schedules(plan)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if world_size is not None and world_size != plan.world_size:
        raise ConfigError(
            f"the plan needs {plan.world_size} processes (tp={plan.tp} x {_stage_count(plan)} stages) "
            f"but the job has {world_size}; launch with torchrun --nproc-per-node={plan.world_size} "
            "or change parallel.tp/pp/dp or parallel.layout"
        )
    return plan


def _data_parallel(cfg: Config, world_size: int | None) -> int:
    p = cfg.parallel
    if p.dp:
        return p.dp
    if world_size is None:  # at load time: as many pipelines as parallel.microbatches names
        return len(p.microbatches) if p.microbatches else 1
    per_pipeline = p.tp * (p.pp or 1)
    if world_size % per_pipeline:
        raise ConfigError(
            f"{world_size} processes do not split into pipelines of parallel.tp x parallel.pp = "
            f"{per_pipeline}; launch a multiple of {per_pipeline} processes or set parallel.dp"
        )
    return world_size // per_pipeline


def _stage_count(plan: Plan) -> int:
    return sum(len(pipeline.stages) for pipeline in plan.pipelines)


def _check_schedules(plan: Plan) -> None:
    from planaria.templates.schedules import check_schedule_shape

    for i, pipeline in enumerate(plan.pipelines):
        try:
            check_schedule_shape(plan.schedule, len(pipeline.stages), plan.virtual_stages,
                                 pipeline.num_microbatches)
        except ValueError as err:
            raise ConfigError(f"pipeline {i}: {err}") from None


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
