"""A simulated node: the real agent, whose workers are simulated and whose network the
harness describes.

`SimulatedAgent` is `planaria.elastic.agent.Agent` with three parts swapped, none of
which talks to etcd on its own: the supervisor starts `SimulatedWorker`s in threads
instead of processes (`SimulatedSupervisor`: every request the real one makes, it makes:
the `alive/` keys, the kill requests it serves, the reaping), the reachability probe is
told by the harness which nodes are gone or cut off instead of connecting to them
(`SimulatedProbe`), and the loop runs in a thread of the harness's process, without
signal handlers or a metrics endpoint. Its etcd client is a `CutClient`: the node's
death cuts it, and every thread of the node (the loop, the lease's keep-alive, the
workers and their watchers) ends at its next request.
"""
from __future__ import annotations

import signal
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from planaria.chaos.scale.cutoff import CutClient, Killed
from planaria.chaos.scale.data_plane import DataPlane
from planaria.chaos.scale.shared_records import SharedRecords
from planaria.chaos.scale.sim_metrics import MetricsDirectory, MetricsReads
from planaria.chaos.scale.sim_relay import MARGIN_S, InProcessRelayStore
from planaria.chaos.scale.sim_snapshots import SimulatedSnapshots
from planaria.chaos.scale.sim_worker import Observer, SimulatedProcess, SimulatedWorker
from planaria.elastic.agent import Agent
from planaria.elastic.etcd_store import EtcdStore
from planaria.elastic.worker_supervisor import WorkerSupervisor
from planaria.runtime.config.sections import connect_timeout_s, job_store_timeout_s
from planaria.runtime.worker.epoch_metrics import EpochMetrics
from planaria.runtime.worker.epoch_watcher import QUIET_S
from planaria.runtime.worker.store_trace import TracingStore, trace_path
from planaria.templates.plan import Worker


class SimulatedProbe:
    """What `PeerProbe` would find, as the harness says (`gone`: nodes whose agent died,
    seen by a probe within its period; `unreachable`: nodes across a cut)."""

    def __init__(self, node: str):
        self.node = node
        self.address = f"simulated:{node}"
        self.gone: list[str] = []
        self.unreachable: list[str] = []
        self.never_reached: list[str] = []

    def set_peers(self, peers: dict[str, str]) -> None:
        pass

    def stop(self) -> None:
        pass


class SimulatedSupervisor(WorkerSupervisor):
    """`WorkerSupervisor` whose workers are `SimulatedWorker` threads."""

    def __init__(self, *, make_worker, **kwargs):
        super().__init__(**kwargs)
        self.make_worker = make_worker

    def _spawn(self, worker: Worker) -> None:
        cut, simulated = self.make_worker(worker)
        self.workers[worker] = SimulatedProcess(simulated, cut, name=f"worker-{worker[0]}.{worker[1]}")
        self.client.put(self.prefix + f"alive/{worker[0]}.{worker[1]}", b"1", lease=self.lease())

    def kill_frozen(self) -> None:
        pass  # a simulated worker has no heartbeat file (a file of the node's disk, not a request)


class SimulatedAgent(Agent):
    """The real agent of a simulated node (module docstring)."""

    def __init__(self, *, node: str, nproc: int, client, plane: DataPlane, observer: Observer,
                 step_s: float, backend: str, log_dir: Path, quiet: bool = True,
                 trace_dir: Path | None = None, worker_start_s: float = 0.0,
                 metrics_directory: MetricsDirectory | None = None, relay_loop=None,
                 records: SharedRecords | None = None, keep_log: bool = False,
                 relay_margin_s: float = MARGIN_S, watcher_quiet_s: float = QUIET_S, **agent):
        """`trace_dir`: each worker's store requests traced there, as a real worker's are
        under `PLANARIA_STORE_TRACE` (`planaria.runtime.worker.store_trace`).
        `worker_start_s`: a worker's start-up before its first request (`SimulatedWorker`).
        `metrics_directory`: the run's TensorBoard directory, shared by every node's
        workers (`MetricsReads`; one of this node's own when None). `keep_log`: the
        agent's lines also written to `log_dir`/agent.log. `relay_margin_s`: how long past
        its own wait a worker's call to the relay may take (`sim_relay.MARGIN_S`).
        `watcher_quiet_s`: its workers' epoch watchers' quiet wait (`SimulatedWorker`)."""
        self.cut_client = client
        self.relay_loop = relay_loop
        self.records = records or SharedRecords()
        """Each record parsed once for every simulated worker of the harness (`shared_records`)."""
        """The event loop the node's relay serves on (shared by the harness's nodes), when
        `node_relay` (an `Agent` argument, on by default)."""
        self.trace_dir, self.worker_start_s = trace_dir, worker_start_s
        self.metrics_directory = metrics_directory or MetricsDirectory()
        self.quiet, self.relay_margin_s, self.watcher_quiet_s = quiet, relay_margin_s, watcher_quiet_s
        self.lines: list[str] = []
        self.log_file: Path | None = None
        if keep_log:
            log_dir.mkdir(parents=True, exist_ok=True)
            self.log_file = log_dir / "agent.log"
        super().__init__(node=node, nproc=nproc, client=client, log_dir=log_dir, **agent)
        self.probe = SimulatedProbe(node)
        self.plane, self.observer, self.step_s, self.backend = plane, observer, step_s, backend
        old = self.supervisor
        self.supervisor = SimulatedSupervisor(
            make_worker=self._make_worker, node=node, nproc=nproc, store=self.store,
            lease=lambda: self.membership.lease, store_url=self.store_url, etcd_env={}, run_id=self.run_id,
            config=self.config, overrides=self.overrides, comm=self.cfg.comm, max_restarts=old.max_restarts,
            shutdown_timeout_s=0.0, log_dir=log_dir, output=None, log=self.log)
        self.exit_code: int | None = None
        self.thread: threading.Thread | None = None
        self.worker_stores: list[EtcdStore] = []

    def log(self, message: str) -> None:
        self.lines.append(message)
        if self.log_file is not None:  # the node's own log, as a real agent's output is kept
            with open(self.log_file, "a") as out:
                out.write(f"{time.strftime('%H:%M:%S')} {message}\n")
        if not self.quiet:
            super().log(message)

    def _make_worker(self, worker: Worker):
        """A worker of this node: its own cut-off switch over the node's relay (or, without
        one, over the node's connection to etcd)."""
        own = threading.Event()
        killed = _Either(own, self.cut_client.killed)  # dies with its node: the node's cut cuts it too
        # Its waits on the job's store as long as a real worker's (not the store's 300 s: at
        # 1,024 nodes a wait for an epoch's bootstrap store outlasted that, and failed a
        # join's connection ahead that a real worker would have finished).
        timeout = timedelta(seconds=job_store_timeout_s(self.cfg.comm))
        if self.relay is not None:
            store = InProcessRelayStore(self.relay, f"{worker[0]}.{worker[1]}", killed, timeout=timeout,
                                        margin_s=self.relay_margin_s)
        else:
            client = CutClient(self.cut_client._client, self.cut_client._sizes, cut=own)
            client.killed = killed
            store = EtcdStore(client, self.prefix, timeout)
        self.worker_stores.append(store)
        if self.trace_dir is not None:
            store = TracingStore(store, trace_path(self.trace_dir, worker))
        simulated = SimulatedWorker(store, worker, plane=self.plane, observer=self.observer, step_s=self.step_s,
                                    total_steps=self.cfg.train.steps, backend=self.backend, log=self.log,
                                    snapshots=SimulatedSnapshots(worker, self.cfg.checkpoint.memory_every,
                                                                 self.cfg.checkpoint.memory_copies),
                                    start_s=self.worker_start_s,
                                    metrics=self._metrics(store), records=self.records,
                                    quiet_s=self.watcher_quiet_s,
                                    # (as a real worker's: at 1,024 nodes the default 30 s failed a
                                    # join's connections ahead to its epoch's store on this machine)
                                    connect_timeout_s=connect_timeout_s(self.cfg.comm))
        return own.set, simulated

    def _metrics(self, store) -> MetricsReads | None:
        """A worker's metrics writer's reads, when the job writes TensorBoard metrics."""
        if self.cfg.tensorboard_dir is None:
            return None
        metrics = EpochMetrics(self.cfg, store, torch.device("cpu"), Path(self.cfg.output.dir), self.log)
        return MetricsReads(metrics, self.metrics_directory)

    # ---------------------------------------------------------------- life
    def start(self) -> "SimulatedAgent":
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"agent-{self.node}")
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            self.exit_code = self._simulated_run()
        except Killed:
            self.exit_code = -9
        except Exception as err:  # noqa: BLE001 - said, and the node is gone as a crash would leave it
            # In its log file too, with where it was raised: a node that vanished from a
            # run of a thousand left nothing else to find it by.
            where = traceback.extract_tb(err.__traceback__)[-3:]
            self.log(f"agent failed: {type(err).__name__}: {err} (at "
                     + " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(where)) + ")")
            self.exit_code = 1

    def _simulated_run(self) -> int:
        """`Agent.run` without signals, metrics or a real probe."""
        refused = self._check_job_config() or self._check_not_ended()
        if refused:
            self.log(refused)
            return 2
        self._register()
        self._follow_job()
        self._start_relay(loop=self.relay_loop)
        threading.Thread(target=self._keep_alive, daemon=True, name=f"lease-{self.node}").start()
        self.supervisor.start()
        self.client.retry_s = self.outage_limit_s
        try:
            return self._loop()
        finally:
            self._stop.set()

    def _keep_alive(self) -> None:
        try:
            self.membership.keep_alive(self._stop, lambda: False)
        except Killed:
            pass

    def workers_started(self) -> bool:
        """The node registered under its lease and started its workers."""
        return len(self.supervisor.workers) >= self.nproc

    def kill(self) -> None:
        """The node dies: no request of it goes out any more; its lease lapses."""
        self.cut_client.cut()
        self._stop.set()
        for process in list(self.supervisor.workers.values()):
            process.kill()
        # Their watches' streams end with them (a dead process's connections close).
        for store in [self.store, *self.worker_stores]:
            store.close()
        if self.relay is not None:
            self.relay.close()

    def notice(self, grace_s: float) -> None:
        """A preemption notice, as the signal would bring it (`PreemptionNotices.on_signal`)."""
        self.notices.grace_s = grace_s
        self.notices.on_signal(signal.SIGTERM)


class _Either:
    """An event that is set when either of two is (`is_set` and `set` only)."""

    def __init__(self, own: threading.Event, other: threading.Event):
        self.own, self.other = own, other

    def is_set(self) -> bool:
        return self.own.is_set() or self.other.is_set()

    def set(self) -> None:
        self.own.set()
