"""A simulated worker: every request a real worker makes to its control plane, in order,
with no arithmetic (a step is a sleep).

It follows `planaria.runtime.worker.elastic_worker.ElasticWorker` call for call, through
the same objects: the runtime's `StoreCoordinator` over an etcd store of the job's
prefix, its `EpochWatcher` (the progress it publishes, its polls, the release on a
failure), the epoch's rendezvous store with the process groups' bootstrap replayed on it
(`bootstrap`: a real TCPStore that the plan's rank 0 hosts, found by the others through
etcd, as a real worker's), and a planned leave's steps (`planaria.runtime.worker.leaving.leave`).
What a real worker computes, it takes from the plan: the layers it holds are its
stage's, its step is committed when every rank of the epoch reached it (`data_plane`).
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Callable

import torch.distributed as dist

from planaria.chaos.scale.bootstrap import gloo_direct, mesh, replay, GLOO_ADDRESS_BYTES
from planaria.chaos.scale.cutoff import Killed
from planaria.chaos.scale.data_plane import DataPlane, Released, RankRelease
from planaria.runtime.contract.epochs import EpochRecord, EpochTiming, Progress
from planaria.runtime.contract.exactly_once import INCOMPLETE, SYNCED, CommitRecord, WorkerStatus
from planaria.runtime.contract.exits import EXIT_LEFT
from planaria.runtime.worker.coordination import JobEnded, StoreCoordinator
from planaria.runtime.worker.epoch_watcher import EpochWatcher
from planaria.runtime.worker.leaving import LEAVE_LINGER_S
from planaria.templates.plan import Worker


class Observer:
    """When each worker held each epoch's record and finished its groups' bootstrap
    (time.time()), for the harness's timings; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.held: dict[int, dict[Worker, float]] = {}
        self.bootstrapped: dict[int, dict[Worker, float]] = {}
        self.trained: dict[int, float] = {}

    def note(self, table: dict, epoch: int, worker: Worker) -> None:
        with self._lock:
            table.setdefault(epoch, {})[worker] = time.time()

    def first_step(self, epoch: int) -> None:
        with self._lock:
            self.trained.setdefault(epoch, time.time())


class SimulatedWorker:
    """One worker's control-plane traffic (module docstring); `run` is its process."""

    def __init__(self, store: dist.Store, worker: Worker, *, plane: DataPlane, observer: Observer,
                 step_s: float, total_steps: int, backend: str, log: Callable[[str], None],
                 tied_layers: tuple[int, ...] = (), wait_s: float = 3600.0):
        # Its nodes are threads of one process: their epochs' stores are hosted on loopback.
        self.coordinator = StoreCoordinator(store, worker, node_address="127.0.0.1")
        self.worker, self.plane, self.observer = worker, plane, observer
        self.step_s, self.total_steps, self.backend = step_s, total_steps, backend
        self.tied_layers, self.wait_s, self._log = tied_layers, wait_s, log
        self.last_stepped, self.commit, self.holds, self.synced = -1, None, (), False
        self._last_commit: tuple[int, int, float] | None = None

    # ------------------------------------------------------------------ loop
    def run(self) -> int:
        self.coordinator.announce()
        epoch, prepared = -1, None
        while True:
            try:
                epoch, record = prepared or self.coordinator.wait_for_epoch(epoch, self.wait_s)
            except JobEnded as end:
                return 0 if end.outcome == "ok" else 1
            self.observer.note(self.observer.held, epoch, self.worker)
            if self.worker[0] in record.leaving:
                code = self._leave(epoch, record)
                if code is not None:
                    return code
                prepared = None
                continue
            if self.worker not in record.plan.rank_of_worker():
                self.coordinator.mark_ready(epoch)
                continue
            prepared = self._run_epoch(epoch, record)

    def _run_epoch(self, epoch: int, record: EpochRecord) -> tuple[int, EpochRecord] | None:
        plan = record.plan
        rank = plan.rank_of_worker()[self.worker]
        barrier = self.plane.epoch(epoch, plan.world_size)
        timing = EpochTiming(record_s=time.time())
        watcher = EpochWatcher(self.coordinator, epoch, RankRelease(barrier, rank), self._log, stuck_s=0,
                               progress=self._progress if rank == 0 else None)
        watcher.start()
        stopped = finished = False
        try:
            store = self.coordinator.rendezvous_store(epoch, host=rank == 0)
            replay(store, plan, rank, self.backend, self.tied_layers)
            self._handoff(epoch, record)
            self._enter(plan, rank)
            self.observer.note(self.observer.bootstrapped, epoch, self.worker)
            timing = replace(timing, rendezvous_s=time.time(), transfer_s=time.time())
            finished = self._train(epoch, plan.first_iteration, barrier, rank, watcher)
            if not finished:
                stopped = True
        except (dist.DistStoreError, Released, RuntimeError) as err:
            timing = replace(timing, failed_s=time.time(), error=str(err).splitlines()[0][:300])
        finally:
            watcher.done.set()
        # In `ElasticWorker._run_epoch`'s order: after a stop its publisher thread sends the
        # status, then reads the prepared record, then sends the timing.
        self.coordinator.publish_status(epoch, self._status(finished))
        prepared = self.coordinator.prepared_record(epoch) if stopped else None
        self.coordinator.publish_timing(epoch, timing)
        if prepared is None:
            return None
        first = self.last_stepped + 1
        return epoch + 1, replace(prepared, plan=replace(prepared.plan, first_iteration=first))

    def _train(self, epoch: int, first: int, barrier, rank: int, watcher: EpochWatcher) -> bool:
        """Steps until the job's last (True) or a stop the commit agreed on (False)."""
        for iteration in range(first, self.total_steps):
            time.sleep(self.step_s)
            self.synced = True
            stop = barrier.step(rank, iteration, watcher.requested.is_set())
            self.last_stepped, self.synced = iteration, False
            self.commit = CommitRecord(iteration, loss=1.0, grad_norm=1.0)
            if iteration == first:
                self.coordinator.mark_trained(epoch)
                self.observer.first_step(epoch)
            self._last_commit = (epoch, iteration, time.time())
            if stop and iteration + 1 < self.total_steps:
                return False
        return True

    def _enter(self, plan, rank: int) -> None:
        """Hold the plan's layers at the step before its first (received, or rolled forward)."""
        first = plan.first_iteration
        if self.last_stepped != first - 1:
            self.commit = None  # received the state, not the step
        self.last_stepped, self.synced = first - 1, False
        tp_rank = plan.rank_info(rank).tp_rank
        self.holds = tuple((layer, tp_rank) for layer in plan.layers_of(rank))

    # ----------------------------------------------------------- leaving
    def _handoff(self, epoch: int, record: EpochRecord) -> bool:
        """A planned leave's handoff group, when this worker is in it (as a source or a
        destination): its bootstrap on the epoch's store. True when it took part."""
        handoff = [t for t in record.transfers if t.src[0] in record.leaving]
        ranks = sorted({w for t in handoff for w in (t.src, t.dst)})
        if self.worker not in ranks:
            return False
        store = dist.PrefixStore("handoff/", self.coordinator.rendezvous_store(epoch))
        mesh(store, gloo_direct(""), ranks.index(self.worker), len(ranks), GLOO_ADDRESS_BYTES[1])
        return True

    def _leave(self, epoch: int, record: EpochRecord) -> int | None:
        """`leaving.leave`'s requests: the handoff, the word that it landed, the wait for
        the next epoch's first step."""
        try:
            sent = self._handoff(epoch, record)
        except RuntimeError:  # (dist errors are: the host of the epoch's store gone too)
            if self.coordinator.reconfigure_requested(epoch):
                return None
            return 1
        if sent and any(t.src == self.worker for t in record.transfers):
            self.coordinator.handed_off(epoch)
        if record.plan.first_iteration < self.total_steps:
            trained = self.coordinator.wait_until_trained(epoch, LEAVE_LINGER_S)
            if not trained and self.coordinator.reconfigure_requested(epoch):
                return None
        return EXIT_LEFT

    # ------------------------------------------------------------ reports
    def _status(self, finished: bool) -> WorkerStatus:
        return WorkerStatus(worker=self.worker, last_stepped=self.last_stepped,
                            state=SYNCED if self.synced else INCOMPLETE, commit=self.commit,
                            holds=self.holds, finished=finished)

    def _progress(self) -> Progress | None:
        if self._last_commit is None:
            return None
        epoch, step, at = self._last_commit
        return Progress(epoch=epoch, step=step, time_s=at, step_s=self.step_s)


class SimulatedProcess:
    """A simulated worker as its agent's supervisor sees a process (`subprocess.Popen`'s
    poll, wait, send_signal, kill, returncode): a thread whose death is its node's
    client cut off."""

    def __init__(self, worker: SimulatedWorker, cut: Callable[[], None], name: str):
        self.returncode: int | None = None
        self._cut = cut
        self._close_stores = worker.coordinator.close  # a dead process's epoch store dies with it
        self._thread = threading.Thread(target=self._run, args=(worker,), daemon=True, name=name)
        self._thread.start()

    def _run(self, worker: SimulatedWorker) -> None:
        try:
            code = worker.run()
        except Killed:
            code = -9
        except Exception as err:  # noqa: BLE001 - a worker's uncaught error is its exit
            worker._log(f"worker {worker.worker} failed: {type(err).__name__}: {err}")
            code = 1
        if self.returncode is None:
            self.returncode = code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        self._thread.join(timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self.kill()

    def kill(self) -> None:
        if self.returncode is None:
            self.returncode = -9
        self._cut()
        self._close_stores()
