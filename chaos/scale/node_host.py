"""A set of simulated nodes in one process, and what the harness asks of them.

`NodeHost` owns the nodes (`SimulatedAgent`s) of one process: it starts them, kills
them, tells their probes what the network does, and answers the harness's questions
(who leads, the leader's plan and events, the largest write, CPU spent) from their
memory, without a request to etcd. The harness drives one `NodeHost` in its own
process for a few dozen nodes, or several, each in a process of its own
(`hosted_nodes`), where one interpreter cannot carry the nodes' thousands of threads:
`serve` is such a process's entry.
"""
from __future__ import annotations

import asyncio
import os
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from planaria.chaos.scale.cutoff import CutClient, Killed, WriteSizes
from planaria.chaos.scale.data_plane import DataPlane
from planaria.chaos.scale.shared_records import SharedRecords
from planaria.chaos.scale.sim_metrics import MetricsDirectory
from planaria.chaos.scale.sim_node import SimulatedAgent
from planaria.chaos.scale.sim_relay import MARGIN_S
from planaria.chaos.scale.sim_worker import Observer
from planaria.chaos.scale.thread_cpu import ThreadCpu, cpu_of, name_threads
from planaria.elastic.agent_options import POLL_S, etcd_timeouts
from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.runtime.worker.epoch_watcher import QUIET_S
from planaria.runtime.contract.epochs import EpochEvent

LOOP_CALL_THREADS = 64
"""The threads a node process's relay loop hands blocking calls to (`NodeHost`), at most."""
LOOP_CALLS = "loop-calls"
"""Their names' prefix."""


@dataclass(frozen=True)
class NodeSpec:
    """What every simulated node of a run is made of (`ScaleHarness`'s arguments)."""

    endpoint: str
    run_id: str
    gpus_per_node: int
    min_nodes: int
    config: str
    overrides: tuple[str, ...]
    step_s: float
    backend: str
    lease_ttl_s: int
    log_dir: Path
    trace_dir: Path | None = None
    worker_start_s: float = 0.0
    node_relay: bool = True
    keep_logs: bool = False
    """Each agent's lines written to its node's directory under `log_dir` (agent.log)."""
    relay_margin_s: float = MARGIN_S
    """How long past its own wait a worker's call to its relay may take."""
    monitor_interval_s: float = POLL_S
    """How often each agent looks at its workers and the job (`--monitor-interval`)."""
    watcher_quiet_s: float = QUIET_S
    """How long a worker's epoch watcher waits for a word before it asks its relay again."""
    join_timeout_s: float = 600.0
    """How long the first nodes wait for the job's minimum to come (the agent's `join_timeout`)."""
    etcd_retry_s: float = 30.0
    """How long an agent's etcd request is retried before it gives up (the agent's
    `--etcd-retry`): longer where the last waves of a thousand nodes start on a saturated
    machine."""
    etcd_timeout_s: float = 5.0
    """The agents' `--etcd-timeout`: per request, and their streams' pings (`etcd_timeouts`).
    On two cores carrying a thousand simulated nodes an answer can take longer than 5 s,
    and a stream whose ping goes unanswered is broken and opened again (gRPC starts two
    threads per stream), which adds to the load that delayed it."""
    niceness: int = 0
    idle: bool = False
    """The node processes under Linux's SCHED_IDLE: they run only on CPU that etcd's
    members and the harness's own process leave. Niceness alone does not do it: a nice-10
    thread weighs a tenth of one of etcd's, but a hundred of them runnable at once outweigh
    etcd's few (at 1,024 nodes, nice 10, etcd's raft leader missed its heartbeats by 4.5 s
    and a lease grant took 7 s)."""
    """The node processes' niceness (`os.nice`): above 0, etcd's members and the harness's
    own waits are scheduled before the simulation's thousands of threads, as a real etcd's
    cores are not a simulated node's. The CPU each side spends is measured either way."""


@dataclass
class NodeState:
    """A node as the harness's waits see it."""

    exit_code: int | None
    killed: bool
    workers_started: bool

    @property
    def live(self) -> bool:
        return self.exit_code is None and not self.killed


class NodeHost:
    """The simulated nodes of this process (module docstring). `plane` and `observer`
    are the harness's own in its process, or a node process's links to it."""

    def __init__(self, spec: NodeSpec, plane=None, observer: Observer | None = None):
        self.spec = spec
        self.plane, self.observer = plane or DataPlane(), observer or Observer()
        self.sizes, self.records, self.metrics_directory = WriteSizes(), SharedRecords(), MetricsDirectory()
        self.agents: dict[int, SimulatedAgent] = {}
        self._clients: list[EtcdClient] = []
        self._plan_workers: tuple = (None, frozenset())
        name_threads()
        self._thread_cpu = ThreadCpu()
        """This process's CPU by kind of thread (`thread_cpu`)."""
        self._relay_loop = asyncio.new_event_loop()
        """Where every node's relay of this process serves (a real node runs its own)."""
        self._relay_loop.set_exception_handler(_quiet_killed_tasks)
        # What its workers' watch tasks hand to a thread (a join's connection ahead, begun
        # where a real worker's watcher thread begins it): asyncio's default pool has
        # cpu_count + 4 threads, 6 on two cores, and at a join 256 workers' calls queued on
        # them, each reading its node's prepared record on a saturated machine: the plan's
        # rank 0 began minutes after its peers. Threads are made as calls need them.
        self._relay_loop.set_default_executor(ThreadPoolExecutor(max_workers=LOOP_CALL_THREADS,
                                                                 thread_name_prefix=LOOP_CALLS))
        threading.Thread(target=self._relay_loop.run_forever, daemon=True, name="relays").start()

    # ------------------------------------------------------------- nodes
    def add(self, index: int) -> None:
        """Node `index` (its agent and workers), started; it joins when the leader plans it in."""
        spec = self.spec
        settings = EtcdSettings(endpoint=spec.endpoint, retry_s=spec.etcd_retry_s,
                                **etcd_timeouts(spec.etcd_timeout_s))
        client = EtcdClient(settings, on_outage=lambda line: None)
        self._clients.append(client)
        self.agents[index] = SimulatedAgent(
            node=f"node{index}", nproc=spec.gpus_per_node, client=CutClient(client, self.sizes), plane=self.plane,
            observer=self.observer, step_s=spec.step_s, backend=spec.backend,
            log_dir=spec.log_dir / f"node{index}", settings=settings, run_id=spec.run_id,
            min_nodes=spec.min_nodes, config=spec.config, overrides=list(spec.overrides),
            lease_ttl_s=spec.lease_ttl_s, monitor_interval_s=spec.monitor_interval_s, trace_dir=spec.trace_dir,
            worker_start_s=spec.worker_start_s,
            metrics_directory=self.metrics_directory, node_relay=spec.node_relay, relay_loop=self._relay_loop,
            records=self.records, keep_log=spec.keep_logs, relay_margin_s=spec.relay_margin_s,
            watcher_quiet_s=spec.watcher_quiet_s, join_timeout_s=spec.join_timeout_s).start()

    def states(self) -> dict[int, NodeState]:
        return {i: NodeState(a.exit_code, a.cut_client.killed.is_set(), a.workers_started())
                for i, a in self.agents.items()}

    def kill(self, index: int) -> None:
        self.agents[index].kill()

    def notice(self, index: int, grace_s: float) -> None:
        self.agents[index].notice(grace_s)

    def _live(self) -> list[SimulatedAgent]:
        return [a for a in self.agents.values() if a.exit_code is None and not a.cut_client.killed.is_set()]

    def gone(self, node: str) -> None:
        """`node` died: every probe here finds it gone (a refused connection)."""
        for agent in self._live():
            agent.probe.gone = sorted({*agent.probe.gone, node})

    def cut(self, inside: list[str], outside: list[str]) -> None:
        """A partition: the nodes `inside` and those `outside` cannot reach each other."""
        for agent in self._live():
            agent.probe.unreachable = sorted(outside if agent.node in inside else inside)

    def heal(self) -> None:
        for agent in self._live():
            agent.probe.unreachable = []

    def block(self) -> None:
        """No step of any epoch completes any more (a partition across its groups)."""
        self.plane.block_all()

    # --------------------------------------------------- what the leader knows
    def leader(self) -> int | None:
        """The index of this process's node that leads with a plan, if one does."""
        live = self._live()
        return next((i for i, a in self.agents.items() if a in live
                     and a.controller is not None and a.controller.plan is not None), None)

    def leader_epoch(self, index: int) -> int | None:
        controller = self.agents[index].controller
        return None if controller is None else controller.epoch

    def plan_workers(self, epoch: int) -> frozenset | None:
        """The workers of `epoch`'s plan, while the leader here is at that epoch."""
        index = self.leader()
        controller = None if index is None else self.agents[index].controller
        # `epoch` moves before `plan` does as the controller publishes (`Controller._publish`).
        if controller is None or controller.plan is None or controller.plan.epoch != epoch:
            return None
        if self._plan_workers[0] is not controller.plan:  # asked a few times a second: built once
            self._plan_workers = (controller.plan, frozenset(self.records.facts(epoch, controller.plan).rank_of_worker))
        return self._plan_workers[1]

    def event(self, epoch: int) -> EpochEvent | None:
        for agent in self._live():
            for event in (agent.controller.events if agent.controller is not None else ()):
                if event.epoch == epoch:
                    return event
        return None

    def thread_cpu(self, index: int | None) -> float:
        """CPU seconds of node `index`'s agent thread (its loop: the controller's, on the leader)."""
        thread = None if index is None else getattr(self.agents.get(index), "thread", None)
        if thread is None or thread.native_id is None:
            return 0.0
        return cpu_of(f"/proc/self/task/{thread.native_id}/stat")

    # ------------------------------------------------------------ accounts
    def largest_write(self, reset: bool = False) -> int:
        largest = self.sizes.largest
        if reset:
            self.sizes.largest = 0
        return largest

    def restore_largest(self, largest: int) -> None:
        self.sizes.largest = max(self.sizes.largest, largest)

    def cpu(self) -> float:
        """CPU seconds of this whole process (its agents, relays and workers)."""
        return time.process_time()

    def cpu_by_kind(self) -> dict[str, float]:
        """CPU seconds of this process so far, by kind of thread (`thread_cpu`)."""
        return self._thread_cpu.totals()

    def lines(self, index: int, last: int = 20) -> list[str]:
        return list(self.agents[index].lines[-last:]) if index in self.agents else []

    def last_lines(self) -> dict[int, str]:
        return {i: a.lines[-1] for i, a in self.agents.items() if a.lines}

    def close(self) -> None:
        for agent in self.agents.values():
            agent.kill()
        for client in self._clients:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing what is already gone
                pass
        self._relay_loop.call_soon_threadsafe(_cancel_and_stop, self._relay_loop)


def _cancel_and_stop(loop: asyncio.AbstractEventLoop) -> None:
    """Stop the relays' loop, its tasks canceled first (the dead workers' watches waiting
    for a change: left pending, asyncio would say each was destroyed so)."""
    for task in asyncio.all_tasks(loop):
        task.cancel()
    loop.call_soon(loop.stop)


# ------------------------------------------------------------ a node process
class _Link:
    """A `multiprocessing` connection that several threads send on."""

    def __init__(self, connection):
        self.connection = connection
        self._lock = threading.Lock()

    def send(self, message) -> None:
        with self._lock:
            self.connection.send(message)


class ForwardedObserver(Observer):
    """`Observer` whose notes also go to the harness's process (the harness's timings
    are over every process's workers)."""

    def __init__(self, link: _Link):
        super().__init__()
        self.link = link

    def note(self, table: dict, epoch: int, worker) -> None:
        super().note(table, epoch, worker)
        self.link.send(("note", "held" if table is self.held else "bootstrapped", epoch, worker, time.time()))

    def first_step(self, epoch: int) -> None:
        super().first_step(epoch)
        self.link.send(("first_step", epoch, time.time()))


def serve(commands, events, spec: NodeSpec) -> None:
    """A node process: its nodes answer `commands` (method name and arguments, one at a
    time, answered in order) until the harness closes it or goes away; `events` carries
    the data plane's messages and the observer's notes."""
    from planaria.chaos.scale.step_hub import HostedDataPlane

    process_limits()
    if spec.niceness:
        os.nice(spec.niceness)
    if spec.idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # (threads made later inherit it)
    # A node process holds hundreds of threads that want the interpreter at once; each
    # waiting thread wakes at every switch interval (5 ms by default) to ask for it. At
    # 640 nodes of 16 processes those wakes were two thirds of the machine's CPU, in the
    # kernel (futex calls), and the harness's own calls to its processes went unanswered.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    quiet_killed_threads()
    slow_grpc_wakes()
    link = _Link(events)
    plane = HostedDataPlane(link)
    host = NodeHost(spec, plane=plane, observer=ForwardedObserver(link))

    def decisions() -> None:
        while True:
            try:
                plane.on_decided(events.recv())
            except (EOFError, OSError):
                os._exit(0)
    threading.Thread(target=decisions, daemon=True, name="step-hub-decisions").start()
    while True:
        try:
            method, args = commands.recv()
        except (EOFError, OSError):
            os._exit(0)  # the harness went away: its nodes with it
        try:
            answer = ("ok", getattr(host, method)(*args))
        except Exception as err:  # noqa: BLE001 - the harness says it, with this process's part
            answer = ("error", f"{type(err).__name__}: {err}")
        commands.send(answer)
        if method == "close":
            os._exit(0)


# ----------------------------------------------------- process-wide settings
def quiet_killed_threads() -> None:
    """A thread of a killed node ends on `Killed`: the node's death, not an error to print."""
    previous = threading.excepthook

    def hook(args) -> None:
        if not issubclass(args.exc_type, Killed):
            previous(args)
    threading.excepthook = hook


def _quiet_killed_tasks(loop, context: dict) -> None:
    """A relay's task of a killed node ends on `Killed`, as its threads do (not an error)."""
    if not isinstance(context.get("exception"), Killed):
        loop.default_exception_handler(context)


def process_limits() -> None:
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


SWITCH_INTERVAL_S = 0.05
"""The node processes' interpreter switch interval (`sys.setswitchinterval`; see `serve`)."""

GRPC_WAIT_S = 5.0
"""How often a blocked gRPC call of the harness's nodes wakes (`slow_grpc_wakes`)."""


def slow_grpc_wakes(wait_s: float = GRPC_WAIT_S) -> float:
    """gRPC's blocking calls wake every 0.1 s (`grpc._common.MAXIMUM_WAIT_TIMEOUT`), only
    so that a main thread blocked in one still runs its signal handlers; an answer wakes
    the call at once whatever the period (a notified condition). Each simulated node holds
    two such calls open for good (its watch stream and its lease keep-alive stream): 64
    nodes' wakes took a tenth of a core of this machine's two. In the harness's
    processes, whose main threads make no gRPC call, they wake every `wait_s`. The
    previous period, returned (the in-process harness puts it back)."""
    from grpc import _common

    previous, _common.MAXIMUM_WAIT_TIMEOUT = _common.MAXIMUM_WAIT_TIMEOUT, wait_s
    return previous
