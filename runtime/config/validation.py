"""The checks of a job's configuration across keys, and the plan its parallel section
describes.

`check_config` runs before any process group exists: what would fail later in a worker
(a head count tensor parallelism cannot split, a batch the microbatches do not divide,
a schedule the pipeline's shape cannot run, a logging sink whose package is missing)
is refused at load time, with a message naming the keys and the fix.
`plan_from_config` turns an explicit `parallel.layout` or pp x dp into the epoch-0
`Plan`; a config without either leaves the plan to the planner (`uses_planner`).
"""
from __future__ import annotations

from planaria.runtime.config.sections import (ROPE_LLAMA3_KEYS, ROPE_NO_SCALING, Config, ConfigError,
                                              LoggingConfig, ModelConfig, rope_type, uses_planner)
from planaria.templates.costs import check_kv_heads
from planaria.templates.layout import homogeneous_layout, plan_from_layout
from planaria.templates.plan import Plan

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
    if t.compile and cfg.parallel.schedule == "zb1f1b":
        # zb1f1b runs a stage's backward in two passes (input, then weight gradients) over
        # one graph; through a compiled block the weight gradients came out wrong (a float64
        # run's gradient norm off by 1.6e-4) or the second pass failed on donated buffers.
        raise ConfigError("train.compile does not go with parallel.schedule zb1f1b: its split backward does not "
                          "give exact gradients through compiled blocks; use 1f1b, interleaved or gpipe, or leave "
                          "train.compile false")
    if t.mixed_precision == "bf16-params" and t.dtype != "bfloat16":
        raise ConfigError(f"train.mixed_precision=bf16-params is how a bfloat16 job computes; train.dtype is "
                          f"{t.dtype!r}: set train.dtype=bfloat16, or leave train.mixed_precision as autocast")
    if t.mixed_precision == "bf16-params" and cfg.parallel.schedule == "zb1f1b":
        # zb1f1b's weight pass differentiates a stage's parameters(): the bf16 copies the
        # step reads, not the masters (`planaria.runtime.parallel.precision`).
        raise ConfigError("train.mixed_precision=bf16-params does not go with parallel.schedule zb1f1b: its "
                          "split backward would compute the bfloat16 copies' gradients, not the float32 masters'; "
                          "use 1f1b, interleaved or gpipe, or train.mixed_precision=autocast")
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
    if c.stopped_timeout_s < 0:
        raise ConfigError(f"comm.stopped_timeout_s must be 0 (the heartbeat only) or positive seconds; "
                          f"got {c.stopped_timeout_s}")
    if c.stuck_floor_s < 0:
        raise ConfigError(f"comm.stuck_floor_s must be 0 (no stuck check) or positive seconds; got {c.stuck_floor_s}")
    if c.stuck_floor_s and c.stuck_factor < 3:
        raise ConfigError(f"comm.stuck_factor must be at least 3 (a step a few times slower than usual is no "
                          f"hang; 10 is the default); got {c.stuck_factor}")
    if c.release_stuck_s < 0:
        raise ConfigError(f"comm.release_stuck_s must be 0 (never) or positive seconds; got {c.release_stuck_s}")
    for key in ("pp", "dp"):
        if getattr(p, key) < 0:
            raise ConfigError(f"parallel.{key} must not be negative, got {getattr(p, key)}")
    if cfg.fault_tolerance.f < 0:
        raise ConfigError(f"fault_tolerance.f must not be negative, got {cfg.fault_tolerance.f}")
    if cfg.fault_tolerance.cut_wait_s < 0:
        raise ConfigError(f"fault_tolerance.cut_wait_s must be 0 (never wait for nodes out of reach) or "
                          f"positive seconds; got {cfg.fault_tolerance.cut_wait_s}")
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
    if scaling is None or rope_type(scaling) in ROPE_NO_SCALING:
        return
    if rope_type(scaling) != "llama3":
        raise ConfigError(f"model.rope_scaling: rope_type {rope_type(scaling)!r} is not supported; use 'llama3' "
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
    `planaria.runtime.worker.build.plan_for_world` instead.
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
