"""The profiler: per-layer costs measured on the real layers and the real device, cached.

Owns `profile_layers`, which times the forward and backward of real layers, measures
what autograd keeps for backward, and caches the measurements as JSON. It is the one
module of `planaria.templates` that imports torch; nothing else in the package imports
it, so plans can still be made without torch. It knows nothing of Planaria's model:
the caller passes a `build_layer` and a `make_input` (see
`planaria.runtime.planning.measured_costs.profile_model`).

What is measured, for one microbatch at tp = 1 in this process:
- forward and backward time: the mean of `repeats` runs after `warmup` discarded
  ones (`statistic="median"` for the median), with the thread count the process has
  (record: `torch.get_num_threads()`, part of the cache key). The trainer's workers run
  under torchrun with OMP_NUM_THREADS=1; pass `num_threads=1` to profile as they run.
  The mean, because an iteration is a sum of many layer runs and so costs the sum of
  their means: on a shared machine a layer's times are skewed to the right (a
  preempted core, a busy neighbour), and the median leaves that out.
- the parameter update, once per iteration (`optimizer_s`): the layer's gradient norm,
  clipping with it, the optimizer's step (`make_optimizer(layer)`, default
  `AdamW(foreach=False)`, one optimizer per layer as Planaria's engine runs it) and
  zeroing the gradients, on the gradients the backward runs left.
- activation bytes: the unique storages autograd saves for backward
  (`saved_tensors_hooks`), minus parameters, buffers and autocast's casts of them,
  which live for the whole step, not per microbatch.
- output bytes: the output's numel x element size (0 for the head: nothing follows).
State bytes (master weights, gradients, Adam moments) are counted, not measured:
parameters x bytes per parameter, as in the analytic model.

With `measure_links=True` (CPU jobs, whose workers talk through gloo over loopback
TCP) the links are measured too, between two fresh processes (`measure_gloo_links`):
a gloo message's latency and bandwidth, what each message costs a worker all told
(posting, completing, gloo's thread taking the core, stalls), and a small all-reduce
(the commit). They replace the hardware's link figures: the "cpu" preset's come
from a raw TCP socket, which is ten times faster to answer than a gloo message
between two processes.

All blocks have the same shape, so the embedding, one block and the head are
profiled, and the block's costs are reused for every block.

tp > 1 cannot be measured in one process. Its costs are the tp = 1 measurements with
compute time divided by tp, activations scaled by the analytic model's tp-ratio
(Korthikanti's replicated terms do not shrink), sharded parameters divided by tp, and
the analytic tensor-parallel all-reduce times added. The cache holds the raw tp = 1
measurements, so one profile serves every tp.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from planaria.templates.analytic import (
    bytes_per_parameter,
    check_job,
    layer_activation_bytes,
    tp_communication_times,
)
from planaria.templates.costs import CostModel, Hardware, LayerCost, ModelShape

CACHE_VERSION = 5
STATISTICS = ("mean", "median")
_AUTOCAST = {"bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Measurement:
    """One layer measured at tp = 1 for one microbatch; what the cache stores."""

    forward_s: float
    backward_s: float
    activation_bytes: int
    output_bytes: int
    sharded_parameters: int
    """Matrices (dim >= 2), which tensor parallelism splits."""
    replicated_parameters: int
    """Vectors such as norm gains, which every tp worker holds whole."""
    optimizer_s: float = 0.0
    """The parameter update, once per iteration (module docstring)."""


@dataclass(frozen=True)
class GlooLinks:
    """Point-to-point and collective costs between two worker processes over gloo."""

    latency_s: float
    """One way, a small message: the median of half a ping-pong."""
    bandwidth: float
    """Bytes/s of a large message once the latency is paid (from 4 MiB ping-pongs)."""
    message_overhead_s: float
    """What one message (sent or received) costs a worker, all told, while both workers
    alternate compute and a boundary exchange, as adjacent stages do."""
    collective_latency_s: float
    """Mean time of an all-reduce of two float64 (the commit) between the two."""
    message_bytes: int
    """The size the message overhead was measured with (a stage boundary's)."""
    message_overhead_quantiles: tuple[float, ...] = ()
    """The per-message costs of the measured rounds as equally likely values (see
    `Hardware.message_overhead_quantiles`)."""
    action_overhead_s: float = 0.0
    """The pipeline runtime's own cost per action (`Hardware.action_overhead_s`), where
    the caller's runtime measured it in the same pair (`profile_layers`'s
    `link_measurer`); else 0."""

    def __post_init__(self) -> None:  # from the JSON cache, a list
        object.__setattr__(self, "message_overhead_quantiles",
                           tuple(self.message_overhead_quantiles))

    def apply(self, hw: Hardware) -> Hardware:
        """`hw` with these links: gloo between processes is both the intra-node link (tp
        all-reduces) and the inter-node one (pipeline messages, gradient sync)."""
        return replace(hw, intra_node_bandwidth=self.bandwidth,
                       inter_node_bandwidth=self.bandwidth, link_latency_s=self.latency_s,
                       message_overhead_s=self.message_overhead_s,
                       message_overhead_quantiles=self.message_overhead_quantiles,
                       collective_latency_s=self.collective_latency_s,
                       action_overhead_s=self.action_overhead_s)


def profile_layers(build_layer: Callable[[int], torch.nn.Module],
                   make_input: Callable[[int], torch.Tensor], shape: ModelShape, hw: Hardware, *,
                   tp: int = 1, micro_batch: int, dtype: str, recompute: bool = False,
                   repeats: int = 5, warmup: int = 2, cache_dir: Path | None = None,
                   cache_key: dict | None = None,
                   loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   num_threads: int | None = None,
                   make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
                   statistic: str = "mean", measure_links: bool = False,
                   background: Callable[[], AbstractContextManager] | None = None,
                   link_measurer: Callable[[int], GlooLinks] | None = None) -> CostModel:
    """Measure layers 0, 1 and the head of a model and return its profiled `CostModel`.

    `build_layer(i)` builds layer i at tp = 1 in the parameter dtype on the device to
    profile; `make_input(i)` gives its input for one microbatch (token ids for layer 0,
    hidden states otherwise). `loss_fn(logits)`, if given, is included in the head's
    forward and its backward starts from the loss, as in training; otherwise the head's
    backward starts from a random output gradient. `dtype` is `train.dtype`:
    "bfloat16" runs the layers under autocast. `recompute` must match how
    `build_layer` builds blocks. `num_threads` sets torch's thread count for the
    measurement (restored afterwards). `cache_key` adds whatever else distinguishes
    the layers (model family, kernel choice) to the cache key. `make_optimizer(layer)`
    builds the optimizer whose step is timed (default `AdamW(foreach=False)`).
    `statistic` ("mean" or "median") summarises the timed repeats. `measure_links`
    also measures gloo links between two processes and puts them into the hardware
    (for CPU jobs; see `measure_gloo_links`). `background()`, when given, is entered
    around the layer measurements (not the links'): the caller's way to measure under
    the load the job's other workers put on the same machine; name it in `cache_key`.
    `link_measurer(message_bytes)`, used with `measure_links` instead of
    `measure_gloo_links`, lets the caller measure more in the same pair of processes
    (the runtime's pipeline probe: `Hardware.action_overhead_s`, which this module
    cannot import; name it in `cache_key` too). See the module docstring for what is
    measured and how tp > 1 is derived.
    """
    check_job(shape, tp=tp, micro_batch=micro_batch, dtype=dtype)
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be at least 1 and warmup at least 0, got {repeats}, {warmup}")
    if statistic not in STATISTICS:
        raise ValueError(f"statistic {statistic!r} is unknown; use one of {list(STATISTICS)}")
    with _threads(num_threads):
        key = _cache_key(shape, micro_batch, dtype, recompute, make_input(0).device,
                         {**(cache_key or {}), "statistic": statistic, "links": measure_links})
        path = None if cache_dir is None else Path(cache_dir) / f"profile-{_digest(key)}.json"
        cached = _read_cache(path, key) if path is not None else None
        if cached is None:
            measured = {}
            with (background or nullcontext)():
                for kind, index in (("embedding", 0), ("block", 1), ("head", shape.num_layers - 1)):
                    layer_loss = loss_fn if kind == "head" else None
                    measured[kind] = measure_layer(build_layer(index), make_input(index), dtype=dtype,
                                                   repeats=repeats, warmup=warmup, loss_fn=layer_loss,
                                                   is_last=kind == "head", make_optimizer=make_optimizer,
                                                   statistic=statistic)
            links = None
            if measure_links:
                try:
                    links = (link_measurer or measure_gloo_links)(
                        max(measured["block"].output_bytes, 1))
                except RuntimeError as err:  # plan on with the preset's links, and say so
                    warnings.warn(f"could not measure gloo links ({err}); using the "
                                  f"{hw.name!r} preset's", stacklevel=2)
            if path is not None and (links is not None or not measure_links):  # else: retry next time
                _write_cache(path, key, measured, links)
        else:
            measured, links = cached
    if links is not None:
        hw = links.apply(hw)
    return _assemble(measured, shape, hw, tp=tp, micro_batch=micro_batch, dtype=dtype,
                     recompute=recompute)


@contextmanager
def _threads(num_threads: int | None):
    before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_layer(layer: torch.nn.Module, x: torch.Tensor, *, dtype: str, repeats: int = 5,
                  warmup: int = 2, loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  is_last: bool = False,
                  make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
                  statistic: str = "mean") -> Measurement:
    """Time one layer's forward and backward and its parameter update (`statistic` of
    the repeats) and measure what it saves.

    Gradients accumulate into `.grad` across runs as they do across microbatches. The
    update is timed last, on those gradients; it changes the layer's parameters.
    """
    summary = {"mean": statistics.fmean, "median": statistics.median}[statistic]
    device = x.device
    if x.is_floating_point():
        x = x.detach().requires_grad_(True)
    autocast = (torch.autocast(device.type, dtype=_AUTOCAST[dtype]) if dtype in _AUTOCAST
                else nullcontext())

    def forward() -> torch.Tensor:
        with autocast:
            out = layer(x)
            return loss_fn(out) if loss_fn is not None else out

    out = forward()
    grad = None if out.dim() == 0 else torch.randn(
        out.shape, dtype=out.dtype, device=device, generator=_generator(device))
    output_bytes = 0 if is_last else out.numel() * out.element_size()
    out.backward(grad)
    forward_times, backward_times = [], []
    for i in range(warmup + repeats):
        _sync(device)
        start = time.perf_counter()
        out = forward()
        _sync(device)
        middle = time.perf_counter()
        out.backward(grad)
        _sync(device)
        if i >= warmup:
            forward_times.append(middle - start)
            backward_times.append(time.perf_counter() - middle)
    sharded = sum(p.numel() for p in layer.parameters() if p.dim() >= 2)
    replicated = sum(p.numel() for p in layer.parameters() if p.dim() < 2)
    activation = saved_activation_bytes(layer, forward)
    update = measure_update(layer, make_optimizer, repeats=repeats, warmup=warmup,
                            summary=summary)
    return Measurement(forward_s=summary(forward_times), backward_s=summary(backward_times),
                       activation_bytes=activation, output_bytes=output_bytes,
                       sharded_parameters=sharded, replicated_parameters=replicated,
                       optimizer_s=update)


def measure_update(layer: torch.nn.Module,
                   make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None, *,
                   repeats: int = 5, warmup: int = 2, summary=statistics.fmean) -> float:
    """Seconds of one layer's once-per-iteration parameter update, as a training step
    does it per layer: gradient norm, clip by it, optimizer step, zero the gradients.

    Runs on the gradients the layer holds (zeros where it has none), restored before
    every repeat; the first step creates the optimizer's state and is a warm-up. When a
    hook summed them wide, in `p.main_grad` (the runtime's `train.exact_reduction`), the
    timed update also rounds them into `p.grad` and takes the norm of the wide sums, as
    the trainer does.
    """
    params = [p for p in layer.parameters() if p.requires_grad]
    if not params:
        return 0.0
    optimizer = (make_optimizer(layer) if make_optimizer is not None
                 else torch.optim.AdamW(params, foreach=False))
    wide = next((p.main_grad.dtype for p in params
                 if getattr(p, "main_grad", None) is not None), None)
    grads = [_held_gradient(p, wide) for p in params]
    device = params[0].device
    times = []
    for i in range(max(warmup, 1) + repeats):
        for p, g in zip(params, grads):
            if wide is not None:
                p.main_grad = g.clone()
            else:
                p.grad = g.clone()
        _sync(device)
        start = time.perf_counter()
        if wide is not None:
            for p in params:
                p.grad = p.main_grad.to(p.dtype)
        summed = [p.main_grad if wide is not None else p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(summed, foreach=True)
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm.to(params[0].dtype), foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if i >= max(warmup, 1):
            times.append(time.perf_counter() - start)
    return summary(times)


def _held_gradient(p: torch.Tensor, wide: torch.dtype | None) -> torch.Tensor:
    """`p`'s summed gradient (`main_grad` in dtype `wide` when summed wide), or zeros
    for a parameter no backward reached, as the trainer gives it."""
    held = getattr(p, "main_grad", None) if wide is not None else p.grad
    if held is not None:
        return held.detach().clone()
    return torch.zeros_like(p, dtype=wide or p.dtype)


def saved_activation_bytes(layer: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Bytes of the unique storages autograd saves during `forward()`, state excluded.

    Parameters and buffers (and views of them) live for the whole run; autocast's
    low-precision copies of parameters are cached for the whole autocast region, which
    the engine opens once per step. Neither is per-microbatch activation memory.
    """
    state = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}
    parameters = {id(p) for p in layer.parameters()}
    saved: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in state and not _is_parameter_cast(t, parameters):
            saved[(str(t.device), ptr)] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out  # drop the graph without running backward
    return sum(saved.values())


def _is_parameter_cast(t: torch.Tensor, parameters: set[int]) -> bool:
    """True for autocast's dtype copy of a parameter, or a view of one (F.linear saves W.t()).

    Walks back a chain of one-input autograd nodes (views, the cast) and asks whether
    it ends at a parameter's AccumulateGrad after passing a ToCopy. Activations never
    do: their chains reach the layer input or a node with several inputs.
    """
    fn, cast = t.grad_fn, False
    for _ in range(8):
        if fn is None:
            return False
        if type(fn).__name__ == "AccumulateGrad":
            return cast and id(fn.variable) in parameters
        cast = cast or fn.name() == "ToCopyBackward0"
        inputs = [nxt for nxt, _ in fn.next_functions if nxt is not None]
        if len(inputs) != 1:
            return False
        fn = inputs[0]
    return False


def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _assemble(measured: dict[str, Measurement], shape: ModelShape, hw: Hardware, *, tp: int,
              micro_batch: int, dtype: str, recompute: bool) -> CostModel:
    """The CostModel for `tp` from tp = 1 measurements (see the module docstring)."""
    layers = []
    for index in range(shape.num_layers):
        m = measured[shape.layer_kind(index)]
        comm_f, comm_b = tp_communication_times(shape, index, hw, tp=tp, micro_batch=micro_batch,
                                                dtype=dtype, recompute=recompute)
        estimate = lambda t: layer_activation_bytes(  # noqa: E731
            shape, index, tp=t, micro_batch=micro_batch, dtype=dtype, recompute=recompute)
        activation = m.activation_bytes if tp == 1 else round(
            m.activation_bytes * estimate(tp) / max(estimate(1), 1))
        state = (m.sharded_parameters // tp + m.replicated_parameters) * bytes_per_parameter(dtype)
        # The update's work is per element, so its time shrinks with this worker's share.
        total = m.sharded_parameters + m.replicated_parameters
        share = (m.sharded_parameters / tp + m.replicated_parameters) / total if total else 1.0
        layers.append(LayerCost(forward_s=m.forward_s / tp + comm_f,
                                backward_s=m.backward_s / tp + comm_b,
                                state_bytes=state, activation_bytes=activation,
                                output_bytes=m.output_bytes, optimizer_s=m.optimizer_s * share))
    return CostModel(shape=shape, hardware=hw, tp=tp, micro_batch=micro_batch,
                     layers=tuple(layers), source="profiled")


# ---- gloo links ---------------------------------------------------------------------------

_LARGE_MESSAGE = 4 << 20
_QUANTILES = 50


def measure_gloo_links(message_bytes: int = 32 << 10, *, rounds: int = 300, compute_s: float = 1e-3,
                       timeout_s: float = 60.0) -> GlooLinks:
    """Measure gloo between two fresh worker processes on this machine (a few seconds).

    Each process runs with one thread, as torchrun workers do, and joins a gloo process
    group of the two on a free loopback port (fresh processes, so this also works from
    inside a job's worker). Measured, in this order:
    - latency: the median of half a ping-pong of 8 bytes (send, then receive);
    - bandwidth: 4 MiB ping-pongs, bytes / (median one-way time - latency);
    - message overhead, all told: rounds of a fixed amount of work (about 2·`compute_s`)
      alternate with and without a boundary exchange in the middle (each worker posts a
      send and a receive of `message_bytes` to the other, works on, then waits for both,
      as adjacent pipeline stages do at every boundary for every microbatch). Half the
      difference of the mean round times is what one message costs a worker: posting
      and completing it, gloo's thread taking the core to move it, and gloo's occasional
      multi-millisecond stalls at the rate they come. The latency is hidden behind the
      work, as it is in a pipeline's steady state (the schedule's formula counts it on
      the first microbatch's path);
    - the commit: the mean time of an all-reduce of two float64 after the same compute.
    Results are cached for the life of the process.
    """
    return _measure_gloo_links(int(message_bytes), int(rounds), float(compute_s), float(timeout_s))


@functools.lru_cache(maxsize=None)
def _measure_gloo_links(message_bytes: int, rounds: int, compute_s: float,
                        timeout_s: float) -> GlooLinks:
    params = {"message_bytes": message_bytes, "rounds": rounds, "compute_s": compute_s}
    result = run_pair("planaria.templates.profiler", "--link-worker", params,
                      timeout_s=timeout_s, what="measuring gloo links")
    return GlooLinks(**result)


def run_pair(module: str, flag: str, params: dict, *, timeout_s: float, what: str) -> dict:
    """Run `python -m module flag RANK PORT PARAMS_JSON` as two fresh processes with one
    thread each, which join a gloo group of two on a free loopback port; return the JSON
    object rank 0 prints last. Raises RuntimeError naming `what` if either fails or
    they take over `timeout_s`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A job's worker (torchrun) has the job's rendezvous in its environment; the pair
    # must not join it (TORCHELASTIC_USE_AGENT_STORE would send it to the job's store).
    job = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
           "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")
    env = {k: v for k, v in os.environ.items()
           if k not in job and not k.startswith("TORCHELASTIC_")}
    env["OMP_NUM_THREADS"] = "1"
    procs = [subprocess.Popen([sys.executable, "-m", module, flag, str(rank), str(port),
                               json.dumps(params)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in (0, 1)]
    try:
        outputs = [proc.communicate(timeout=timeout_s) for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.communicate()
        raise RuntimeError(f"{what} took over {timeout_s:.0f} s; is loopback TCP "
                           "blocked?") from None
    for proc, (_, err) in zip(procs, outputs):
        if proc.returncode != 0:
            raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{err[-2000:]}")
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def _link_worker(rank: int, port: int, message_bytes: int, rounds: int, compute_s: float) -> None:
    """One of `measure_gloo_links`'s two processes."""
    pair_worker(rank, port, lambda group: measure_pair_links(rank, group, message_bytes,
                                                             rounds, compute_s))


def pair_worker(rank: int, port: int, measure: Callable[[object], dict]) -> None:
    """The body of one of `run_pair`'s processes: one thread, a gloo group of the two on
    `port`, `measure(group)` on both; rank 0 prints its result as JSON."""
    import torch.distributed as dist
    from datetime import timedelta

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    try:
        result = measure(dist.new_group([0, 1]))
        if rank == 0:
            print(json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


def fixed_work(compute_s: float) -> Callable[[], None]:
    """A function doing about `compute_s` seconds of matrix products, sized on the spot:
    a fixed amount of work, so that a slowdown shows in its time."""
    matrix = torch.randn(64, 64)
    start = time.perf_counter()
    for _ in range(200):
        matrix @ matrix
    products = max(1, round(compute_s / ((time.perf_counter() - start) / 200)))

    def work() -> None:
        for _ in range(products):
            matrix @ matrix

    return work


def measure_pair_links(rank: int, group, message_bytes: int, rounds: int,
                       compute_s: float) -> dict:
    """`measure_gloo_links`'s measurements, run by both processes of a gloo `group` of
    two (ranks 0 and 1); returns `GlooLinks`' fields (rank 0's are the result).

    Messages go through `torch.distributed` on the group, as the pipeline runtime sends
    them (`isend`/`irecv` with a group and a group peer).
    """
    import torch.distributed as dist

    peer, warm = 1 - rank, 5

    def ping_pong(nbytes: int, count: int) -> float:
        buffer = torch.zeros(max(1, nbytes // 4))
        times = []
        for _ in range(count + warm):
            start = time.perf_counter()
            if rank == 0:
                dist.isend(buffer, group=group, group_dst=peer).wait()
                dist.irecv(buffer, group=group, group_src=peer).wait()
            else:
                dist.irecv(buffer, group=group, group_src=peer).wait()
                dist.isend(buffer, group=group, group_dst=peer).wait()
            times.append((time.perf_counter() - start) / 2)
        return statistics.median(times[warm:])

    compute = fixed_work(compute_s)
    latency = ping_pong(8, 50)
    large = ping_pong(_LARGE_MESSAGE, 10)
    bandwidth = (_LARGE_MESSAGE - 8) / max(large - latency, 1e-9)
    out = torch.zeros(max(1, message_bytes // 4))
    into = torch.zeros_like(out)
    with_messages, without = [], []
    for i in range(2 * (rounds + warm)):
        start = time.perf_counter()
        compute()
        if i % 2 == 0:  # exchange a message each way, as adjacent stages do
            sent = dist.isend(out, group=group, group_dst=peer)
            received = dist.irecv(into, group=group, group_src=peer)
            compute()
            received.wait()
            sent.wait()
            with_messages.append(time.perf_counter() - start)
        else:
            compute()
            without.append(time.perf_counter() - start)
        dist.barrier(group=group)  # both start every round together
    overhead = (statistics.fmean(with_messages[warm:]) - statistics.fmean(without[warm:])) / 2
    spread = _message_quantiles(with_messages[warm:], statistics.fmean(without[warm:]),
                                max(0.0, overhead))
    pair = torch.zeros(2, dtype=torch.float64)
    reduces = []
    for _ in range(rounds + warm):
        compute()
        start = time.perf_counter()
        dist.all_reduce(pair, group=group)
        reduces.append(time.perf_counter() - start)
    dist.barrier(group=group)
    return {"latency_s": latency, "bandwidth": bandwidth,
            "message_overhead_s": max(0.0, overhead), "message_overhead_quantiles": spread,
            "collective_latency_s": statistics.fmean(reduces[warm:]),
            "message_bytes": message_bytes}


def _message_quantiles(with_messages: list[float], baseline: float, mean: float,
                       count: int = _QUANTILES) -> list[float]:
    """`count` equally likely per-message costs: each exchange round's excess over the
    mean round without one, halved (a round is two messages per worker), at the
    quantiles (k + 1/2) / count; shifted so their mean is the reported `mean`.

    A round's excess also carries the round's compute noise, so the spread is somewhat
    wider than the messages' own; the stalls, the part that matters, are in the tail.
    """
    excess = sorted((t - baseline) / 2 for t in with_messages)
    picks = [excess[min(len(excess) - 1, int((k + 0.5) / count * len(excess)))]
             for k in range(count)]
    shift = mean - statistics.fmean(picks)
    return [p + shift for p in picks]


# ---- cache ------------------------------------------------------------------------------


def _cache_key(shape: ModelShape, micro_batch: int, dtype: str, recompute: bool,
               device: torch.device, extra: dict | None) -> dict:
    """Everything that changes the tp = 1 measurements (tp does not: see the module docstring)."""
    return {"version": CACHE_VERSION, "shape": asdict(shape), "micro_batch": micro_batch,
            "dtype": dtype, "recompute": recompute, "device": _device_name(device),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "extra": extra or {}}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{_cpu_name()}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def _read_cache(path: Path, key: dict) -> tuple[dict[str, Measurement], GlooLinks | None] | None:
    """The cached measurements and links, or None when absent, stale, or corrupt (with a
    warning)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data["key"] != key:  # a hash collision or an older format: measure again
            return None
        links = data.get("links")
        return ({kind: Measurement(**data["layers"][kind]) for kind in ("embedding", "block", "head")},
                None if links is None else GlooLinks(**links))
    except (OSError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"ignoring unreadable profile cache {path}: {err!r}; measuring again",
                      stacklevel=3)
        return None


def _write_cache(path: Path, key: dict, measured: dict[str, Measurement],
                 links: GlooLinks | None = None) -> None:
    """Write atomically: a temporary file in the same folder, then os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"key": key, "layers": {kind: asdict(m) for kind, m in measured.items()},
            "links": None if links is None else asdict(links)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


if __name__ == "__main__":  # `measure_gloo_links`'s worker processes
    if len(sys.argv) == 5 and sys.argv[1] == "--link-worker":
        _link_worker(int(sys.argv[2]), int(sys.argv[3]), **json.loads(sys.argv[4]))
    else:
        sys.exit("usage: python -m planaria.templates.profiler --link-worker RANK PORT PARAMS_JSON")
