"""The links between two worker processes over gloo, measured: latency, bandwidth, what a
message costs a worker all told, and a small all-reduce.

`profile_layers` (`templates/profiler.py`) measures them with `measure_links=True` (CPU
jobs, whose workers talk through gloo over loopback TCP), between two fresh processes
(`measure_gloo_links`): a gloo message's latency and bandwidth, what each message costs
a worker all told (posting, completing, gloo's thread taking the core, stalls), and a
small all-reduce (the commit). They replace the hardware's link figures
(`GlooLinks.apply`): the "cpu" preset's come from a raw TCP socket, which is ten times
faster to answer than a gloo message between two processes.

The pair of processes (`run_pair`, `pair_worker`) and the measurements run in it
(`measure_pair_links`, `fixed_work`) are also the runtime's: its pipeline probe
(`planaria.runtime.planning.pipeline_probe`) measures the runtime's own cost per action
in the same two processes. Imports torch: only computing processes load this module.
"""
from __future__ import annotations

import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from planaria.templates.costs import Hardware


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
    result = run_pair("planaria.templates.gloo_links", "--link-worker", params,
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

    small_buffer, large_buffer = torch.zeros(2), torch.zeros(_LARGE_MESSAGE // 4)

    def one_way(buffer: torch.Tensor) -> float:
        start = time.perf_counter()
        if rank == 0:
            dist.isend(buffer, group=group, group_dst=peer).wait()
            dist.irecv(buffer, group=group, group_src=peer).wait()
        else:
            dist.irecv(buffer, group=group, group_src=peer).wait()
            dist.isend(buffer, group=group, group_dst=peer).wait()
        return (time.perf_counter() - start) / 2

    compute = fixed_work(compute_s)
    # The small and the large messages in turns, so that both see the same load: measured
    # one after the other, a busy spell during the small ones made their median the
    # large one's, and the bandwidth came out as 4e15 B/s.
    smalls, larges = [], []
    for i in range(50 + warm):
        smalls.append(one_way(small_buffer))
        if i % 5 == 0:
            larges.append(one_way(large_buffer))
    latency, large = statistics.median(smalls[warm:]), statistics.median(larges[1:])
    # Where the difference is lost in the noise all the same, the large message's own time
    # bounds the bandwidth: taken as at most ten times what that time alone gives.
    bandwidth = (_LARGE_MESSAGE - 8) / max(large - latency, large / 10, 1e-9)
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


if __name__ == "__main__":  # `measure_gloo_links`'s worker processes
    if len(sys.argv) == 5 and sys.argv[1] == "--link-worker":
        _link_worker(int(sys.argv[2]), int(sys.argv[3]), **json.loads(sys.argv[4]))
    else:
        sys.exit("usage: python -m planaria.templates.gloo_links --link-worker RANK PORT PARAMS_JSON")
