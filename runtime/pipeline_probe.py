"""What the pipeline runtime itself costs a worker per action, measured on known work.

Owns `measure_action_overhead`, the cost model's `Hardware.action_overhead_s` on CPU.
The profile times layers on their own and messages on their own (raw `isend`/`irecv`
between two processes, `templates.profiler.measure_gloo_links`). A training step also
runs `torch.distributed.pipelining`'s schedule runtime around them: per action it looks
up the stage, prepares the chunk's inputs and caches its outputs, builds the
point-to-point ops, annotates the action for the profiler. Timing a real two-rank step
action by action found this at a few tenths of a millisecond per action on this kind of
machine: for a small model, a tenth of the step.

It cannot be timed from outside the runtime, so it is measured through it: two fresh
processes on a gloo group run Planaria's own schedule runtime (`PlanSchedule`, 1f1b,
two stages, `microbatches` microbatches) whose stages do a fixed amount of work per
forward and per backward (`compute_s` each, the same matrix products as the message
measurement) and pass tensors of the model's boundary size. Rounds of that step
alternate with rounds of the same work done without the runtime (`2·m` times the work),
both workers at once. For equal stages a 1f1b step takes `(m + 1)·T + σ` with `T` a
stage's time per microbatch and `σ` the first microbatch's transfers, so

    T = (step − σ) / (m + 1),  action_overhead = (T − 2·work − 2·message_overhead) / 2

per microbatch a stage runs two actions (forward, backward) and pays two messages, whose
cost the cost model already counts (`Hardware.message_overhead_s`). The probe measures
that cost again in the same rounds, the same way (`measure_gloo_links`: the work with a
raw exchange in the middle, against the work alone), so that the machine's speed, which
drifts by a third within a minute on a shared VM, is the same for every term. Never
negative.
"""
from __future__ import annotations

import functools
import json
import statistics
import sys
import time

import torch
from torch import nn

from planaria.templates.profiler import GlooLinks, run_pair


def measure_action_overhead(links: GlooLinks, *, microbatches: int = 8, rounds: int = 40,
                            compute_s: float = 1e-3, timeout_s: float = 120.0) -> float:
    """Seconds the pipeline runtime costs a worker per action (module docstring), given
    the links measured on this machine (latency, bandwidth and the boundary's size
    `links.message_bytes`). Several seconds: two fresh processes. Cached for the life
    of the process, as the links are."""
    if microbatches < 1 or rounds < 2 or compute_s <= 0:
        raise ValueError(f"microbatches must be at least 1, rounds at least 2 and compute_s "
                         f"positive; got {microbatches}, {rounds}, {compute_s}")
    return _measure(links, microbatches, rounds, float(compute_s), float(timeout_s))


@functools.lru_cache(maxsize=None)
def _measure(links: GlooLinks, microbatches: int, rounds: int, compute_s: float,
             timeout_s: float) -> float:
    params = {"microbatches": microbatches, "rounds": rounds, "compute_s": compute_s,
              "message_bytes": links.message_bytes}
    result = run_pair("planaria.runtime.pipeline_probe", "--probe-worker", params,
                      timeout_s=timeout_s, what="measuring the pipeline runtime's overhead")
    return action_overhead(result["step_s"], result["work_s"], result["message_s"], links,
                           microbatches)


def action_overhead(step_s: float, work_s: float, message_s: float, links: GlooLinks,
                    microbatches: int) -> float:
    """The per-action overhead from a probe's mean 1f1b step, its work per action and
    its raw messages' cost each, measured in the same rounds."""
    transfers = 2 * (links.latency_s + links.message_bytes / links.bandwidth)
    stage_time = (step_s - transfers) / (microbatches + 1)
    return max(0.0, (stage_time - 2 * work_s - 2 * message_s) / 2)


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


def _probe_worker(rank: int, port: int, microbatches: int, rounds: int, compute_s: float,
                  message_bytes: int) -> None:
    """One of the probe's two processes; rank 0 prints {"step_s", "work_s"} as JSON."""
    from datetime import timedelta

    import torch.distributed as dist

    from planaria.runtime.pipeline import PlanSchedule, build_stages

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    try:
        matrix = torch.randn(64, 64)
        for _ in range(20):  # warm up before sizing the work
            matrix @ matrix
        start = time.perf_counter()
        for _ in range(200):
            matrix @ matrix
        products = max(1, round(compute_s / ((time.perf_counter() - start) / 200)))

        def work() -> None:
            for _ in range(products):
                matrix @ matrix

        group = dist.group.WORLD
        stages = build_stages([(rank, _WorkStage(work))], 2, group, torch.device("cpu"))
        schedule = PlanSchedule(stages, "1f1b", microbatches, lambda out, target: out.sum())
        inputs = torch.randn(microbatches, max(1, message_bytes // 4))
        out, into = torch.zeros(inputs.shape[1]), torch.zeros(inputs.shape[1])
        steps, plain, exchanges, warm = [], [], [], 2
        for i in range(rounds + warm):
            dist.barrier(group=group)
            start = time.perf_counter()
            if rank == 0:
                schedule.step(inputs, return_outputs=False)
            else:
                schedule.step(target=inputs, losses=[], return_outputs=False)
            steps.append(time.perf_counter() - start)
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(2 * microbatches):
                work()
            plain.append((time.perf_counter() - start) / (2 * microbatches))
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(microbatches):  # the same work with raw messages, as the links' rounds
                work()
                sent = dist.isend(out, group=group, group_dst=1 - rank)
                received = dist.irecv(into, group=group, group_src=1 - rank)
                work()
                received.wait()
                sent.wait()
            exchanges.append((time.perf_counter() - start) / (2 * microbatches))
        if rank == 0:
            work_s = statistics.fmean(plain[warm:])
            print(json.dumps({"step_s": statistics.fmean(steps[warm:]), "work_s": work_s,
                              "message_s": statistics.fmean(exchanges[warm:]) - work_s}),
                  flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # `measure_action_overhead`'s worker processes
    if len(sys.argv) == 5 and sys.argv[1] == "--probe-worker":
        _probe_worker(int(sys.argv[2]), int(sys.argv[3]), **json.loads(sys.argv[4]))
    else:
        sys.exit("usage: python -m planaria.runtime.pipeline_probe --probe-worker RANK PORT PARAMS_JSON")
