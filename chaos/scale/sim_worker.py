"""A simulated worker: every request a real worker makes to its control plane, in order,
with no arithmetic (a step is a sleep).

It follows `planaria.runtime.worker.elastic_worker.ElasticWorker` call for call, through
the same objects: the runtime's `StoreCoordinator` over an etcd store of the job's
prefix, its `EpochWatcher` (the progress it publishes, its polls, the release on a
failure; over its node's relay in this process, `loop_watches.LoopEpochWatcher`, the same
requests from a task of the relay's loop instead of a thread an epoch, and so its
rendezvous's abandon watch), the epoch's rendezvous store with the process groups' bootstrap replayed on it
(`bootstrap`: on a real TCPStore that the plan's rank 0 hosts, found by the others
through etcd, as a real worker's: the epoch's groups, a planned leave's handoff group, and the peer snapshots'
group, which connects on a thread of its own as the real one does), a planned leave's
steps (`planaria.runtime.worker.leaving.leave`), and, with logging.tensorboard, the
reads of its metrics writer while it is an epoch's rank 0 (`sim_metrics`).
tests/chaos/test_scale_traffic.py compares its requests with a real job's, key by key.
What a real worker computes, it takes from the plan: the layers it holds are its
stage's, its step is committed when every rank of the epoch reached it (`data_plane`),
the peer snapshots its status lists are those it would keep (`sim_snapshots`).
"""
from __future__ import annotations

import asyncio
import collections
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from planaria.chaos.scale.bootstrap import HANDOFF, PEER_SNAPSHOTS, gloo_direct, mesh, replay, replay_prepared
from planaria.chaos.scale.cutoff import Killed
from planaria.chaos.scale.data_plane import DataPlane, PeerGone, Released, RankRelease, StepBarrier, connect_barrier
from planaria.chaos.scale.loop_watches import LoopAbandonWatch, LoopEpochWatcher, LoopStore, watches_on_loop
from planaria.chaos.scale.shared_records import SharedRecordCoordinator, SharedRecords
from planaria.chaos.scale.sim_metrics import MetricsReads
from planaria.chaos.scale.sim_snapshots import SimulatedSnapshots
from planaria.runtime.contract.epochs import EpochRecord, EpochTiming, Progress
from planaria.runtime.contract.exactly_once import INCOMPLETE, SYNCED, CommitRecord, WorkerStatus
from planaria.runtime.contract.exits import EXIT_LEFT
from planaria.runtime.contract.logs import error_line
from planaria.runtime.parallel.prepared_groups import BarrierGate
from planaria.runtime.state.peer_snapshots import exchanges_snapshots
from planaria.runtime.worker.connect_ahead import agree_on_first
from planaria.runtime.worker.coordination import JobEnded, close_stores
from planaria.runtime.worker.epoch_watcher import QUIET_S, EpochWatcher
from planaria.runtime.worker.leaving import LEAVE_LINGER_S
from planaria.templates.plan import Worker


@dataclass
class _Ahead:
    """`ConnectAhead`'s one set of groups connected ahead, as a simulated worker replays it."""

    epoch: int
    record: EpochRecord
    done: threading.Event = field(default_factory=threading.Event)
    connected: bool = False
    followed: bool = False
    error: str | None = None
    """Why the connection failed (`PreparedGroups.error`)."""
    gate: BarrierGate = field(default_factory=BarrierGate)
    """Whether it was given up short of its barrier (`PreparedGroups.give_up_short_of_barrier`)."""


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

    def noted_elsewhere(self, table: str, epoch: int, worker: Worker, at: float) -> None:
        """A note taken by another process's observer (`hosted_nodes`): `table` is
        "held" or "bootstrapped"."""
        with self._lock:
            getattr(self, table).setdefault(epoch, {})[worker] = at

    def first_step_elsewhere(self, epoch: int, at: float) -> None:
        with self._lock:
            self.trained[epoch] = min(at, self.trained.get(epoch, at))


LOSS, GRAD_NORM = 4.352497431985631, 1.2903724766878406
"""A step's loss and gradient norm, as wide in JSON as a real step's (float64, 16 or 17
digits): a status and a commit record are as large as a real worker's."""


class SimulatedWorker:
    """One worker's control-plane traffic (module docstring); `run` is its process."""

    def __init__(self, store: dist.Store, worker: Worker, *, plane: DataPlane, observer: Observer,
                 step_s: float, total_steps: int, backend: str, log: Callable[[str], None],
                 tied_layers: tuple[int, ...] = (), wait_s: float = 3600.0,
                 snapshots: SimulatedSnapshots | None = None, start_s: float = 0.0,
                 metrics: MetricsReads | None = None, records: SharedRecords | None = None,
                 quiet_s: float = QUIET_S, connect_timeout_s: float = 30.0):
        """`snapshots`: the peer snapshots it keeps (`checkpoint.memory_every`,
        `memory_copies`): its status lists them, and each epoch of two nodes or more makes
        their group (none: neither). `start_s`: the seconds from the
        worker's start to its first request, which a real worker spends importing torch
        and loading its data (none by default: a simulated worker asks at once).
        `metrics`: its metrics writer's reads (over `store`), when the job writes
        TensorBoard metrics. `quiet_s`: how long its epoch watcher waits for a word
        before it asks its relay again (`EpochWatcher.quiet_s`; etcd sees none of it), and,
        when not the default, its waits for an epoch and its rendezvous's abandon watch too
        (`StoreCoordinator.followed_wait_s`). `connect_timeout_s`: its connection to an
        epoch's bootstrap store, a real worker's `connect_timeout_s(cfg.comm)`."""
        # Its nodes are threads of one process: their epochs' stores are hosted on loopback.
        # `records`: the parse of each record and its plan's facts, shared by every
        # simulated worker (`shared_records`; none given: its own).
        self.records = records or SharedRecords(tied_layers)
        self.coordinator = SharedRecordCoordinator(store, worker, node_address="127.0.0.1", records=self.records,
                                                   connect_timeout_s=connect_timeout_s)
        if quiet_s != QUIET_S:  # its other waits on followed keys as long (`followed_wait_s`)
            self.coordinator.followed_wait_s = self.coordinator.abandon_wait_s = quiet_s
        # Over its relay in this process, its watches are tasks of the relay's loop, not
        # threads an epoch (`loop_watches`); so is the closing of its old epochs' stores.
        self._loop_store = LoopStore(store) if watches_on_loop(store) else None
        if self._loop_store is not None:
            self.coordinator.abandon_watch = self._abandon_watch
            self.coordinator.close_later = self._close_later
        self.worker, self.plane, self.observer = worker, plane, observer
        self.step_s, self.total_steps, self.backend = step_s, total_steps, backend
        self.tied_layers, self.wait_s, self._log = tied_layers, wait_s, log
        self.snapshots, self.start_s = snapshots, start_s
        self.metrics, self.quiet_s = metrics, quiet_s
        self._in_epoch: tuple[StepBarrier, int] | None = None
        """The epoch's step barrier and this worker's rank in it, while it is in one."""
        self.last_stepped, self.commit, self.holds, self.synced = -1, None, (), False
        self._last_commit: tuple[int, int, float] | None = None
        self._timing = EpochTiming(record_s=0.0)
        """This epoch's: when each of its phases ended on this worker."""
        self._step_times: collections.deque[float] = collections.deque(maxlen=9)
        self._entry = "published"
        """How it enters its next epoch (`ElasticWorker._entry`)."""
        self._entered: object | None = None
        """The plan of the last epoch it entered (the engine's plan, for a real worker)."""
        self._ahead: _Ahead | None = None
        """A join's next epoch whose groups it connects ahead (`_start_ahead`)."""

    # ------------------------------------------------------------------ loop
    def run(self) -> int:
        time.sleep(self.start_s)
        self.coordinator.announce()
        epoch, prepared = -1, None
        outside = False
        while True:
            self._entry = "stopped" if prepared else "published"  # (`ElasticWorker._run`)
            try:
                epoch, record = prepared or self.coordinator.wait_for_epoch(
                    epoch, self.wait_s, on_prepared=self._planned_in if outside else None)
            except JobEnded as end:
                return 0 if end.outcome == "ok" else 1
            self.observer.note(self.observer.held, epoch, self.worker)
            if self.worker[0] in record.leaving:
                code = self._leave(epoch, record)
                if code is not None:
                    return code
                prepared = None
                continue
            if self.worker not in self.records.facts(epoch, record.plan).rank_of_worker:
                self.coordinator.mark_ready(epoch)
                outside = True
                continue
            outside = False
            prepared = self._run_epoch(epoch, record)

    def _run_epoch(self, epoch: int, record: EpochRecord) -> tuple[int, EpochRecord] | None:
        plan = record.plan
        facts = self.records.facts(epoch, plan)
        rank = facts.rank_of_worker[self.worker]
        ahead = self._take_ahead(epoch, plan)
        barrier = self.plane.epoch(epoch, plan.world_size)
        self._in_epoch = (barrier, rank)
        if self.metrics is not None:
            self.metrics.begin(epoch)
        self._timing = EpochTiming(record_s=time.time())
        progress = self._progress if rank == 0 else None
        if self._loop_store is not None:
            watcher = LoopEpochWatcher(self.coordinator, self._loop_store, epoch, RankRelease(barrier, rank),
                                       self._log, progress=progress, connect_ahead=lambda: self._connect_ahead(epoch))
        else:
            watcher = EpochWatcher(self.coordinator, epoch, RankRelease(barrier, rank), self._log, stuck_s=0,
                                   progress=progress, connect_ahead=lambda: self._connect_ahead(epoch))
        watcher.quiet_s = self.quiet_s
        watcher.start(followed=ahead.followed if ahead is not None else None)
        stopped = finished = False
        try:
            store = self.coordinator.rendezvous_store(epoch, host=rank == 0)
            if ahead is not None:
                plan = self._agree_on_first(store, record, rank)
            else:
                replay(store, plan, rank, self.backend, self.tied_layers, facts.groups, self._connect_timeout)
            self._handoff(epoch, record)
            self._enter(plan, rank)
            if self.snapshots is not None:
                self.snapshots.begin_epoch(plan, rank)
                if ahead is None:  # (connected ahead with the epoch's groups otherwise)
                    self._connect_snapshots(epoch, plan, rank)
            self.observer.note(self.observer.bootstrapped, epoch, self.worker)
            self._mark(rendezvous_s=time.time(), transfer_s=time.time(), transfer_seconds=0.0)
            finished = self._train(epoch, plan.first_iteration, barrier, rank, watcher)
            if not finished:
                stopped = True
        except PeerGone as err:
            # A peer's death fails the step's first collective with it, before its gradients
            # are synced (the commit all-reduce comes last): a real survivor reports the
            # step incomplete.
            self.synced = False
            self._mark(failed_s=time.time(), error=error_line(err, 300))
        except (dist.DistStoreError, Released, RuntimeError) as err:
            self._mark(failed_s=time.time(), error=error_line(err, 300))
        finally:
            watcher.done.set()
            self._in_epoch = None
        # In `ElasticWorker._run_epoch`'s order: after a stop its publisher thread sends the
        # status, then reads the prepared record (not a join's: the one its groups were
        # connected for), then sends the timing.
        held = self._ahead.record if stopped and self._ahead is not None and self._ahead.epoch == epoch + 1 else None
        self.coordinator.publish_status(epoch, self._status(finished))
        prepared = held or (self.coordinator.prepared_record(epoch) if stopped else None)
        self.coordinator.publish_timing(epoch, self._timing)
        if prepared is None:
            return None
        return epoch + 1, self.records.starting_at(prepared, self.last_stepped + 1)

    def _train(self, epoch: int, first: int, barrier, rank: int, watcher: EpochWatcher) -> bool:
        """Steps until the job's last (True) or a stop the commit agreed on (False)."""
        for iteration in range(first, self.total_steps):
            began = time.monotonic()
            barrier.work(rank, iteration, self.step_s)
            self.synced = True
            stop = barrier.step(rank, iteration, watcher.requested.is_set())
            self._step_times.append(time.monotonic() - began)
            self.last_stepped, self.synced = iteration, False
            self.commit = CommitRecord(iteration, loss=LOSS, grad_norm=GRAD_NORM)
            if iteration == first:
                self._mark(first_step_s=time.time())
                if rank == 0:  # as the real worker: one word for the epoch (its request; the real
                    self.coordinator.mark_trained(epoch)  # one sends it from its publisher thread)
                self.observer.first_step(epoch)
            self._last_commit = (epoch, iteration, time.time())
            if self.snapshots is not None:
                self.snapshots.after_step(self.commit, ends_epoch=stop or iteration + 1 == self.total_steps)
            if self.metrics is not None and rank == 0:
                self.metrics.after_commit(self._last_commit[2])
            if stop and iteration + 1 < self.total_steps:
                return False
        return True

    # ----------------------------------------------------- connect ahead
    def _planned_in(self, record: EpochRecord) -> bool:
        """`ElasticWorker._planned_in`: a joiner connects a join's prepared epoch's groups
        and enters it once they are."""
        done = self._start_ahead(record.plan.epoch - 1, record)
        early = done is not None and self._connected_ahead(done, record.plan.epoch)
        if early:
            self._entry = "early"
        return early

    def _connected_ahead(self, done: threading.Event, epoch: int, poll_s: float = 0.2) -> bool:
        """`ElasticWorker._connected_ahead`: given up once the epoch is published while it is
        still short of its barrier."""
        deadline = time.monotonic() + self._connect_timeout.total_seconds()
        while not done.wait(poll_s):
            if time.monotonic() >= deadline:
                return False
            ahead = self._ahead
            if self.coordinator.published(epoch) and ahead is not None and self._give_up(ahead):
                self._log(f"epoch {epoch}: published while its groups were still connecting ahead, short of "
                          "their barrier; a rendezvous instead")
                return False
        return self._ahead is not None and self._ahead.connected

    def _give_up(self, ahead: _Ahead) -> bool:
        """`PreparedGroups.give_up_short_of_barrier`: its dropped connections fail the barrier
        for every rank already in it, as a real rank's do."""
        if not ahead.gate.give_up(ahead.done):
            return False
        plan = ahead.record.plan
        self.plane.epoch(connect_barrier(ahead.epoch), plan.world_size).fail(plan.rank_of_worker()[self.worker])
        return True

    def _connect_ahead(self, epoch: int) -> threading.Event | None:
        """`ElasticWorker._connect_ahead`, at a join's word (off the step)."""
        record = self.coordinator.prepared_record(epoch)
        if record is None:
            self._log(f"epoch {epoch}: a join's word, but no prepared record: stopping without connecting ahead")
            return None
        return self._start_ahead(epoch, record)

    def _start_ahead(self, before: int, record: EpochRecord) -> threading.Event | None:
        """`ConnectAhead.start`: the prepared epoch's bootstrap replayed on a thread."""
        facts = self.records.facts(before + 1, record.plan)
        if not record.connect_ahead or self.worker not in facts.rank_of_worker:
            return None
        epoch, rank = before + 1, facts.rank_of_worker[self.worker]
        if self._ahead is not None and self._ahead.epoch == epoch:
            return self._ahead.done
        ahead = self._ahead = _Ahead(epoch, record)

        # The barrier that ends a real connection (all-or-none: `PreparedGroups`), met in
        # the data plane: a rank that fails to connect fails it for every rank, as its
        # dropped connections fail the real one.
        barrier = self.plane.epoch(connect_barrier(epoch), record.plan.world_size)

        def connect() -> None:
            try:
                ahead.followed = self.coordinator.follow_epoch(epoch)
                store = self.coordinator.rendezvous_store(epoch, host=rank == 0, close_older=False)
                self.coordinator.epoch_store_port(epoch)
                replay_prepared(store, record.plan, rank, self.backend, self.tied_layers, facts.groups,
                                self._connect_timeout, snapshots=self._snapshot_group(record.plan))
                ahead.gate.enter()
                barrier.step(rank, 0, False, timeout_s=self.wait_s)
                ahead.connected = True
            except (Exception, Killed) as err:  # noqa: BLE001 - any failure means a rendezvous, as a real one's
                ahead.error = error_line(err, 300)
                barrier.fail(rank)
            finally:
                ahead.done.set()
        threading.Thread(target=connect, daemon=True, name=f"prepared-groups-{epoch}").start()
        return ahead.done

    def _take_ahead(self, epoch: int, plan) -> _Ahead | None:
        """`ConnectAhead.take`: the groups connected ahead it enters `epoch` over, their
        follow of the epoch's word kept for its watcher; else None."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if ahead.epoch == epoch and ahead.record.plan.rank_of_worker() == plan.rank_of_worker():
            # (said as `ConnectAhead.take` says it: which workers fell back, and why)
            if self._give_up(ahead):
                self._log(f"epoch {epoch}: its groups were still connecting at the switch, short of their "
                          "barrier, so no rank connected them; a rendezvous instead, at once")
            elif ahead.done.wait(self._connect_timeout.total_seconds()) and ahead.connected:
                return ahead
            else:
                self._log(f"epoch {epoch}: its groups could not be connected ahead "
                          f"({ahead.error or 'still connecting'}); a rendezvous instead")
        if ahead.done.is_set():
            self.coordinator.unfollow_epoch(ahead.epoch)
        return None

    @property
    def _connect_timeout(self) -> timedelta:
        """How long a group's connection waits for its peers' keys: as a real group's
        connect timeout bounds it, not the store's own 300 s, which a harness saturated
        by 8,192 simulated workers outlasted at 1,024 nodes (240 workers' connections
        failed, and the join's epoch with them). The worker's wait for an epoch."""
        return timedelta(seconds=self.wait_s)

    def _agree_on_first(self, store, record: EpochRecord, rank: int):
        """`ElasticWorker._agree_on_first`: a joiner that entered early waits for the first
        iteration, the survivors' teller (or a worker that entered from the published
        record) tells it. The plan as it was when the first iteration is the same (a
        survivor's), else one copy shared by every worker (`SharedRecords.starting_at`:
        a copy per worker derived its rank table again, 8,192 ranks for each of 8,192
        workers through one lock, and held a join at 1,024 nodes for minutes)."""
        plan = record.plan
        first = agree_on_first(store, self._entry, plan, self._entered, rank)
        return plan if first == plan.first_iteration else self.records.starting_at(record, first).plan

    def _enter(self, plan, rank: int) -> None:
        """Hold the plan's layers at the step before its first (received, or rolled forward)."""
        self._entered = plan
        first = plan.first_iteration
        if self.last_stepped != first - 1:
            self.commit = None  # received the state, not the step
        self.last_stepped, self.synced = first - 1, False
        tp_rank = plan.rank_info(rank).tp_rank
        self.holds = tuple((layer, tp_rank) for layer in plan.layers_of(rank))

    def _abandon_watch(self, epoch: int, interrupt, poll_s: float, change_wait_s: float) -> LoopAbandonWatch:
        return LoopAbandonWatch(self._loop_store, epoch, interrupt, poll_s, change_wait_s)

    def _close_later(self, stores, hosted) -> None:
        """Its old epochs' stores closed by the loop's pool of threads (`close_stores`)."""
        async def close() -> None:
            await asyncio.to_thread(close_stores, stores, hosted)
        asyncio.run_coroutine_threadsafe(close(), self._loop_store.loop)

    # ----------------------------------------------------------- leaving
    def _handoff(self, epoch: int, record: EpochRecord) -> bool:
        """A planned leave's handoff group, when this worker is in it (as a source or a
        destination): its bootstrap on the epoch's store. True when it took part."""
        handoff = [t for t in record.transfers if t.src[0] in record.leaving]
        ranks = sorted({w for t in handoff for w in (t.src, t.dst)})
        if self.worker not in ranks:
            return False
        mesh(self.coordinator.rendezvous_store(epoch), gloo_direct(HANDOFF), ranks.index(self.worker), len(ranks))
        return True

    def _snapshot_group(self, plan) -> bool:
        """`PeerSnapshots.wants_group`: an epoch of `plan` has a peer-snapshot group."""
        return self.snapshots is not None and exchanges_snapshots(self.snapshots.every, plan)

    def _connect_snapshots(self, epoch: int, plan, rank: int) -> None:
        """The epoch's peer-snapshot group (`PeerSnapshots.begin_epoch`): gloo over every
        rank, on a thread of its own that nobody waits for; one that fails (the epoch was
        given up while it connected) is left behind, as the real one is."""
        if not self._snapshot_group(plan):
            return

        def connect() -> None:
            try:
                mesh(self.coordinator.rendezvous_store(epoch), gloo_direct(PEER_SNAPSHOTS), rank, plan.world_size)
            except (dist.DistStoreError, RuntimeError):
                pass
        threading.Thread(target=connect, daemon=True, name=f"peer-snapshots-connect-{epoch}").start()

    def die(self) -> None:
        """The process died: its epoch's peers' steps fail (their connections to it closed),
        and so does the barrier of a join's connection ahead it was in."""
        if self._in_epoch is not None:
            barrier, rank = self._in_epoch
            barrier.fail(rank)
        ahead = self._ahead
        if ahead is not None and not ahead.done.is_set():
            plan = ahead.record.plan
            self.plane.epoch(connect_barrier(ahead.epoch), plan.world_size).fail(plan.rank_of_worker()[self.worker])

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
                            holds=self.holds, finished=finished,
                            snapshots=() if self.snapshots is None else self.snapshots.held())

    def _mark(self, **phases) -> None:
        """Note in this epoch's timing that phases ended (EpochTiming's fields)."""
        self._timing = replace(self._timing, **phases)

    def _progress(self) -> Progress | None:
        """As `ElasticWorker._progress`: the last committed step, and the median of the
        recent steps' times as measured (the sleep and the wait for the other ranks)."""
        times = list(self._step_times)
        if self._last_commit is None or not times:
            return None
        epoch, step, at = self._last_commit
        return Progress(epoch=epoch, step=step, time_s=at, step_s=statistics.median(times))


class SimulatedProcess:
    """A simulated worker as its agent's supervisor sees a process (`subprocess.Popen`'s
    poll, wait, send_signal, kill, returncode): a thread whose death is its node's
    client cut off."""

    def __init__(self, worker: SimulatedWorker, cut: Callable[[], None], name: str):
        self.returncode: int | None = None
        self._cut, self._worker = cut, worker
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
        self._worker.die()
        self._close_stores()
