"""The scale harness's run: a real three-member etcd, N simulated nodes of G workers, the
faults, and what each costs (the package docstring says what is real and what is not).

    with ScaleHarness(nodes=64, gpus_per_node=8, config="configs/llama3-70b.yaml") as h:
        h.start()                      # the first epoch published and bootstrapped everywhere
        quiet = h.steady(10.0)         # etcd's requests and bytes while nothing changes
        change = h.reconfigure(lambda: h.kill_node(3), "kill a node")

The harness itself makes no request to etcd: what it needs of the job it reads from the
agents' memory (the leader's controller, the workers' `Observer`), and etcd's counters
over HTTP, so that every request counted is the control plane's.
"""
from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from planaria.chaos.scale.etcd_metrics import EtcdCounts, scrape
from planaria.chaos.scale.hosted_nodes import HostedNodes
from planaria.chaos.scale.node_host import (NodeHost, NodeSpec, cpu_of, process_limits, quiet_killed_threads,
                                            slow_grpc_wakes)
from planaria.chaos.scale.sim_relay import MARGIN_S
from planaria.chaos.scale.sim_worker import Observer
from planaria.chaos.scale.thread_cpu import difference
from planaria.elastic.agent_options import POLL_S
from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.elastic.etcd_server import EmbeddedEtcdCluster
from planaria.elastic.peer_probe import PERIOD_S
from planaria.runtime.contract import keys
from planaria.runtime.contract.epochs import EpochEvent, Progress
from planaria.runtime.worker.epoch_watcher import QUIET_S

START_WAVE = 64
"""Nodes started at once. A thousand agents started in the same instant on two cores
each wait seconds for the interpreter between their lease's grant and its first renewal,
and their leases lapse (with the agents' default 5 s TTL) before they have registered;
real nodes, each on its own CPUs, do not. So the harness starts them in waves, each once
the previous one's workers are up."""
PROGRESS_S = 15.0
"""How often a wait says where the job is (a thousand nodes take minutes to start)."""
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
    """CPU seconds of the whole harness meanwhile (its process and its node processes:
    every agent, relay and simulated worker)."""
    leader_cpu_s: float = 0.0
    """CPU seconds of the leading agent's thread meanwhile: its controller and planner."""
    etcd_cpu_s: float = 0.0
    """CPU seconds of the etcd members meanwhile, summed."""
    cpu_by_kind: dict = field(default_factory=dict)
    """The nodes' CPU seconds meanwhile by kind of thread (`thread_cpu`): where the
    harness's time went."""
    notes: dict = field(default_factory=dict)


class ScaleHarness:
    """N simulated nodes of G workers on a real etcd cluster (module docstring)."""

    def __init__(self, *, nodes: int, gpus_per_node: int = 8, config: str = "configs/llama3-70b.yaml",
                 overrides: list[str] | None = None, step_s: float = 1.0, backend: str = "nccl",
                 lease_ttl_s: int = 5, etcd_members: int = 3, log_dir: Path | None = None,
                 trace_dir: Path | None = None, worker_start_s: float = 0.0, node_relay: bool = True,
                 processes: int = 1, relay_margin_s: float = MARGIN_S,
                 monitor_interval_s: float = POLL_S, watcher_quiet_s: float = QUIET_S,
                 join_timeout_s: float = 600.0, niceness: int = 0, etcd_retry_s: float = 30.0,
                 etcd_timeout_s: float = 5.0, idle: bool = False, log: Callable[[str], None] = print):
        """`trace_dir`: every simulated worker's store requests traced there, one file per
        worker, as `PLANARIA_STORE_TRACE` traces a real worker's (`traffic` compares them).
        `log_dir`: where etcd's and every agent's logs are kept (node<i>/agent.log; none
        given: a temporary directory, removed at the end, and no agent logs).
        `worker_start_s`: the seconds a worker takes from its start to its first request
        (a real one imports torch and loads its data first; 0: at once). `node_relay`: each
        node's workers reach etcd through their agent's relay, as by default (False: each
        its own client, as `--no-node-relay`). `processes`: the nodes run in this process
        (1) or spread over that many node processes (`hosted_nodes`: for hundreds of nodes).
        `relay_margin_s`: how long past its own wait a worker's call to its relay may be
        answered (a real worker's margin by default; more where this machine's cores,
        simulating thousands of workers, keep a relay's loop from answering for longer).
        `monitor_interval_s`: how often each agent looks at its workers and the job (the
        agent's `--monitor-interval`; a look of a thousand agents ten times a second is
        a core of this machine's two). `watcher_quiet_s`: how long each worker's epoch
        watcher waits for a word before it asks its relay again (`EpochWatcher.quiet_s`:
        requests to the relay, none to etcd; 8,192 watchers' looks every 5 s are a
        third of a core here). `join_timeout_s`: the agents' `join_timeout` (a thousand
        nodes started in waves on two cores take minutes to come). `niceness`: the node
        processes' (`NodeSpec.niceness`; with `processes` > 1). `etcd_retry_s`: the agents'
        `--etcd-retry`; `etcd_timeout_s`, their `--etcd-timeout`. `idle`: the node processes
        under SCHED_IDLE (`NodeSpec.idle`)."""
        if processes < 1:
            raise ValueError(f"processes={processes}: the nodes need at least one process to run in")
        self.n0, self.gpus = nodes, gpus_per_node
        self.step_s, self.processes = step_s, processes
        self.run_id = f"scale-{uuid.uuid4().hex[:8]}"
        self._temporary = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="planaria-scale-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.etcd = EmbeddedEtcdCluster(etcd_members, log_dir=self.log_dir)
        self._spec = dict(run_id=self.run_id, gpus_per_node=gpus_per_node, min_nodes=nodes, config=config,
                          overrides=(*HARNESS_OVERRIDES, *(overrides or [])), step_s=step_s, backend=backend,
                          lease_ttl_s=lease_ttl_s, log_dir=self.log_dir, trace_dir=trace_dir,
                          worker_start_s=worker_start_s, node_relay=node_relay, keep_logs=log_dir is not None,
                          relay_margin_s=relay_margin_s, monitor_interval_s=monitor_interval_s,
                          watcher_quiet_s=watcher_quiet_s, join_timeout_s=join_timeout_s,
                          niceness=niceness, etcd_retry_s=etcd_retry_s, etcd_timeout_s=etcd_timeout_s,
                          idle=idle)
        self.observer = Observer()
        self.nodes: NodeHost | HostedNodes | None = None
        """Where the nodes run: here, or in node processes (made once etcd is up)."""
        self.count = 0
        """Nodes added so far (node `i` is "node{i}")."""
        self.log = log
        self._plans: dict[int, frozenset] = {}
        self._grpc_wait_s: float | None = None
        """gRPC's wake period before the harness changed it (`slow_grpc_wakes`)."""

    # -------------------------------------------------------------- life
    def __enter__(self) -> "ScaleHarness":
        process_limits()
        quiet_killed_threads()
        self.etcd.start()
        spec = NodeSpec(endpoint=self.etcd.endpoint, **self._spec)
        if self.processes == 1:  # the nodes' gRPC calls are this process's
            self._grpc_wait_s = slow_grpc_wakes()
        self.nodes = (NodeHost(spec, observer=self.observer) if self.processes == 1
                      else HostedNodes(spec, self.processes, self.observer, log=self.log))
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.nodes is not None:
            self.nodes.close()
        self.etcd.stop()
        if self._grpc_wait_s is not None:
            slow_grpc_wakes(self._grpc_wait_s)
            self._grpc_wait_s = None
        if self._temporary:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    @property
    def agents(self) -> list:
        """The simulated agents, where they run in this process (`processes=1`)."""
        if not isinstance(self.nodes, NodeHost):
            raise AttributeError("the agents run in node processes: ask the harness (lines, live, leader)")
        return [self.nodes.agents[i] for i in sorted(self.nodes.agents)]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.etcd.members]

    def counts(self) -> EtcdCounts:
        return scrape(self.endpoints)

    def add_node(self) -> int:
        """A node (its agent and G workers), started; it joins when the leader plans it in.
        Its index."""
        index, self.count = self.count, self.count + 1
        self.nodes.add(index)
        return index

    def start(self, timeout_s: float = 600.0) -> float:
        """Every node started, and an epoch published, bootstrapped by every worker of its
        plan and trained; the seconds it took."""
        started = time.time()
        for first in range(0, self.n0, START_WAVE):
            wave = [self.add_node() for _ in range(first, min(first + START_WAVE, self.n0))]

            def up() -> bool:
                states = self.nodes.states()
                return all(states[i].workers_started or states[i].exit_code is not None for i in wave)
            self._wait(up, timeout_s, f"nodes {first} to {first + len(wave) - 1} to start their workers")
            self._check_none_ended(wave)
        # Epoch 0, or the one after it if it was given up (a worker whose start outlasted a
        # timeout on this machine's busy cores): the job is up once an epoch trains.
        self._wait(self._started, timeout_s, "the first epoch to be bootstrapped")
        return time.time() - started

    def _started(self) -> bool:
        epoch = self.epoch()
        return epoch is not None and self._trained(epoch)

    def epoch(self) -> int | None:
        """The epoch the leader is at (None while no node leads with a plan)."""
        leader = self.leader()
        return None if leader is None else self.nodes.leader_epoch(leader)

    def _check_none_ended(self, wave: list[int]) -> None:
        """An agent that ended while the job starts leaves epoch 0 short of its nodes for
        good: said at once, with its own last lines, rather than at the start's timeout."""
        states = self.nodes.states()
        ended = [i for i in wave if states[i].exit_code is not None]
        if ended:
            said = "; ".join(f"node{i} (exit {states[i].exit_code}): {' | '.join(self.lines(i, 3))}"
                             for i in ended[:4])
            raise self._said(RuntimeError(f"{len(ended)} of the {len(wave)} nodes just started ended before "
                                          f"epoch 0: {said}"))

    def lines(self, index: int, last: int = 20) -> list[str]:
        """Node `index`'s agent's last log lines."""
        return self.nodes.lines(index, last)

    # ------------------------------------------------------------ faults
    def live(self) -> list[int]:
        """The indices of the nodes alive (not killed, not ended)."""
        return sorted(i for i, state in self.nodes.states().items() if state.live)

    def leader(self) -> int | None:
        """The index of the node that leads with a plan, if one does."""
        return self.nodes.leader()

    def kill_node(self, index: int) -> None:
        """Node `index` dies; the others' probes find it gone within a probe period, as a
        refused connection tells a real probe."""
        self.nodes.kill(index)
        threading.Timer(PERIOD_S, self.nodes.gone, args=(f"node{index}",)).start()

    def kill_leader(self) -> int:
        index = self.leader()
        self.kill_node(index)
        return index

    def notice(self, index: int, grace_s: float = 120.0) -> None:
        self.nodes.notice(index, grace_s)

    def measured_step_s(self) -> float:
        """The job's step as its controller measures it (`keys.PROGRESS`: the median of
        rank 0's recent steps), read from etcd; `step_s` while none is published. At a
        thousand nodes it runs well past the simulated sleep (the steps meet across
        node processes on a saturated machine), and a planned leave's notice must leave
        two of those steps and more."""
        client = EtcdClient(EtcdSettings(endpoint=self.etcd.endpoint, timeout_s=30.0, retry_s=60.0))
        try:
            value, _ = client.get(keys.run_prefix(self.run_id) + keys.PROGRESS)
        finally:
            client.close()
        return self.step_s if value is None else max(self.step_s, Progress.from_json(value).step_s)

    def partition(self, cut: list[int]) -> Callable[[], None]:
        """The nodes `cut` and the others cannot reach each other (etcd reaches both);
        the epoch's steps across the cut stop. The heal, returned."""
        inside = [f"node{i}" for i in cut]
        outside = [f"node{i}" for i in self.live() if i not in cut]
        self.nodes.cut(inside, outside)
        self.nodes.block()
        return self.nodes.heal

    # ------------------------------------------------------- measurement
    def steady(self, window_s: float) -> tuple[EtcdCounts, float]:
        """etcd's counts over `window_s` while nothing changes, and the window's length
        (from when the epoch in force has trained)."""
        self._wait(self._started, max(600.0, window_s), "the epoch in force to train before the quiet window")
        before, started = self.counts(), time.monotonic()
        time.sleep(window_s)
        return self.counts() - before, time.monotonic() - started

    def harness_cpu(self) -> float:
        """CPU seconds of the harness: this process, and its node processes if any."""
        return time.process_time() + (self.nodes.cpu() if isinstance(self.nodes, HostedNodes) else 0.0)

    def reconfigure(self, fault: Callable[[], None], kind: str, timeout_s: float = 600.0) -> Reconfiguration:
        """Cause `fault`, wait until the next epoch is published, held, bootstrapped and
        trained by every worker of its plan, and measure it. When that epoch fails and a
        later one trains, the change is measured to that one (detection, statuses and
        publication stay the first epoch's), its failed epochs in `notes`."""
        # From a settled job: an epoch still recovering from something else (a node lost
        # during the start, on this saturated machine) would be counted in this fault's figures.
        self._wait(self._started, timeout_s, f"the epoch in force to train before the fault ({kind})")
        leader = self.leader()
        epoch = (self.nodes.leader_epoch(leader) if leader is not None else None) or 0
        before, largest_before = self.counts(), self.nodes.largest_write(reset=True)
        cpu, etcd_cpu, leader_cpu = self.harness_cpu(), self._etcd_cpu(), self.nodes.thread_cpu(leader)
        by_kind = self.nodes.cpu_by_kind()
        fault_s = time.time()
        fault()
        trained: list[int] = []

        def one_trained() -> bool:
            trained[:] = [e for e in range(epoch + 1, (self.epoch() or 0) + 1) if self._trained(e)][:1]
            return bool(trained)
        self._wait(one_trained, timeout_s, f"epoch {epoch + 1} or a later one to train ({kind})")
        counts = self.counts() - before
        # The fault's epoch, when it trained; else the first after it that did (the
        # fault's failed: what it cost runs to the epoch that trained, and is noted).
        first = trained[0]
        event = self._event(epoch + 1)
        new_leader = self.leader()
        workers = self._plans[first]
        held = self.observer.held.get(first, {})
        booted = self.observer.bootstrapped.get(first, {})
        largest = self.nodes.largest_write()
        change = Reconfiguration(
            kind=kind, epoch=first, nodes=len({w[0] for w in workers}), workers=len(workers),
            detected_s=event.detected_s - fault_s, statuses_s=event.statuses_s - fault_s,
            planned_s=event.planned_s - fault_s, published_s=event.published_s - fault_s,
            records_held_s=max(held[w] for w in workers) - fault_s,
            bootstrapped_s=max(booted[w] for w in workers) - fault_s,
            first_step_s=self.observer.trained[first] - fault_s, etcd=counts,
            largest_write=largest, controller_cpu_s=self.harness_cpu() - cpu,
            leader_cpu_s=self.nodes.thread_cpu(new_leader) - (leader_cpu if new_leader == leader else 0.0),
            etcd_cpu_s=self._etcd_cpu() - etcd_cpu, cpu_by_kind=difference(self.nodes.cpu_by_kind(), by_kind))
        if first > epoch + 1:
            change.notes["failed_epochs"] = list(range(epoch + 1, first))
        self.nodes.restore_largest(largest_before)
        return change

    def workers_of(self, epoch: int) -> frozenset:
        """The workers of `epoch`'s plan, as last seen (once the harness waited for it)."""
        return self._plans[epoch]

    def _etcd_cpu(self) -> float:
        return sum(cpu_of(f"/proc/{m.process.pid}/stat") for m in self.etcd.members if m.process is not None)

    def _event(self, epoch: int) -> EpochEvent:
        event = self.nodes.event(epoch)
        if event is None:
            raise RuntimeError(f"no leader holds the event of epoch {epoch}")
        return event

    def _bootstrapped(self, epoch: int) -> bool:
        workers = self.nodes.plan_workers(epoch)
        if workers is None:
            return False
        self._plans[epoch] = workers  # (the last seen: `reconfigure`'s, once trained)
        return workers <= set(self.observer.bootstrapped.get(epoch, {}))

    def _trained(self, epoch: int) -> bool:
        return self._bootstrapped(epoch) and epoch in self.observer.trained

    def _wait(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        started = time.monotonic()
        deadline, said = started + timeout_s, started
        # Each look asks the node processes (a round trip to each): a few a second.
        pause = 0.05 if self.processes == 1 else 0.25
        while not done():
            now = time.monotonic()
            if now > deadline:
                raise self._said(TimeoutError(f"the scale harness waited {timeout_s:.0f} s for {what}; "
                                              f"the agents' last lines: {self._last_lines()}"))
            if now - said > PROGRESS_S:
                said = now
                self.log(f"  waiting {now - started:.0f} s for {what}: {self._where()}")
                if self.count and not self.live():  # the job ended (every agent exited): nothing to wait for
                    raise self._said(RuntimeError(f"every node's agent ended while the harness waited for "
                                                  f"{what}; their last lines: {self._last_lines()}"))
            time.sleep(pause)

    def _where(self) -> str:
        """Where the job is, in a line: live nodes, the leader and its last words."""
        states = self.nodes.states()
        live = sum(state.live for state in states.values())
        leader = self.leader()
        if leader is None:
            return f"{live} of {len(states)} nodes live, none leads with a plan"
        lines = self.lines(leader, 40)
        decided = [line for line in lines if line.startswith("controller:")][-1:]
        return (f"{live} of {len(states)} nodes live; node{leader} leads, at epoch "
                f"{self.nodes.leader_epoch(leader)}: {' | '.join([*decided, *lines[-1:]])[:600]}")

    def _said(self, err: Exception) -> Exception:
        """`err`, logged now: stopping many simulated nodes takes minutes before a
        traceback would show it."""
        self.log(f"scale harness: {err}")
        return err

    def _last_lines(self) -> list[str]:
        lines = self.nodes.last_lines()
        return [f"node{i}: {lines[i]}" for i in sorted(lines)][-8:]
