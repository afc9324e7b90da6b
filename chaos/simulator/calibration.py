"""The simulator's costs of detection, recovery, restarts and checkpoints, and their sources.

Every figure is a field of `Calibration` with a comment saying where it comes from:
measured by this repository's benchmarks (docs/benchmarks.md), or an assumption for
GPU clusters, said as such. Planning time is not here: the simulator runs the real
planner at every event and charges what it took. Transfers are charged at the
hardware preset's inter-node bandwidth (`planaria.templates.analytic`), checkpoints
at `storage_bandwidth` per node.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Calibration:
    detection_s: float = 4.49
    """A node that vanishes is declared gone when its etcd lease expires: measured 4.49 s
    with the agents' default 5 s TTL (benchmarks/detection.py, docs/benchmarks.md). All
    policies pay it: torchrun's etcd rendezvous and Bamboo also learn of a lost node
    from a lease or a timeout, which is no shorter."""
    control_s: float = 0.75
    """Planaria's control plane after detection, besides planning: the debounce that
    gathers simultaneous failures (0.3 s), the survivors' statuses and publishing the
    epoch. Measured 0.725 s statuses + 0.022 s rendezvous (benchmarks/recovery.py)."""
    regroup_s: float = 2.0
    """New process groups for the new plan. Measured 0.02 s for a few gloo processes
    on loopback; NCCL communicator creation across hundreds of GPUs takes seconds, so
    2 s is assumed for GPU clusters (not measured here)."""
    transfer_efficiency: float = 0.5
    """Fraction of the inter-node link speed that layer-state copies reach: the
    recovery benchmark moved 28.3 MiB at 540 MiB/s over loopback gloo, about half of
    the loopback socket's own speed measured by the cpu hardware preset."""
    restart_s: float = 60.0
    """Restart-the-world, besides loading the checkpoint: stop every worker, start
    new processes, import torch, build the model, create NCCL communicators, re-run
    the data loader's warm-up. Measured 7.56 s for four CPU processes of a tiny model
    (torchrun, benchmarks/recovery.py), most of it process start and imports; on GPU
    clusters each of these grows (CUDA context, NCCL across hundreds of ranks, model
    construction), and Oobleck's simulator charges 76 to 701 s. 60 s is assumed,
    kind to the restart policies."""
    storage_bandwidth: float = 2e9
    """Bytes/s each node writes a checkpoint shard to (and reads it from) shared
    storage: assumed, a parallel file system's per-client speed. Checkpoints are
    sharded: every node saves and loads only its own stages."""
    boot_s: float = 60.0
    """From a node's arrival in the trace to its worker asking to join: the instance
    boots, the agent starts, the worker imports torch, initialises CUDA and builds the
    model. Measured 4-5 s for a local node on the development machine (the chaos
    reports' detection of an add-node); assumed 60 s for a GPU instance from a warm
    image. A node preempted before then never joins. All policies wait for it."""
    bamboo_failover_s: float = 1.0
    """Bamboo's switch to the redundant copy after detection (its predecessor already
    runs the lost stage's forward): assumed as short as Planaria's control plane."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"calibration {f.name} must be a finite number >= 0, got {value!r}")
        if not 0 < self.transfer_efficiency <= 1:
            raise ValueError(f"calibration transfer_efficiency must be in (0, 1], got {self.transfer_efficiency}")
        if self.storage_bandwidth <= 0:
            raise ValueError("calibration storage_bandwidth must be positive")

    def with_overrides(self, pairs: list[str]) -> "Calibration":
        """`name=value` overrides, as `planaria simulate --set detection_s=10` gives them."""
        known = {f.name for f in fields(self)}
        changes = {}
        for pair in pairs:
            name, sep, text = pair.partition("=")
            if not sep or name not in known:
                raise ValueError(f"--set {pair!r}: expected NAME=VALUE with NAME one of {sorted(known)}")
            try:
                changes[name] = float(text)
            except ValueError:
                raise ValueError(f"--set {pair!r}: {text!r} is not a number") from None
        return replace(self, **changes)


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (training time between checkpoints) that minimises the
    expected waste, by Daly's higher-order formula (Young's sqrt(2CM) to first order):
    sqrt(2CM)·(1 + sqrt(C/2M)/3 + C/(18M)) − C for C < 2M, else M. C is the checkpoint's
    cost, M the mean time between failures. (J. T. Daly, "A higher order estimate of the
    optimum checkpoint interval for restart dumps", FGCS 2006.)"""
    if mtbf_s <= 0:
        raise ValueError(f"the mean time between failures must be positive, got {mtbf_s}")
    if checkpoint_s <= 0:
        return math.inf if math.isinf(mtbf_s) else 0.0
    if math.isinf(mtbf_s):
        return math.inf
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - checkpoint_s
