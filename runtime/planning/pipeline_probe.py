"""What the pipeline runtime itself costs a worker per action, measured on known work.

Owns `measure_links_and_runtime`: the gloo links of `templates.gloo_links` and, in the same
two processes, the cost model's `Hardware.action_overhead_s` on CPU. The profile times
layers on their own and messages on their own (raw `isend`/`irecv` between two
processes). A training step also runs `torch.distributed.pipelining`'s schedule runtime
around them: per action it looks up the stage, prepares the chunk's inputs and caches
its outputs, builds the point-to-point ops, annotates the action for the profiler.
Timing a real two-rank step action by action found this at a few tenths of a
millisecond per action on this kind of machine: for a small model, a tenth of the step.

It cannot be timed from outside the runtime, so it is measured through it. After the
links, the two processes run Planaria's own schedule runtime (`PlanSchedule`, 1f1b, two
stages, `microbatches` microbatches) on stages that do a fixed amount of work per
forward and per backward (`compute_s` each, the links' matrix products) and pass
tensors of the model's boundary size. Rounds of that step alternate with rounds of the
same work with a raw exchange between every two pieces of it, as the links measure the
message cost: `exchange`, one action's work plus one message, in the same seconds (the
machine's speed drifts by a third within a minute on a shared VM). For equal stages a
1f1b step takes `(m + 1)·T + σ`, `T` a stage's time per microbatch (two actions, two
messages) and `σ` the first microbatch's transfers, so per round

    action_overhead = (step − σ) / (m + 1) / 2 − exchange

and the mean over rounds is the result, never negative.
"""
from __future__ import annotations

import functools
import json
import statistics
import sys
import time

import torch
from torch import nn

from planaria.templates.gloo_links import (
    GlooLinks,
    fixed_work,
    measure_pair_links,
    pair_worker,
    run_pair,
)


def measure_links_and_runtime(message_bytes: int = 32 << 10, *, rounds: int = 300,
                              compute_s: float = 1e-3, probe_rounds: int = 40,
                              microbatches: int = 8, timeout_s: float = 120.0) -> GlooLinks:
    """`templates.gloo_links.measure_gloo_links`'s links, and the pipeline runtime's own
    cost per action (`GlooLinks.action_overhead_s`, module docstring), measured by the
    same two fresh processes. About ten seconds; cached for the life of the process."""
    if microbatches < 1 or probe_rounds < 1 or rounds < 1 or compute_s <= 0:
        raise ValueError(f"microbatches, probe_rounds and rounds must be at least 1 and "
                         f"compute_s positive; got {microbatches}, {probe_rounds}, {rounds}, "
                         f"{compute_s}")
    return _measure(int(message_bytes), int(rounds), float(compute_s), int(probe_rounds),
                    int(microbatches), float(timeout_s))


def forget_measurements() -> None:
    """Drop the cached measurements: the next profile measures the links and the runtime
    afresh (the accuracy benchmarks do, for every round)."""
    _measure.cache_clear()


@functools.lru_cache(maxsize=None)
def _measure(message_bytes: int, rounds: int, compute_s: float, probe_rounds: int,
             microbatches: int, timeout_s: float) -> GlooLinks:
    params = {"message_bytes": message_bytes, "rounds": rounds, "compute_s": compute_s,
              "probe_rounds": probe_rounds, "microbatches": microbatches}
    result = run_pair("planaria.runtime.planning.pipeline_probe", "--probe-worker", params,
                      timeout_s=timeout_s,
                      what="measuring gloo links and the pipeline runtime's overhead")
    return GlooLinks(**result)


def action_overhead(steps: list[float], exchanges: list[float], *, latency_s: float,
                    bandwidth: float, message_bytes: int, microbatches: int) -> float:
    """Per action, what a probe's 1f1b steps leave after the work, the messages and the
    first path's transfers, as the mean over rounds of round-by-round estimates:
    `(step − σ) / (m + 1) / 2 − exchange`, where `exchange` is one action's work with
    its raw message (the stage does two of each per microbatch). Never negative."""
    transfers = 2 * (latency_s + message_bytes / bandwidth)
    per_round = [(step - transfers) / (microbatches + 1) / 2 - exchange
                 for step, exchange in zip(steps, exchanges, strict=True)]
    return max(0.0, statistics.fmean(per_round))


class _Work(torch.autograd.Function):
    """Identity on the activation, with a fixed amount of work in forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, work) -> torch.Tensor:
        ctx.work = work
        work()
        return x * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.work()
        return grad.contiguous(), None, None  # sent to the previous stage: gloo wants it dense


class _WorkStage(nn.Module):
    def __init__(self, work):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.work = work

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Work.apply(x, self.scale, self.work)


def _probe_worker(rank: int, port: int, **params) -> None:
    """One of the probe's two processes: the links first, then the runtime."""
    pair_worker(rank, port, lambda group: _links_and_runtime(rank, group, **params))


def _links_and_runtime(rank: int, group, message_bytes: int, rounds: int, compute_s: float,
                       probe_rounds: int, microbatches: int) -> dict:
    """`GlooLinks`' fields, `action_overhead_s` included (rank 0's are the result)."""
    import torch.distributed as dist

    from planaria.runtime.parallel.pipeline import PlanSchedule, build_stages

    links = measure_pair_links(rank, group, message_bytes, rounds, compute_s)
    work = fixed_work(compute_s)  # the links' kind of work
    stages = build_stages([(rank, _WorkStage(work))], 2, group, torch.device("cpu"))
    schedule = PlanSchedule(stages, "1f1b", microbatches, lambda out, target: out.sum())
    inputs = torch.randn(microbatches, max(1, message_bytes // 4))
    out, into = torch.zeros(inputs.shape[1]), torch.zeros(inputs.shape[1])
    steps, exchanges, warm = [], [], 2
    for _ in range(probe_rounds + warm):
        dist.barrier(group=group)
        start = time.perf_counter()
        if rank == 0:
            schedule.step(inputs, return_outputs=False)
        else:
            schedule.step(target=inputs, losses=[], return_outputs=False)
        steps.append(time.perf_counter() - start)
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(microbatches):  # two actions' work and messages, raw
            work()
            sent = dist.isend(out, group=group, group_dst=1 - rank)
            received = dist.irecv(into, group=group, group_src=1 - rank)
            work()
            received.wait()
            sent.wait()
        exchanges.append((time.perf_counter() - start) / (2 * microbatches))
    links["action_overhead_s"] = action_overhead(
        steps[warm:], exchanges[warm:], latency_s=links["latency_s"],
        bandwidth=links["bandwidth"], message_bytes=message_bytes, microbatches=microbatches)
    return links


if __name__ == "__main__":  # `measure_links_and_runtime`'s worker processes
    if len(sys.argv) == 5 and sys.argv[1] == "--probe-worker":
        _probe_worker(int(sys.argv[2]), int(sys.argv[3]), **json.loads(sys.argv[4]))
    else:
        sys.exit("usage: python -m planaria.runtime.planning.pipeline_probe --probe-worker RANK PORT PARAMS_JSON")
