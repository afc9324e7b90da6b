"""The scale harness's run: a real three-member etcd, N simulated nodes of G workers, the
faults, and what each costs (the package docstring says what is real and what is not).

    with ScaleHarness(nodes=64, gpus_per_node=8, config="configs/llama3-70b.yaml") as h:
        h.start()                      # epoch 0 published and bootstrapped everywhere
        quiet = h.steady(10.0)         # etcd's requests and bytes while nothing changes
        change = h.reconfigure(lambda: h.kill_node(3), "kill a node")

The harness itself makes no request to etcd: what it needs of the job it reads from the
agents' memory (the leader's controller, the workers' `Observer`), and etcd's counters
over HTTP, so that every request counted is the control plane's.
"""
from __future__ import annotations

import asyncio

import os
import resource
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from planaria.chaos.scale.cutoff import CutClient, Killed, WriteSizes
from planaria.chaos.scale.data_plane import DataPlane
from planaria.chaos.scale.etcd_metrics import EtcdCounts, scrape
from planaria.chaos.scale.shared_records import SharedRecords
from planaria.chaos.scale.sim_metrics import MetricsDirectory
from planaria.chaos.scale.sim_node import SimulatedAgent
from planaria.chaos.scale.sim_worker import Observer
from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.elastic.etcd_server import EmbeddedEtcdCluster
from planaria.elastic.peer_probe import PERIOD_S
from planaria.runtime.contract.epochs import EpochEvent

START_WAVE = 64
"""Nodes started at once. A thousand agents started in the same instant on two cores
each wait seconds for the interpreter between their lease's grant and its first renewal,
and their leases lapse (with the agents' default 5 s TTL) before they have registered;
real nodes, each on its own CPUs, do not. So the harness starts them in waves, each once
the previous one's workers are up."""
HARNESS_OVERRIDES = ["train.steps=100000000", "checkpoint.every=0"]
"""A job that never ends on its own, and writes no checkpoint (nothing of the disk is
measured here)."""


@dataclass
class Reconfiguration:
    """One fault and what it cost (seconds from the fault; counts from etcd's counters)."""

    kind: str
    epoch: int
    nodes: int
    workers: int
    detected_s: float
    statuses_s: float
    planned_s: float
    published_s: float
    records_held_s: float
    bootstrapped_s: float
    first_step_s: float
    etcd: EtcdCounts
    largest_write: int
    controller_cpu_s: float = 0.0
    """CPU seconds of the whole harness process meanwhile (every agent, relay and
    simulated worker)."""
    leader_cpu_s: float = 0.0
    """CPU seconds of the leading agent's thread meanwhile: its controller and planner."""
    etcd_cpu_s: float = 0.0
    """CPU seconds of the etcd members meanwhile, summed."""
    notes: dict = field(default_factory=dict)


class ScaleHarness:
    """N simulated nodes of G workers on a real etcd cluster (module docstring)."""

    def __init__(self, *, nodes: int, gpus_per_node: int = 8, config: str = "configs/llama3-70b.yaml",
                 overrides: list[str] | None = None, step_s: float = 1.0, backend: str = "nccl",
                 lease_ttl_s: int = 5, etcd_members: int = 3, log_dir: Path | None = None,
                 trace_dir: Path | None = None, worker_start_s: float = 0.0, node_relay: bool = True,
                 log: Callable[[str], None] = print):
        """`trace_dir`: every simulated worker's store requests traced there, one file per
        worker, as `PLANARIA_STORE_TRACE` traces a real worker's (`traffic` compares them).
        `worker_start_s`: the seconds a worker takes from its start to its first request
        (a real one imports torch and loads its data first; 0: at once). `node_relay`: each
        node's workers reach etcd through their agent's relay, as by default (False: each
        its own client, as `--no-node-relay`)."""
        self.n0, self.gpus = nodes, gpus_per_node
        self.config, self.overrides = config, [*HARNESS_OVERRIDES, *(overrides or [])]
        self.step_s, self.backend, self.lease_ttl_s = step_s, backend, lease_ttl_s
        self.trace_dir, self.worker_start_s = trace_dir, worker_start_s
        self.run_id = f"scale-{uuid.uuid4().hex[:8]}"
        self._temporary = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="planaria-scale-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.etcd = EmbeddedEtcdCluster(etcd_members, log_dir=self.log_dir)
        self.plane, self.observer, self.sizes = DataPlane(), Observer(), WriteSizes()
        self.metrics_directory = MetricsDirectory()
        self.records = SharedRecords()
        self.agents: list[SimulatedAgent] = []
        self.log = log
        self._clients: list[EtcdClient] = []
        self.node_relay = node_relay
        self._relay_loop = asyncio.new_event_loop()
        """Where every node's relay serves: one loop for all (a real node runs its own)."""

    # -------------------------------------------------------------- life
    def __enter__(self) -> "ScaleHarness":
        _process_limits()
        _quiet_killed_threads()
        threading.Thread(target=self._relay_loop.run_forever, daemon=True, name="relays").start()
        self.etcd.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for agent in self.agents:
            agent.kill()
        for client in self._clients:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing what is already gone
                pass
        self.etcd.stop()
        self._relay_loop.call_soon_threadsafe(self._relay_loop.stop)
        if self._temporary:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.etcd.members]

    def counts(self) -> EtcdCounts:
        return scrape(self.endpoints)

    def add_node(self) -> SimulatedAgent:
        """A node (its agent and G workers), started; it joins when the leader plans it in."""
        index = len(self.agents)
        settings = EtcdSettings(endpoint=self.etcd.endpoint, retry_s=30.0)
        client = EtcdClient(settings, on_outage=lambda line: None)
        self._clients.append(client)
        agent = SimulatedAgent(
            node=f"node{index}", nproc=self.gpus, client=CutClient(client, self.sizes), plane=self.plane,
            observer=self.observer, step_s=self.step_s, backend=self.backend, log_dir=self.log_dir / f"node{index}",
            settings=settings, run_id=self.run_id, min_nodes=self.n0, config=self.config,
            overrides=self.overrides, lease_ttl_s=self.lease_ttl_s, trace_dir=self.trace_dir,
            worker_start_s=self.worker_start_s, metrics_directory=self.metrics_directory,
            node_relay=self.node_relay, relay_loop=self._relay_loop, records=self.records)
        self.agents.append(agent)
        return agent.start()

    def start(self, timeout_s: float = 600.0) -> float:
        """Every node started, epoch 0 published and bootstrapped by every worker of its
        plan; the seconds it took."""
        started = time.time()
        for first in range(0, self.n0, START_WAVE):
            wave = [self.add_node() for _ in range(first, min(first + START_WAVE, self.n0))]
            self._wait(lambda: all(a.workers_started() or a.exit_code is not None for a in wave), timeout_s,
                       f"nodes {first} to {first + len(wave) - 1} to start their workers")
            self._check_none_ended(wave)
        self._wait(lambda: self._bootstrapped(0), timeout_s, "epoch 0 to be bootstrapped")
        return time.time() - started

    def _check_none_ended(self, agents: list[SimulatedAgent]) -> None:
        """An agent that ended while the job starts leaves epoch 0 short of its nodes for
        good: said at once, with its own last lines, rather than at the start's timeout."""
        ended = [a for a in agents if a.exit_code is not None]
        if ended:
            said = "; ".join(f"{a.node} (exit {a.exit_code}): {' | '.join(a.lines[-3:])}" for a in ended[:4])
            raise self._said(RuntimeError(f"{len(ended)} of the {len(agents)} nodes just started ended before "
                                          f"epoch 0: {said}"))

    # ------------------------------------------------------------ faults
    def live(self) -> list[SimulatedAgent]:
        return [a for a in self.agents if a.exit_code is None and not a.cut_client.killed.is_set()]

    def leader(self) -> SimulatedAgent | None:
        return next((a for a in self.live() if a.controller is not None and a.controller.plan is not None), None)

    def kill_node(self, index: int) -> None:
        """Node `index` dies; the others' probes find it gone within a probe period, as a
        refused connection tells a real probe."""
        agent = self.agents[index]
        agent.kill()

        def seen() -> None:
            for other in self.live():
                other.probe.gone = sorted({*other.probe.gone, agent.node})
        threading.Timer(PERIOD_S, seen).start()

    def kill_leader(self) -> int:
        leader = self.leader()
        index = self.agents.index(leader)
        self.kill_node(index)
        return index

    def notice(self, index: int, grace_s: float = 120.0) -> None:
        self.agents[index].notice(grace_s)

    def partition(self, cut: list[int]) -> Callable[[], None]:
        """The nodes `cut` and the others cannot reach each other (etcd reaches both);
        the epoch's steps across the cut stop. The heal, returned."""
        inside = {self.agents[i].node for i in cut}
        outside = {a.node for a in self.live()} - inside
        for agent in self.live():
            agent.probe.unreachable = sorted(outside if agent.node in inside else inside)
        self.plane.block_all()

        def heal() -> None:
            for agent in self.live():
                agent.probe.unreachable = []
        return heal

    # ------------------------------------------------------- measurement
    def steady(self, window_s: float) -> tuple[EtcdCounts, float]:
        """etcd's counts over `window_s` while nothing changes, and the window's length."""
        before, started = self.counts(), time.monotonic()
        time.sleep(window_s)
        return self.counts() - before, time.monotonic() - started

    def reconfigure(self, fault: Callable[[], None], kind: str, timeout_s: float = 600.0) -> Reconfiguration:
        """Cause `fault`, wait until the next epoch is published, held, bootstrapped and
        trained by every worker of its plan, and measure it."""
        leader = self.leader()
        epoch = leader.controller.epoch if leader is not None else 0
        before, largest_before = self.counts(), self.sizes.largest
        self.sizes.largest = 0
        cpu, etcd_cpu, leader_cpu = _thread_cpu(), self._etcd_cpu(), _task_cpu(leader)
        fault_s = time.time()
        fault()
        self._wait(lambda: self._trained(epoch + 1), timeout_s, f"epoch {epoch + 1} to train ({kind})")
        counts = self.counts() - before
        event = self._event(epoch + 1)
        new_leader = self.leader()
        plan = new_leader.controller.plan
        workers = set(plan.rank_of_worker())
        held = self.observer.held.get(epoch + 1, {})
        booted = self.observer.bootstrapped.get(epoch + 1, {})
        change = Reconfiguration(
            kind=kind, epoch=epoch + 1, nodes=len(plan.nodes()), workers=len(workers),
            detected_s=event.detected_s - fault_s, statuses_s=event.statuses_s - fault_s,
            planned_s=event.planned_s - fault_s, published_s=event.published_s - fault_s,
            records_held_s=max(held[w] for w in workers) - fault_s,
            bootstrapped_s=max(booted[w] for w in workers) - fault_s,
            first_step_s=self.observer.trained[epoch + 1] - fault_s, etcd=counts,
            largest_write=self.sizes.largest, controller_cpu_s=_thread_cpu() - cpu,
            leader_cpu_s=_task_cpu(new_leader) - (leader_cpu if new_leader is leader else 0.0),
            etcd_cpu_s=self._etcd_cpu() - etcd_cpu)
        self.sizes.largest = max(self.sizes.largest, largest_before)
        return change

    def _etcd_cpu(self) -> float:
        return sum(_cpu_of(f"/proc/{m.process.pid}/stat") for m in self.etcd.members if m.process is not None)

    def _event(self, epoch: int) -> EpochEvent:
        for agent in self.live():
            if agent.controller is not None:
                for event in agent.controller.events:
                    if event.epoch == epoch:
                        return event
        raise RuntimeError(f"no leader holds the event of epoch {epoch}")

    def _plan(self, epoch: int):
        leader = self.leader()
        if leader is None or leader.controller.epoch < epoch:
            return None
        return leader.controller.plan if leader.controller.epoch == epoch else None

    def _bootstrapped(self, epoch: int) -> bool:
        plan = self._plan(epoch)
        return plan is not None and (set(self.records.facts(epoch, plan).rank_of_worker)
                                     <= set(self.observer.bootstrapped.get(epoch, {})))

    def _trained(self, epoch: int) -> bool:
        return self._bootstrapped(epoch) and epoch in self.observer.trained

    def _wait(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise self._said(TimeoutError(f"the scale harness waited {timeout_s:.0f} s for {what}; "
                                              f"the agents' last lines: {self._last_lines()}"))
            time.sleep(0.05)

    def _said(self, err: Exception) -> Exception:
        """`err`, logged now: stopping many simulated nodes takes minutes before a
        traceback would show it."""
        self.log(f"scale harness: {err}")
        return err

    def _last_lines(self) -> list[str]:
        return [f"{a.node}: {a.lines[-1]}" for a in self.agents if a.lines][-8:]


def _cpu_of(stat_path: str) -> float:
    """User + system CPU seconds of a process or thread, from its /proc stat (0 if gone)."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _task_cpu(agent) -> float:
    """CPU seconds of an agent's thread (its loop: the controller's, on the leader)."""
    thread = getattr(agent, "thread", None)
    if thread is None or thread.native_id is None:
        return 0.0
    return _cpu_of(f"/proc/self/task/{thread.native_id}/stat")


def _thread_cpu() -> float:
    """CPU seconds of this whole process (every agent, controller and worker)."""
    return time.process_time()


def _quiet_killed_threads() -> None:
    """A thread of a killed node ends on `Killed`: the node's death, not an error to print."""
    previous = threading.excepthook

    def hook(args) -> None:
        if not issubclass(args.exc_type, Killed):
            previous(args)
    threading.excepthook = hook


def _process_limits() -> None:
    """Thousands of connections and threads in one process: as many files as allowed,
    and thread stacks of 512 KiB (a simulated worker's threads hold a few frames; 8 MiB
    each, tens of thousands of them would reserve hundreds of GB of address space)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    threading.stack_size(512 * 1024)
    # c10d's TCPStore names each peer of a connection through a reverse lookup
    # (getnameinfo without NI_NUMERICHOST, for its log lines): where no name server
    # answers, a lookup waits out the resolver's timeout, 5 s by default, and one
    # connection in some tens stalled that long in a sandbox without DNS. A resolver that
    # gives up after 1 s (glibc reads RES_OPTIONS at its first lookup) keeps the epochs'
    # bootstrap times the harness's, not the name server's.
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
