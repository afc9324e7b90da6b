"""A training worker that survives the failure of others: the epoch loop (docs/recovery.md).

`python -m planaria.train CONFIG [overrides]` runs this loop when its environment names
a control plane (`PLANARIA_STORE=host:port` of a TCPStore or `etcd://host:port/prefix`,
`PLANARIA_NODE`, `PLANARIA_LOCAL_RANK`),
as `planaria.elastic`'s launchers and the tests' harness start workers. Per epoch:

1. wait for the epoch's record (plan, roll-forward, transfers); a worker not in the
   plan waits for the next one;
2. join the epoch's process group through the epoch's rendezvous store (over etcd, a
   TCPStore that the plan's rank 0 hosts for the epoch: `planaria.runtime.worker.epoch_store`);
3. first epoch: build the engine; later epochs: roll forward if the record says so;
   then `Engine.enter_epoch`, with the record's transfers, peer snapshot or checkpoint (a worker
   joining a running job receives its layers like any other);
4. train from the plan's first iteration; the commit all-reduce also carries "the
   control plane asked to stop here" (a node joins), so all stop after the same step,
   and whether the peer snapshots' exchange is still going on; after each step, a peer
   snapshot when one is due (`planaria.runtime.state.peer_snapshots`: a record may restore
   from them in step 3 when a layer lost every replica);
5. at the end, save the final parameters and report "finished", then wait: the job is
   over only when the control plane says so (a late failure may still need this
   worker's layers).

A collective that fails (a peer's sockets closed: gloo reports it within about a
second) or times out (`comm.timeout_s`) ends the epoch on this worker: it tears
its process groups down at once, which closes its own sockets so that peers blocked on
it fail too, then publishes its status (`planaria.runtime.contract.exactly_once`) and goes back
to 1. Every committed step is appended to OUTPUT_DIR/commits-<node>.<local>.jsonl
(`planaria.runtime.contract.logs` holds the logs' records). With `logging.tensorboard`,
the plan's rank 0 of each epoch also writes the steps to the run's TensorBoard
directory, each exactly once across epochs and writers (`planaria.runtime.worker.metrics_writer`).
"""
from __future__ import annotations

import collections
import contextlib
import gc
import logging
import os
import statistics
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, astuple, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.markup import escape

from planaria.runtime.config.sections import Config, connect_timeout_s, job_store_timeout_s, status_timeout_s
from planaria.runtime.contract import env
from planaria.runtime.contract.epochs import EpochRecord, EpochTiming, Progress
from planaria.runtime.contract.exits import EXIT_TORN_STEP
from planaria.runtime.contract.heartbeat import start_beating
from planaria.runtime.contract.logs import (AUDIT, COMMITS, EVALS, AuditEntry, CommitEntry, EvalEntry, append, error_line,
                                           log_path)
from planaria.runtime.data.token_datasets import dataset_for
from planaria.runtime.models.llama import compiled_graphs
from planaria.runtime.parallel.engine import Engine, StepResult, TornStep
from planaria.runtime.parallel.groups import GroupRetirement, forget_failed_world, set_operation_timeout
from planaria.runtime.parallel.loop import Call, Evaluation, Every, run_steps
from planaria.runtime.parallel.release import epoch_release, group_options
from planaria.runtime.parallel.warm_up import warm_up
from planaria.runtime.state.audit import audit_replicas
from planaria.runtime.state.checkpoints import AsyncCheckpointer, snapshot_layer
from planaria.runtime.state.layer_sources import FromCheckpoint, FromReplicas, FromSnapshots
from planaria.runtime.state.peer_snapshots import PeerSnapshots
from planaria.runtime.state.saved_model import save_model_shards
from planaria.runtime.state.transfer import Handoff, SnapshotSource, TransferStats
from planaria.runtime.worker.build import build_engine
from planaria.runtime.worker.connect_ahead import ConnectAhead, agree_on_first
from planaria.runtime.worker.coordination import JobEnded, StoreCoordinator, connect_store, store_ports
from planaria.runtime.worker.epoch_metrics import EpochMetrics
from planaria.runtime.worker.epoch_watcher import EpochWatcher
from planaria.runtime.worker.fault_injection import FaultInjector, corruption_after_step, flip_a_bit, writes_late
from planaria.runtime.worker.leaving import leave
from planaria.runtime.worker.progress_watch import ProgressWatch



class _StopRequested(Exception):
    """The commit agreed to stop after this step (the control plane wants a new epoch)."""


def elastic_environment() -> tuple[str, str, int] | None:
    """(store address, node, local rank) when this process was started by a Planaria
    control plane, else None."""
    return env.elastic_worker(os.environ)


class ElasticWorker:
    """One worker's epochs (module docstring)."""

    def __init__(self, cfg: Config, coordinator: StoreCoordinator, console: Console,
                 device: torch.device, backend: str, keep_ports: frozenset[int] = frozenset(),
                 progress: ProgressWatch | None = None):
        """`keep_ports`: the control plane's store endpoints, whose connections a release
        of an epoch's collectives leaves open. `progress`: marked by the engine's phases
        and each step's end, for the agent's stuck check (its heartbeat carries it)."""
        self.cfg = cfg
        self.progress = progress
        self.keep_ports = keep_ports
        self.coordinator = coordinator
        self.worker = coordinator.worker
        self.name = f"{self.worker[0]}.{self.worker[1]}"
        self.console = console
        self.device, self.backend = device, backend
        self.dataset = dataset_for(cfg)
        self.val_dataset = dataset_for(cfg, "val") if cfg.eval.every else None
        self.faults = FaultInjector.from_env(self.name)
        self.corrupt_after = corruption_after_step(self.name)
        self.late_writer = writes_late(self.name)
        self.engine: Engine | None = None
        self._entry = "published"
        """How this worker enters its next epoch (`_run`'s loop says)."""
        self._trained_in: int | None = None
        """The last epoch this worker trained in: the one that committed a step it rolls
        forward (a later epoch may have failed before anyone trained in it)."""
        self._timing = EpochTiming(record_s=0.0)
        """This epoch's: when each of its phases ended on this worker."""
        self._step_times: collections.deque[float] = collections.deque(maxlen=9)
        self._last_commit: tuple[int, int, float] | None = None
        self.out_dir = Path(cfg.output.dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.commits = open(log_path(self.out_dir, COMMITS, self.name), "a", encoding="utf-8")
        self.evals = open(log_path(self.out_dir, EVALS, self.name), "a", encoding="utf-8") if cfg.eval.every else None
        self.checkpointer = AsyncCheckpointer(cfg.checkpoint_dir, cfg.checkpoint.every,
                                              coordinator.report_checkpoint, data_source=cfg.data.source)
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="status")
        """Publishes the status of a stop at a step boundary while the epoch is torn down."""
        self._unsent: Future | None = None
        """A stop's status still on its way as this worker entered a join's epoch."""
        self._retired = GroupRetirement()
        """Destroys each ended epoch's groups on a thread (`_leave_epoch`)."""
        self.ahead = ConnectAhead(coordinator, backend, device, self._connect_timeout_s(), release=cfg.comm.release,
                                  keep_ports=keep_ports, log=self._log)
        """A join's next epoch's groups, connected while the epoch before it trains."""
        self.snapshots = PeerSnapshots(cfg.checkpoint.memory_every, cfg.checkpoint.memory_copies,
                                       timeout_s=cfg.comm.timeout_s, connect_timeout_s=self._connect_timeout_s(),
                                       log=self._log)
        self.metrics = EpochMetrics(cfg, coordinator.store, device, self.out_dir, self._log)

    # ------------------------------------------------------------------ loop
    def run(self) -> int:
        try:
            return self._run()
        finally:  # a past epoch's groups go before the interpreter does
            self._retired.wait(timeout_s=30)

    def _run(self) -> int:
        if self.faults is not None:  # a start-up made slow on purpose (chaos: a GPU worker's)
            self.faults("start", 0)
        # What the process holds before any epoch (torch and the other imports, the
        # dataset: some 300,000 objects) lives as long as it does. Frozen out of the cyclic
        # collector, it is not scanned again by the collection that ends every epoch
        # (`_leave_epoch`), which took 0.3 to 1.4 s of every reconfiguration's pause
        # with it (measured on 2 cores, four workers). Nothing built later is frozen: a
        # layer dropped in a later epoch is collected as before.
        gc.collect()
        gc.freeze()
        # Announced once its start-up is over: a joiner is planned in only then
        # (`EpochHistory.out_of_their_epochs`), the job training meanwhile; its first look
        # finds the epoch in force, which it is not in (`keys.ready`), then the join's.
        self.coordinator.announce()
        epoch = -1
        wait_s = 4 * self.cfg.comm.timeout_s + 60
        prepared: tuple[int, EpochRecord] | None = None
        outside = False  # in no plan: a joiner (or a spare) connects ahead when planned in
        while True:
            # How this worker enters the epoch (`_agree_on_first`): from its stop at the step
            # boundary ("stopped"), from the prepared record as a joiner ("early", set by
            # `_planned_in`), or from the published record.
            self._entry = "stopped" if prepared else "published"
            try:
                epoch, record = prepared or self.coordinator.wait_for_epoch(
                    epoch, wait_s, on_prepared=self._planned_in if outside else None)
            except JobEnded as end:
                self._log(f"job ended: {end.outcome}")
                self.metrics.close()
                return 0 if end.outcome == "ok" else 1
            if self.worker[0] in record.leaving:
                code = self._leave(epoch, record)
                if code is not None:
                    return code
                prepared = None
                continue
            if self.worker not in record.plan.rank_of_worker():
                self._log(f"epoch {epoch}: not in the plan, waiting")
                self.coordinator.mark_ready(epoch)  # out of any epoch: it can be planned in
                outside = True
                continue
            outside = False
            try:
                prepared = self._run_epoch(epoch, record)
            except TornStep as err:
                # No status: the control plane sees a worker gone, as if its node failed,
                # and has its layers copied from their replicas (or a checkpoint).
                self._log(f"epoch {epoch}: leaving the job: {err}")
                return EXIT_TORN_STEP

    def _planned_in(self, record: EpochRecord) -> bool:
        """A join's next epoch, prepared while this worker waits outside the plan: its
        engine built now if it is new (its layers come at the epoch's start), and the
        epoch's groups connected ahead if it is in the plan (`ConnectAhead`). True when
        they connected: it enters the epoch at once, and waits in it for the survivors,
        whose stop came once every rank had connected (`_agree_on_first`)."""
        if not record.connect_ahead or self.worker not in record.plan.rank_of_worker():
            return False
        if self.engine is not None and self.engine.last_stepped is not None:
            # Layers of an epoch before the one in force, which committed steps without
            # this worker (a join waits for one): it joins as a new worker, its old state
            # never used (the prepared plan counts only on the epoch in force's holders).
            self._log(f"epoch {record.plan.epoch}: planned in; this worker's layers are of step "
                      f"{self.engine.last_stepped}, behind the job's: it was left out; joining as a new worker")
            self.engine.destroy()
            self.engine = None
        if self.engine is None:
            self.engine = self._new_engine()
            self._warm_up(record.plan)
        # Its data's shuffle at about where the job is (the prepared plan's first iteration,
        # a few steps behind the stop's): made now, not in the join's first step.
        self.dataset.prepare(record.plan.first_iteration, record.plan.global_batch, self.cfg.data.seed)
        if self.faults is not None:  # (chaos: a joiner lost, or slow, as it connects)
            self.faults("connect", 0)
        done = self.ahead.start(record.plan.epoch - 1, record, self.engine.tied_layers,
                                snapshot_group=self.snapshots.group_maker(record.plan))
        early = done is not None and self._connected_ahead(done, record.plan.epoch)
        if early:
            self._entry = "early"
        return early

    def _connected_ahead(self, done: threading.Event, epoch: int, poll_s: float = 0.2) -> bool:
        """A joiner's wait for its connection ahead to `epoch` (`done`), within the connect
        timeout. The epoch published while it is still short of its barrier means the
        survivors stopped without it (their stop comes after a connection that ended,
        and none can have passed the barrier without this rank): it is given up then,
        and the joiner meets them in the epoch's rendezvous, not its connect timeout later."""
        deadline = time.monotonic() + self._connect_timeout_s()
        while not done.wait(poll_s):
            if time.monotonic() >= deadline:
                return False
            if self.coordinator.published(epoch) and self.ahead.give_up(epoch):
                self._log(f"epoch {epoch}: published while its groups were still connecting ahead, short of "
                          "their barrier; a rendezvous instead")
                return False
        return self.ahead.connected(epoch)

    def _warm_up(self, plan) -> None:
        """A new worker's cold start, taken before it connects: the job trains meanwhile,
        and the join's first step is not its first (`warm_up`)."""
        try:
            # Its connection, and so the survivors' (up to their connect timeout), waits
            # for it: its later iterations only within a quarter of that.
            seconds = warm_up(self.engine.model, self.engine.optim, self.engine.settings, plan,
                              plan.rank_of_worker()[self.worker], budget_s=self._connect_timeout_s() / 4)
        except Exception as err:  # noqa: BLE001 - (out of memory, say): best effort, the first step will tell
            self._log(f"epoch {plan.epoch}: the warm-up failed ({error_line(err)}); joining cold")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return
        if seconds is not None:
            self._log(f"epoch {plan.epoch}: warmed up its stage's computation in {seconds:.2f} s")

    def _agree_on_first(self, epoch: int, plan, rank: int, record: EpochRecord) -> tuple[object, EpochRecord]:
        """In an epoch entered over groups connected ahead: its first iteration, the
        survivors' (the step after the stop they agreed on), told by the lowest-ranked
        of them (`teller`) to the joiners, which entered from the prepared record before
        the stop (`tell_first`). A worker that entered from the published record, whose
        first iteration is the controller's, tells it too (the same value)."""
        first = agree_on_first(self.coordinator.rendezvous_store(epoch), self._entry, plan,
                               None if self.engine is None else self.engine.plan, rank)
        if first == plan.first_iteration:
            return plan, record
        plan = replace(plan, first_iteration=first)
        return plan, replace(record, plan=plan)

    def _connect_ahead(self, epoch: int):
        """At a join's word for `epoch` (the epoch watcher's thread): connect the prepared
        next epoch's groups; the event its stop waits for, or None."""
        record = self.coordinator.prepared_record(epoch)
        if record is None:
            # (The controller prepares none when the statuses could change the plan: then
            # every survivor stops without; one that reads none while the others find it
            # makes them wait their connect timeout at the switch. Said, to tell which.)
            self._log(f"epoch {epoch}: a join's word, but no prepared record: stopping without connecting ahead")
        if record is None or self.engine is None:
            return None
        return self.ahead.start(epoch, record, self.engine.tied_layers, current_release=self._watcher.release,
                                snapshot_group=self.snapshots.group_maker(record.plan))

    def _leave(self, epoch: int, record: EpochRecord) -> int | None:
        """This node leaves with notice (`leaving.leave`): the exit code, or None when the
        control plane gave the epoch up and this worker waits for the next one."""
        # The receivers first build the new epoch's groups and make its other copies (a
        # joiner builds its layers): a leaving worker waits for them as long as the leader
        # waits for a status. Its deadline bounds the wait: its agent stops it there.
        handoff = self._handoff(epoch, record, timeout_s=status_timeout_s(self.cfg.comm))
        return leave(self.engine, handoff, epoch, record, me=self.worker, coordinator=self.coordinator,
                     checkpointer=self.checkpointer, steps=self.cfg.train.steps, log=self._log)

    def _handoff(self, epoch: int, record: EpochRecord, timeout_s: float | None = None) -> Handoff | None:
        """The record's transfers from leaving workers, when this worker takes part."""
        handoff = Handoff.of(record.transfers, record.leaving, self.coordinator.rendezvous_store(epoch),
                             self.backend, timedelta(seconds=timeout_s or self.cfg.comm.timeout_s))
        return handoff if handoff is not None and self.worker in handoff.participants() else None

    def _run_epoch(self, epoch: int, record: EpochRecord) -> tuple[int, EpochRecord] | None:
        """Train `epoch` until it ends; the next epoch and its record when the controller
        prepared it before it asked this one to stop (a planned leave), else None."""
        plan = record.plan
        rank = plan.rank_of_worker()[self.worker]
        self._timing = EpochTiming(record_s=time.time())
        finished = False
        early_status: Future | None = None
        next_record: Future | None = None
        held: EpochRecord | None = None
        if self._left_out(record):
            # The job went on without this worker (it was cut off, and declared failed): the
            # plan counts on none of its layers, which are of an older step. It joins as a
            # new worker would, and its old state is never used, nor reported: dropped
            # before anything of the epoch can fail, so that its status says it holds
            # nothing (a stale one would contradict the steps committed without it).
            self._log(f"epoch {epoch}: this worker's layers are of step {self.engine.last_stepped}, "
                      f"the job is at {plan.first_iteration}: it was left out; joining as a new worker")
            self.engine.destroy()
            self.engine = None
        ahead = self.ahead.take(epoch, plan)
        # Made before the epoch's first group: it releases what the epoch opens (groups
        # connected ahead: made before they were).
        release = (ahead.release if ahead is not None
                   else epoch_release(self.backend, self.keep_ports) if self.cfg.comm.release else None)
        self._watcher = EpochWatcher(self.coordinator, epoch, release, self._log,
                                      stuck_s=self.cfg.comm.release_stuck_s,
                                      progress=self._progress if rank == 0 else None,
                                      connect_ahead=lambda: self._connect_ahead(epoch))
        self._watcher.start(followed=ahead.followed if ahead is not None else None)
        try:
            if ahead is not None:
                self._log(f"epoch {epoch}: its groups{' and its peer-snapshot group' if ahead.snapshots else ''} "
                          f"were connected ahead ({ahead.seconds:.2f} s, while the epoch before trained)")
            dist.init_process_group(ahead.install() if ahead is not None else self.backend,
                                    store=self.coordinator.rendezvous_store(epoch, host=rank == 0),
                                    rank=rank, world_size=plan.world_size, timeout=timedelta(seconds=self._connect_timeout_s()),
                                    pg_options=None if ahead is not None else group_options(self.backend))
            set_operation_timeout(None, timedelta(seconds=self.cfg.comm.timeout_s))
            if ahead is not None:
                plan, record = self._agree_on_first(epoch, plan, rank, record)
            self._mark(rendezvous_s=time.time())
            moved = self._enter_epoch(plan, rank, record)
            if self.engine.agreed_s is not None:
                # Every rank was in the epoch once they agreed on its first iteration: the
                # copy is timed from there, as a rendezvous lines the ranks up (without it, a
                # worker's copy counted its wait for the last worker's teardown).
                self._mark(rendezvous_s=self.engine.agreed_s)
            self.snapshots.begin_epoch(self.engine, epoch, self.coordinator.rendezvous_store(epoch),
                                       connected=ahead.snapshots if ahead is not None else None)
            self._mark(transfer_s=time.time())
            if moved is not None:
                self._mark(bytes_received=moved.bytes_received, bytes_sent=moved.bytes_sent,
                           transfer_seconds=moved.seconds)
            self._log(f"epoch {epoch}: rank {rank} of {plan.world_size}, layers "
                      f"{self.engine.held_layers()}, from iteration {plan.first_iteration}")
            self._trained_in = epoch
            self._train(epoch, plan.first_iteration)
            self.checkpointer.flush()
            self.metrics.flush(wait_s=30.0)  # the last steps, before the job can be declared over
            save_model_shards(self.engine, self.out_dir / "final", data_source=self.cfg.data.source)
            finished = True
        except _StopRequested:
            self._log(f"epoch {epoch}: stopping after iteration {self.engine.last_stepped} "
                      "as the control plane asked")
            # A stop at a step boundary that every worker agreed on: no peer waits on this
            # worker's sockets, and nothing the teardown does changes what it holds. Its
            # status goes at once, from a thread of its own (a store round trip), so that
            # the controller plans the next epoch while the groups close (about 0.1 s of
            # the pause at a planned leave or a join); it is out before the epoch is left.
            status = self._status(finished)
            early_status = self._publisher.submit(self.coordinator.publish_status, epoch, status)
            # A leave's or a join's next epoch was prepared before the stop was asked for:
            # it spares the wait for every status and the plan. A join's record is the one
            # its groups were connected for; a leave's is read while the groups close.
            held = self.ahead.prepared_record(epoch + 1)
            next_record = None if held else self._publisher.submit(self.coordinator.prepared_record, epoch)
        except TornStep:
            raise  # past the status below: this worker's state must not be used
        except (RuntimeError, TimeoutError) as err:  # dist errors are RuntimeErrors
            self._mark(failed_s=time.time(),
                       error=error_line(err, 300))
            self._log(f"epoch {epoch} failed on this worker: {self._timing.error}")
            if self.late_writer and self.engine is not None and self.engine.last_commit is not None:
                self._write_late(epoch)  # (a worker that has committed nothing has nothing to write)
        finally:
            if self.progress is not None:  # a failed step, a teardown, the wait for an epoch: no stalls
                self.progress.disarm()
            self._leave_epoch(stopped=early_status is not None)
            self._watcher.done.set()
            if release is not None and release.released:
                self.ahead.drop()  # its connections were shut down with the epoch's
        self._check_sent()
        if held is not None:
            # Going on to a join's epoch over groups connected ahead, which needs nothing
            # of the controller: the status goes on its way meanwhile (its round trip to
            # etcd was part of the join's pause), checked before this worker's next one.
            self._unsent = early_status
        elif early_status is not None:
            early_status.result()  # (raises what the publication raised)
        else:
            self.coordinator.publish_status(epoch, self._status(finished))
        # For reports: after what the controller waits for (the same thread, in order).
        self._publisher.submit(self.coordinator.publish_timing, epoch, self._timing)
        prepared = held
        if next_record is not None:
            try:
                prepared = next_record.result()
            except Exception as err:  # the store is away: the record is waited for as after any epoch
                self._log(f"epoch {epoch}: the next epoch's prepared record could not be read ({err})")
        if prepared is None:
            return None
        # Every worker stopped after the same step (the commit agreed on it), this one's last.
        first = self.engine.last_stepped + 1
        self._log(f"epoch {epoch}: going on to epoch {epoch + 1}, prepared by the controller before the stop, "
                  f"from iteration {first}")
        return epoch + 1, replace(prepared, plan=replace(prepared.plan, first_iteration=first))

    def _mark_trained(self, epoch: int, at: float) -> None:
        """`StoreCoordinator.mark_trained`, off the step, with the time the step committed
        (what the publisher sends first can hold it up). Not written (etcd away), the
        controller defers a join and a leaving worker lingers until its bound, as when
        rank 0 dies before it: said, not raised."""
        try:
            self.coordinator.mark_trained(epoch, at)
        except Exception as err:  # noqa: BLE001 - a word for the controller; training goes on
            self._log(f"epoch {epoch}: could not say that it trained ({error_line(err)})")

    def _check_sent(self) -> None:
        """The status of the last stop, sent while this worker went on into a join's
        epoch (`_unsent`): raises what its publication raised, as it would have then."""
        unsent, self._unsent = self._unsent, None
        if unsent is not None:
            unsent.result()

    def _write_late(self, epoch: int) -> None:
        """The fencing test's late writer (`writes_late`): this worker's layers, of its last
        step, written and reported as epoch `epoch`'s shards of the next checkpoint."""
        every = self.cfg.checkpoint.every
        if not every:
            return
        iteration = ((self.engine.last_stepped + 1) // every + 1) * every - 1
        shards = {(layer, self.engine.tp.rank): snapshot_layer(self.engine.shard(layer))
                  for layer in self.engine.held_layers()}
        self.checkpointer.write_now(iteration, epoch, shards, self.engine.last_commit, self.engine)
        self._log(f"epoch {epoch}: wrote its layers of step {self.engine.last_stepped} as checkpoint "
                  f"{iteration}'s, late (PLANARIA_LATE_WRITER)")

    def _left_out(self, record: EpochRecord) -> bool:
        """True when this worker's layers are of a step the job has left behind: neither
        the plan's previous step nor one behind it that the record rolls forward."""
        stepped = None if self.engine is None else self.engine.last_stepped
        if stepped is None or record.restore is not None or record.snapshot is not None:
            return False  # a restore replaces every layer
        rolled = record.roll_forward is not None and record.roll_forward.iteration == stepped + 1
        return stepped + 1 + int(rolled) != record.plan.first_iteration

    def _mark(self, **phases) -> None:
        """Note in this epoch's timing that phases ended (EpochTiming's fields)."""
        self._timing = replace(self._timing, **phases)

    def _enter_epoch(self, plan, rank: int, record: EpochRecord) -> TransferStats | None:
        """Enter the record's epoch (rolled forward first when it says so); what the
        layers' source moved between workers, if anything."""
        transfers = [t for t in record.transfers if t.src[0] not in record.leaving]
        if record.restore is not None:
            self._log(f"epoch {plan.epoch}: restoring from checkpoint {record.restore}")
        if self.engine is None:
            # A worker new to the job (its start, or a join) holds nothing: it builds its
            # layers, receives them or loads them, in the same epoch as every other worker.
            with self._watcher.local_work():
                self.engine = self._new_engine()
        elif (record.restore is None and record.roll_forward is not None and self.engine.last_stepped is not None
              and self.engine.roll_forward(record.roll_forward)):  # (a joiner's, built ahead: nothing to roll)
            committed_in = plan.epoch - 1 if self._trained_in is None else self._trained_in
            self._record_commit(record.roll_forward, committed_in, rolled_forward=True)
            self.checkpointer.after_step(self.engine, committed_in)
        if record.restore is not None:
            layers = FromCheckpoint(Path(record.restore))
        elif record.snapshot is not None:
            self._log(f"epoch {plan.epoch}: restoring from the peer snapshots of step {record.snapshot.step}")
            layers = FromSnapshots(SnapshotSource(record.snapshot.commit, self.snapshots.shards_of(record.snapshot)),
                                   transfers)
        else:
            layers = FromReplicas(transfers, self._handoff(plan.epoch, record))
        self.engine.enter_epoch(plan, rank, layers=layers)
        return layers.stats

    def _train(self, epoch: int, first: int) -> None:
        self._steps(epoch, first, self._watcher.requested.is_set)

    def _steps(self, epoch: int, first: int, request) -> None:
        evaluation = Evaluation(self.val_dataset, self.cfg.data.seed, self.cfg.eval.batches, self.cfg.eval.due,
                                report=lambda step, val_loss: self._record_eval(step, val_loss, epoch))
        # A failure during the evaluation after step first-1 (committed) lost it: every
        # worker of the epoch evaluates it again, from the same parameters, the same value.
        if first > 0 and self.cfg.eval.due(first - 1, self.cfg.train.steps):
            evaluation.run(self.engine, first - 1)
        # After that evaluation: it may be written now.
        write_metrics = self.metrics.component(epoch, self.engine.plan, self.engine.rank,
                                               committed_at=lambda: self._last_commit[2])

        def first_step(engine: Engine, ctx) -> None:
            if self._timing.first_step_s is None:
                self._mark(first_step_s=time.time())
                self._retired.go()  # the epoch before's groups (`_leave_epoch`), now
                # Every rank committed it: one word says so (not a write per worker), on
                # the publisher's thread, after what it still sends of the epoch before.
                # Written from the step's path, its round trip to etcd held rank 0's next
                # step, and every rank's with it (60 ms of a join's pause on 2 cores).
                if engine.rank == 0:
                    self._publisher.submit(self._mark_trained, epoch, self._timing.first_step_s)

        # The commit is logged before the evaluation: a failure during it never hides a
        # committed step from the logs.
        if self.progress is not None:
            self.progress.epoch_started()
        # The step's end first: what follows it (checkpoints, evaluations) is not watched.
        components = [*([] if self.progress is None else [Call(lambda engine, ctx: self.progress.step_done(
                          ctx.result.step_time_s))]),
                      Call(first_step), Call(lambda engine, ctx: self._record_commit(ctx.result, epoch)),
                      Call(lambda engine, ctx: self.checkpointer.after_step(engine, epoch)),
                      Call(lambda engine, ctx: self.snapshots.after_step(
                          engine, ctx.result.busy, ctx.last or ctx.result.stop_requested)),
                      evaluation, *([] if write_metrics is None else [Call(write_metrics)]),
                      Call(self._corrupt), Every(self.cfg.audit.every, self._audit)]
        if not run_steps(self.engine, self.dataset, self.cfg.data.seed, first, self.cfg.train.steps, components,
                         request=request, busy=self.snapshots.busy):
            raise _StopRequested()

    def _corrupt(self, engine: Engine, ctx) -> None:
        """The injected corruption of a test (PLANARIA_CORRUPT), after its step."""
        if self.corrupt_after == ctx.step:
            layer = engine.held_layers()[0]
            flip_a_bit(next(engine.shard(layer).module.parameters()))
            self._log(f"injected corruption: flipped a bit of layer {layer} after step {ctx.step}")

    def _audit(self, engine: Engine, step: int) -> None:
        """The replica audit (collective): mismatches printed and in audit-<worker>.jsonl."""
        for mismatch in audit_replicas(engine, repair=self.cfg.audit.repair):
            self.console.print(f"[bold red]replica audit after step {step}:[/] {escape(mismatch.describe())}")
            with open(log_path(self.out_dir, AUDIT, self.name), "a", encoding="utf-8") as f:
                append(f, AuditEntry(step=step, **asdict(mismatch)))

    def _leave_epoch(self, stopped: bool = False) -> None:
        """Tear this epoch's groups down: they leave torch's registry now, and their
        destructors run on a thread at once (`GroupRetirement`: 50-90 ms of every
        reconfiguration's pause, off the path to the status and the next epoch). Closing
        our sockets there, in parallel, still makes peers blocked on us fail within
        milliseconds instead of at their timeout. `stopped`: at a step boundary all agreed
        on (a peer snapshot exchange under way goes on: `PeerSnapshots.end_epoch`); nobody
        waits on the groups then, and their destructors wait for the next epoch's first
        step (`GroupRetirement.go`), not to take the CPU from every worker's entry."""
        held = GroupRetirement.hold()
        if self.engine is not None:
            self.engine.abandon_epoch()
        self.metrics.end_epoch()
        held += self.snapshots.end_epoch(stopped)  # its exchange ends; its group goes with the epoch's
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group may refuse; it is dropped all the same
                pass
        forget_failed_world()
        if not stopped:
            # After a failure, at once: what the epoch's objects still hold of its groups
            # goes now, and peers blocked on this worker see its connections close. After
            # a stop at a step boundary nobody waits on them: the retirement's thread
            # collects, off the path into the next epoch.
            gc.collect()
        self._retired.retire(held, collect=stopped, deferred=stopped)
        if self.device.type == "cuda":
            # After an abort NCCL's kernels have returned: wait for every stream, so that no
            # work of the old epoch runs on into the next, then give the old groups' and
            # the interrupted iteration's buffers back to the device.
            with contextlib.suppress(RuntimeError):
                torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # --------------------------------------------------------------- helpers
    def _status(self, finished: bool):
        from planaria.runtime.contract.exactly_once import INCOMPLETE, WorkerStatus

        if self.engine is None or self.engine.last_stepped is None:  # (built, never in an epoch)
            status = WorkerStatus(worker=self.worker, last_stepped=-1, state=INCOMPLETE, finished=finished)
        else:
            status = self.engine.status(self.worker, finished=finished)
        return replace(status, snapshots=self.snapshots.held())

    def _progress(self) -> Progress | None:
        """The last committed step and the median of the recent step times (read by the
        epoch watcher's thread: one tuple, replaced whole by the main thread)."""
        if self._last_commit is None or not self._step_times:
            return None
        epoch, step, at = self._last_commit
        return Progress(epoch=epoch, step=step, time_s=at, step_s=statistics.median(self._step_times))

    def _record_commit(self, result, epoch: int, rolled_forward: bool = False) -> None:
        if isinstance(result, StepResult):
            self._step_times.append(result.step_time_s)
        self._last_commit = (epoch, result.iteration, time.time())
        append(self.commits, CommitEntry(
            step=result.iteration, loss=result.loss, grad_norm=result.grad_norm, epoch=epoch,
            time=time.time(), rolled_forward=rolled_forward,
            step_time_s=result.step_time_s if isinstance(result, StepResult) else None,
            compiled_graphs=compiled_graphs() if self.cfg.train.compile else None))
        if self.worker[1] == 0 and (result.iteration % self.cfg.train.log_every == 0
                                    or result.iteration == self.cfg.train.steps - 1):
            self._log(f"step {result.iteration + 1}/{self.cfg.train.steps} | loss {result.loss:.4f}"
                      f"{' (rolled forward)' if rolled_forward else ''}")

    def _record_eval(self, step: int, val_loss: float, epoch: int) -> None:
        append(self.evals, EvalEntry(step=step, val_loss=val_loss, epoch=epoch, time=time.time()))
        if self.worker[1] == 0:
            self._log(f"step {step + 1}/{self.cfg.train.steps} | validation loss {val_loss:.4f}")

    def _new_engine(self) -> Engine:
        """An engine holding nothing yet, for this worker's next epoch."""
        phase = _chained(None if self.progress is None else self.progress.mark, self.faults)
        # Per-layer hooks only for fault injection: the progress watch needs the step's phases alone.
        return build_engine(self.cfg, self.device, phase=phase, connect_timeout_s=self._connect_timeout_s(),
                            layer_phases=self.faults is not None)

    def _connect_timeout_s(self) -> float:
        """An epoch's process groups connect within this: a peer that died after the
        rendezvous (a fault during a recovery) fails the epoch in seconds, not minutes."""
        return connect_timeout_s(self.cfg.comm)

    def _log(self, message: str) -> None:
        self.console.print(f"[{self.name}] {message}", markup=False)


def _die_with_parent() -> None:
    """SIGKILL this worker when its agent dies (Linux PR_SET_PDEATHSIG): a worker without
    its agent would run on unseen by the control plane. Done here rather than in the
    agent's preexec_fn, which is unsafe in a process with threads."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the agent died before we asked
        os._exit(1)


def _chained(*hooks):
    """One phase callback that calls each of `hooks` (those not None), or None."""
    hooks = [hook for hook in hooks if hook is not None]
    if len(hooks) <= 1:
        return hooks[0] if hooks else None

    def call(name: str, iteration: int) -> None:
        for hook in hooks:
            hook(name, iteration)
    return call


def run_elastic(cfg: Config, console: Console, device: torch.device, backend: str) -> int:
    address, node, local_rank = elastic_environment()
    if os.environ.get(env.DIE_WITH_AGENT) == "1":
        _die_with_parent()
    # The agent's watch on frozen workers (contract/heartbeat.py) and on stuck ones (progress_watch.py).
    progress = (ProgressWatch(cfg.comm.stuck_factor, cfg.comm.stuck_floor_s) if cfg.comm.stuck_floor_s else None)
    heartbeat = start_beating(progress=None if progress is None else lambda: astuple(progress.stall()))
    if not os.environ.get(env.DEBUG):
        # A failed peer makes torch's schedule runtime log its whole action table as an
        # error; here that is the expected start of a recovery, which the worker reports
        # in one line. PLANARIA_DEBUG=1 keeps torch's dump.
        logging.getLogger("torch.distributed.pipelining.schedules").setLevel(logging.CRITICAL)
    # The control plane's warnings (etcd away, back) on this worker's lines, like its own.
    logging.basicConfig(format=f"[{node}.{local_rank}] %(message)s", level=logging.WARNING)
    store = connect_store(address, timeout_s=job_store_timeout_s(cfg.comm))
    # (its node's address, where it hosts an epoch's bootstrap store: env.NODE_ADDRESS, read when first needed)
    coordinator = StoreCoordinator(store, (node, local_rank), connect_timeout_s=connect_timeout_s(cfg.comm))
    if backend == "nccl":  # read by torch as each NCCL group is made
        for warning in env.nccl_recovery(os.environ, cfg.comm.timeout_s):
            console.print(f"[{node}.{local_rank}] warning: {warning}", markup=False)
    code = ElasticWorker(cfg, coordinator, console, device, backend,
                         keep_ports=frozenset(store_ports(address)), progress=progress).run()
    if heartbeat is not None:  # the job is over: leaving takes the interpreter's shutdown
        heartbeat.stop()
    return code
