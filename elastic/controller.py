"""The control plane's decisions: epochs, plans, and the exactly-once rule (docs/recovery.md).

The controller is the leader's brain, apart from how it learns who is alive: a caller
(the local launcher, or the etcd agent that leads) calls `poll(alive, kill)` with a
function that returns the workers whose processes are alive now, and the controller
reads and writes the job's store (keys in `planaria.runtime.contract.keys`, records in
`planaria.runtime.contract`). On a change it runs the reconfiguration:

1. Detect: a worker of the current plan is gone, a worker reported that its epoch
   failed (a collective error or timeout), two nodes of the plan report that they
   cannot reach each other (a partition: `planaria.elastic.reachability`), a new
   worker is alive and reaches every node of the plan (it joins: the current epoch is
   asked to stop at the next iteration boundary), or a node of the plan was told it
   will be preempted and its deadline is near (it leaves: the epoch stops at the next
   boundary, as for a join, and the node hands over the layers only it holds; docs/spot.md).
2. Wait for the status of every live worker of the epoch; a worker that does not
   report within `status_timeout_s` is hung: it is killed and counted as failed.
   Simultaneous failures are handled together without a fixed debounce: a worker that
   dies before it reports is no longer waited for, and one that dies after it reported
   is dropped when the statuses are in (so the plan never counts on it).
3. Decide: the exactly-once rule over the statuses (`resolve`), then the planner's
   plan for the largest group of surviving nodes that all reach each other (the
   others wait until they do), preferring the one that moves the least layer state,
   then the transfers from the workers of that group that hold each layer.
4. Publish the record of epoch e+1, then move `epoch` to e+1: workers only ever see a
   complete record. A record over etcd's request limit fails the job before anything
   of it is written (`record_limits`; over half the limit, a warning first).

A failure during a reconfiguration is one more failure: the epoch that was being
entered ends the same way, and its statuses say what each worker holds.

The controller keeps the loop (`poll`) and the life cycle of an epoch: its start, its
stop, the statuses, the exactly-once rule and the publication. What it decides along the
way has a module of its own in `planaria.elastic`: the next epoch's plan and its layers'
sources (`epoch_planning`), a planned leave and its prepared epoch (`leave_planning`), a
split network (`reachability`), layers held only by nodes out of reach (`cut_wait`), the
nodes that wait as spares (`spare_nodes`), the job's
checkpoints and where a lost layer comes back from (`job_checkpoints`), the history of
published epochs that fencing is decided from (`epoch_history`), an epoch record against
etcd's request limit (`record_limits`), and how a controller stops (`controller_errors`).
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from planaria.elastic.controller_errors import CutHoldsState, Interrupted, JobFailed, StaleLeader
from planaria.elastic.cut_wait import LIMIT_S as CUT_WAIT_S, CutWait, may_hold
from planaria.elastic.epoch_history import EpochHistory
from planaria.elastic.epoch_planning import EpochPlanner
from planaria.elastic.job_checkpoints import CheckpointPolicy, JobCheckpoints
from planaria.elastic.leave_planning import PlannedLeaves
from planaria.elastic.node_wait import LIMIT_S as NODE_WAIT_S, NodeWait
from planaria.elastic.reachability import Partitions, isolated
from planaria.elastic.record_limits import RecordLimit
from planaria.elastic.spare_nodes import Spares
from planaria.runtime.contract import keys
from planaria.runtime.contract.checkpoint_layout import read_checkpoint_manifest
from planaria.runtime.contract.deadline import ReachableDeadline
from planaria.runtime.contract.epochs import EpochEvent, EpochRecord
from planaria.runtime.contract.exactly_once import InconsistentStatuses, Resolution, WorkerStatus, resolve
from planaria.runtime.contract.keys import worker_key
from planaria.runtime.contract.membership import LeaveNotice
from planaria.runtime.contract.store_reads import (FAST_POLL_S, derived, follow, generation, read_present, unfollow,
                                                  wait_for_change)
from planaria.templates.plan import Plan, Worker
from planaria.templates.planner import Planner

if TYPE_CHECKING:
    import torch.distributed as dist

STATUS_GATHER_S = 0.01
"""After a status came, how long the leader lets the next ones come before it looks
again (`Controller._collect_statuses`)."""


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Controller:
    """Epoch decisions over a job's store (module docstring)."""

    def __init__(self, store: dist.Store, planner: Planner, *, total_steps: int,
                 gpus_per_node: int = 1, status_timeout_s: float = 30.0, debounce_s: float = 0.0,
                 max_epochs_without_progress: int = 5, log: Callable[[str], None] = print,
                 checkpoints: CheckpointPolicy | None = None,
                 interrupted: Callable[[], bool] = lambda: False,
                 leading: Callable[[], bool] = lambda: True, node: str | None = None,
                 unreachable: Callable[[], Mapping[str, Iterable[str]]] = dict,
                 notices: Callable[[], Mapping[str, LeaveNotice]] = dict, leave_overhead_s: float = 3.0,
                 max_nodes: int | None = None, wait_for_nodes_s: float = NODE_WAIT_S,
                 gone: Callable[[], set[str]] = set, cut_wait_s: float = CUT_WAIT_S):
        self.store = store
        self.node_wait = NodeWait(store, wait_for_nodes_s, log)
        """Below one replica's nodes the job waits for nodes this long (`node_wait`)."""
        self.cut_wait = CutWait(cut_wait_s, log)
        """Layers held only by nodes out of reach are waited for this long (`cut_wait`)."""
        self.gone = gone
        """The nodes a probe finds dead now (their agent refused its connection): never waited for."""
        self._found_gone: set[str] = set()
        """Nodes found gone and not back since (`poll`)."""
        self.spares = Spares(store, max_nodes, log)
        """`max_nodes`: the most nodes a plan uses (torchrun's `--nnodes MIN:MAX`); None:
        every node. Live nodes beyond it, and those no plan uses, wait as spares."""
        self.leaves = PlannedLeaves(store, notices, leave_overhead_s, log)
        """`notices`: {node: its preemption notice}; such a node is planned out at a step
        boundary, if `leave_overhead_s` and two steps fit before its deadline."""
        self.partitions = Partitions(unreachable, node, log)
        """`unreachable`: {node: the nodes it reports it cannot reach}; `node`: the
        leader's own (it wins a tie between two sides of a partition)."""
        self.checkpoints = JobCheckpoints(store, checkpoints, total_steps, log)
        self.history = EpochHistory(store, log)
        self.record_limit = RecordLimit(store, log)
        self.epoch_planner = EpochPlanner(planner, self.spares, self.checkpoints, self.history, log)
        self.leading = leading
        """Asked before this controller acts on what it saw (publishes an epoch, has a
        worker killed): False when it lost its leadership meanwhile (its node was cut off
        long enough for its lease to lapse), and it steps down (`StaleLeader`) instead."""
        self.interrupted = interrupted
        """Asked while waiting for statuses: True makes this controller step down at once
        (`Interrupted`) rather than at the end of the wait (the status timeout: minutes)."""
        self.planner = planner
        self.gpus_per_node = gpus_per_node
        self.status_timeout_s = status_timeout_s
        self.debounce_s = debounce_s
        """A pause before the statuses are asked for (0: none; see the module docstring)."""
        self.max_stalled = max_epochs_without_progress
        self.log = log
        self.epoch = -1
        self.plan: Plan | None = None
        self.events: list[EpochEvent] = []
        self.outcome: str | None = None
        self._stalled = 0
        self._join_deferred = -1  # the epoch whose join wait was logged
        self._killed: set[Worker] = set()
        self._followed: int | None = None
        self._members_of, self._members_now = None, frozenset()
        self._mirrored = False
        """The epoch whose keys are followed (`_follow_epoch`)."""
        self._parse_statuses = ParsedStatuses()
        self._sources: set[Worker] = set()
        """The leaving workers the epoch in force receives layers from (`EpochRecord.leaving`):
        one gone without its word that its copies landed fails the epoch (`_lost_sources`)."""

    # ------------------------------------------------------------- start
    def start(self, workers: list[Worker], plan: Plan | None = None) -> Plan:
        """Publish epoch 0: `plan`, or the planner's plan for the workers' nodes.

        With checkpoints on and a complete one in the checkpoint directory, the job goes
        on from the newest (as a plain torchrun job does): the same command run again
        after the whole job was lost resumes instead of starting over. A checkpoint of
        another model ends the job with a message instead."""
        nodes = self.spares.cap(self._whole_nodes(set(workers)), self.plan.nodes() if self.plan is not None else [])
        if plan is None:
            plan = self.planner.instantiate(len(nodes), node_ids=nodes).plan
        # Nodes the plan leaves out (no set of pipelines uses them all) wait, as idle nodes
        # of later epochs do, rather than join at once.
        idle = sorted(set(nodes) - set(plan.nodes()))
        if idle:
            self.spares.idle_at_start(idle, len(plan.nodes()), len(nodes))
        found = self.checkpoints.on_disk()
        if not found:
            self._publish_first(EpochRecord(plan))
            return plan
        iteration, path = found[-1]
        manifest = read_checkpoint_manifest(path)
        if (manifest.num_layers, manifest.tp) != (plan.num_layers, plan.tp):
            self._end(f"{keys.JOB_FAILED}the checkpoint {path} is of a model of {manifest.num_layers} layers "
                      f"at tp={manifest.tp}, this job's has {plan.num_layers} at tp={plan.tp}; "
                      "give this job its own checkpoint.dir (or output.dir)")
            self.log(f"controller: {self.outcome}")
            return plan
        plan = replace(plan, first_iteration=iteration + 1)
        self.checkpoints.completed = [k for k, _ in found]
        self.log(f"controller: resuming from the checkpoint of iteration {iteration} ({path})")
        self._publish_first(EpochRecord(plan, restore=str(path)))
        return plan

    def _publish_first(self, record: EpochRecord) -> None:
        """Publish epoch 0, or end the job when its record cannot be (over etcd's limit)."""
        try:
            self._publish(record)
        except JobFailed as err:
            self.log(f"controller: the job cannot start: {err}")
            self._end(f"{keys.JOB_FAILED}{err}")

    def resume(self) -> bool:
        """Take over a running job (a new leader): the newest published epoch and its plan
        from the store. False when no epoch was published yet; `StaleLeader` when another
        leader moved the job on meanwhile."""
        epoch = int(self.store.get(keys.EPOCH)) if self.store.check([keys.EPOCH]) else -1
        if self.store.check([keys.epoch_record(epoch + 1)]):
            # The last leader wrote the next epoch's record and died before moving `epoch`
            # to it: finish its publication (the record is whole: one key, one write).
            self.log(f"controller: epoch {epoch + 1} was written but not published; publishing it")
            self._advance(epoch, epoch + 1)
            epoch += 1
        if epoch < 0:
            return False
        record = EpochRecord.from_json(self.store.get(keys.epoch_record(epoch)))
        self.epoch, self.plan = epoch, record.plan
        self._follow_epoch(epoch)
        self._sources = {t.src for t in record.transfers if t.src[0] in record.leaving}
        # Checkpoints an earlier leader completed (and pruned): not to be completed again.
        self.checkpoints.completed = [i for i, _ in self.checkpoints.on_disk()]
        if self.store.check([keys.DONE]):
            self.outcome = self.store.get(keys.DONE).decode()
        self.node_wait.resume()
        self.log(f"controller: resumed at epoch {epoch}")
        return True

    # -------------------------------------------------------------- poll
    def poll(self, alive_now: Callable[[], set[Worker]], kill: Callable[[Worker], None]) -> str:
        """Look at the job once: "running", "finished", or "failed" (see `outcome`).
        `alive_now()`: the workers alive at this moment (asked again while waiting)."""
        if self.outcome is not None:
            return "finished" if self.outcome == keys.JOB_OK else "failed"
        self._complete_checkpoints()
        alive = alive_now() - self._killed
        self.spares.keep_alive({node for node, _ in alive})
        # Found dead once, dead until it is back: a probe forgets a node soon after its
        # lease lapses (its address goes with it), and a wait may outlast that.
        self._found_gone = (self._found_gone | self.gone()) - {node for node, _ in alive}
        members = self._members()
        gone = (members - alive) | self._lost_sources(alive)
        statuses = self._statuses(members)
        if len(statuses) == len(members) and all(s.finished for s in statuses.values()):
            self._end(keys.JOB_OK)
            return "finished"
        views = self.partitions.unreachable()
        notices = self.leaves.notices()
        planned = self.plan.nodes()
        leaving = self.leaves.leaving(planned, notices)
        waiting = self.history.out_of_their_epochs({w for w in alive - members if w[0] not in notices}, self.epoch)
        joiners = self.spares.if_full(self.partitions.reachable_joiners(
            set(self._whole_nodes(waiting)) - self.spares.nodes, planned, views), planned)
        failed_report = (any(not s.finished for s in statuses.values())
                         or self.partitions.cut(planned, self.epoch, views))
        if joiners and not (gone or failed_report or leaving) and not self._epoch_trained():
            # A join waits until the epoch in force has committed a step: under churn,
            # joins that each restart the epoch would otherwise keep it from training.
            if self._join_deferred != self.epoch:
                self._join_deferred = self.epoch
                self.log(f"controller: {sorted(joiners)} ready to join; waiting for epoch "
                         f"{self.epoch}'s first committed step")
            return "running"
        if gone or failed_report or joiners or leaving:
            reason = keys.FAILURE if gone or failed_report else keys.LEAVE if leaving else keys.JOIN
            try:
                self._reconfigure(alive_now, kill, reason)
            except JobFailed as err:
                self.log(f"controller: the job cannot go on: {err}")
                self._end(f"{keys.JOB_FAILED}{err}")
                return "failed"
        return "running"

    def _lost_sources(self, alive: set[Worker]) -> set[Worker]:
        """Leaving workers of this epoch gone before they said their copies landed: the
        workers receiving from them would wait for them until their collective timeout."""
        if not self._sources or self._epoch_trained():
            return set()
        return {w for w in self._sources
                if w not in alive and not self.store.check([keys.epoch_handed_off(self.epoch, w)])}

    # ------------------------------------------------------- reconfigure
    def _reconfigure(self, alive_now: Callable[[], set[Worker]], kill: Callable[[Worker], None],
                     reason: str) -> None:
        # (Tried again at each poll while the job waits for nodes: detected at the first.)
        detected = (self.node_wait.detected if self.node_wait.since is not None
                    else self.cut_wait.detected if self.cut_wait.since is not None else time.time())
        waiting = self.node_wait.since is not None or self.cut_wait.since is not None
        members = self._members()
        if reason in (keys.LEAVE, keys.JOIN):
            self._prepare_next(alive_now, connect_ahead=reason == keys.JOIN)
        # A failure: every survivor releases the epoch's collectives at once; a join or a
        # leave: all stop at the next iteration boundary. Either way the epoch's rendezvous
        # is abandoned if it is still going on (a peer died before joining it). (Once: the
        # job waiting for nodes tries again at every poll, and each write is a watch event
        # for every node.)
        if not waiting or not self.store.check([keys.epoch_reconfigure(self.epoch)]):
            self.store.set(keys.epoch_reconfigure(self.epoch), reason)
        if self.debounce_s:
            time.sleep(self.debounce_s)
        statuses = self._collect_statuses(members, alive_now, kill, released=reason == keys.FAILURE,
                                          joining=self._connecting_ahead(reason, members))
        # One that died after it reported (a second failure a moment after the first) is
        # failed too: its status is of no use to a plan that would count on it.
        still = alive_now() - self._killed
        statuses = {w: s for w, s in statuses.items() if w in still}
        statuses_s = time.time()
        self._check_leading()
        survivors = set(statuses)
        notices = self.leaves.notices()
        newcomers = alive_now() - members - self._killed
        # (a noticed node is never planned in; its workers need not be ready to be told so)
        joiners = self.history.out_of_their_epochs({w for w in newcomers if w[0] not in notices}, self.epoch) | {
            w for w in newcomers if w[0] in notices}
        if not statuses:
            raise JobFailed("every worker of the job failed before reporting a status; see the "
                            "workers' logs, then restart the job (from its last checkpoint)")
        # A worker that holds no layer (a joiner whose entry into the epoch failed) knows
        # nothing of the job's progress: it takes part in the next plan as a joiner does,
        # but neither in the exactly-once rule nor as a source of layers.
        stateful = {w: s for w, s in statuses.items() if s.holds}
        try:
            resolution = (resolve(list(stateful.values())) if stateful
                          else Resolution(self.plan.first_iteration, None))
        except InconsistentStatuses as err:
            raise JobFailed(str(err)) from None
        first = resolution.first_iteration
        prepared = self.leaves.prepared(self.epoch)
        # Workers that stopped at the step boundary may be in the prepared epoch already.
        if prepared is not None and self._publish_prepared(prepared, statuses, resolution, members, alive_now,
                                                           reason, detected, statuses_s):
            return
        # (Or it could not go on, and it was published as failed: the next one is planned
        # from these statuses the usual way.)
        # Nodes with a notice are planned out, whatever the reason for this epoch: they
        # hand over the layers only they hold, if their deadline leaves the time to.
        leaving = self.leaves.handing_over(statuses, notices)
        nodes, cut_off = self._plannable_nodes(survivors | joiners, notices)
        if cut_off and len(nodes) < self.planner.n0:
            self.partitions.wait_out(cut_off, f"the largest group of nodes that all reach each other, "
                                              f"{nodes}, is too small for one replica of the model")
            return
        if len(nodes) < self.planner.n0:
            if self.node_wait.wait(len(nodes), self.planner.n0, detected):
                return  # tried again at the next poll, the failed epoch's statuses standing
            told = sorted(set(notices) & {w[0] for w in survivors | joiners})
            raise JobFailed(f"{len(nodes)} node(s) left, but one replica of the model needs "
                            f"n0={self.planner.n0}"
                            f"{f' ({told} were told they will be gone: a preemption notice or SIGTERM)' if told else ''}"
                            f", and no node came within {self.node_wait.limit_s:g} s (--join-timeout); "
                            "add nodes and restart from the last checkpoint")
        self._check_progress(first, nodes)
        # Sources of layer state: what the workers of the group hold, live or in their
        # peer snapshots (a stateless worker may keep snapshots); no copy crosses a cut.
        holders = {w: s for w, s in statuses.items() if w[0] in nodes or w in leaving}
        # (Out of reach: across a partition, or cut off from every node: `_isolated_workers`.
        # A worker killed as silent is no holder.)
        out_of_reach = may_hold(self.plan, members - self._killed, statuses, nodes,
                                set(cut_off) | {w[0] for w in self._isolated_workers(members)}, still,
                                self._found_gone | self.gone())
        planned = self._plan_from(nodes, holders, first, leaving, cut_off, out_of_reach, detected)
        if planned is None:
            return  # waiting for nodes out of reach: tried again at the next poll
        choice, transfers, restore, snapshot, first = planned
        cut_wait_s = self.cut_wait.over()
        self.node_wait.over()
        plan = choice.plan
        restoring = restore is not None or snapshot is not None
        roll = None if restoring else resolution.roll_forward  # a restore loads everything
        planned_s = time.time()
        left = tuple(sorted(set(notices) & {w[0] for w in survivors | joiners}))
        self._publish(EpochRecord(plan, roll_forward=roll, transfers=tuple(transfers),
                                  restore=None if restore is None else str(restore), snapshot=snapshot,
                                  leaving=left))
        self._sources = {t.src for t in transfers if t.src in leaving}
        event = EpochEvent(
            epoch=plan.epoch, reason=reason, detected_s=detected, statuses_s=statuses_s,
            planned_s=planned_s, published_s=time.time(),
            failed=tuple(sorted(worker_key(w) for w in members - survivors)),
            joined=tuple(sorted(worker_key(w) for w in joiners if w[0] in plan.nodes())),
            first_iteration=first, rolled_forward=None if roll is None else roll.iteration,
            transfers=len(transfers), restored=None if restore is None else first - 1,
            snapshot=None if snapshot is None else snapshot.step, rerun=resolution.first_iteration - first,
            moved_bytes=choice.moved_bytes, plan_shape=tuple(len(p.stages) for p in plan.pipelines),
            cut_off=tuple(cut_off), left=left, handed_off=sum(t.src in leaving for t in transfers),
            cut_wait_s=cut_wait_s)
        self._account(event)

    def _plan_from(self, nodes: list[str], holders: dict[Worker, WorkerStatus], first: int, leaving: set[Worker],
                   cut_off: list[str], out_of_reach: dict[Worker, set], detected: float):
        """The epoch planner's plan and sources, or None while the job waits for nodes out
        of reach: the holders of layers nobody reachable has (`cut_wait`), or a partition's
        other side when this side cannot train alone (`Partitions.wait_out`)."""
        try:
            try:
                return self.epoch_planner.plan(nodes, holders, first, self.plan, leaving,
                                               out_of_reach if self.cut_wait.limit_s > 0 else None)
            except CutHoldsState as cut:
                if self.cut_wait.wait(cut.missing, cut.holders, cut.back_to, cut.first, detected):
                    return None
                return self.epoch_planner.plan(nodes, holders, first, self.plan, leaving)
        except JobFailed as err:
            if not cut_off:
                raise
            self.partitions.wait_out(cut_off, f"{nodes} cannot train on their own ({err})")
            return None

    def _account(self, event: EpochEvent, note: str = "") -> None:
        """Keep, publish and log a published epoch's account."""
        self.events.append(event)
        # For reports (the chaos harness reads them from the store, wherever the leader ran);
        # created only if absent, as the record is: the first account of the epoch stands.
        self.store.compare_set(keys.epoch_event(event.epoch), "", event.to_json())
        self.log(f"controller: epoch {event.epoch} ({event.reason}; failed {list(event.failed) or '-'}, joined "
                 f"{list(event.joined) or '-'}{f'; cut off {list(event.cut_off)}' if event.cut_off else ''}"
                 f"{f'; left {list(event.left)}' if event.left else ''}): pipelines of {list(event.plan_shape)} "
                 f"stages from iteration {event.first_iteration}"
                 f"{f', rolling forward {event.rolled_forward}' if event.rolled_forward is not None else ''}"
                 f"{f', restored from the checkpoint of {event.restored}' if event.restored is not None else ''}"
                 f"{f', restored from the peer snapshots of {event.snapshot}' if event.snapshot is not None else ''}"
                 f", {event.transfers} layer transfers"
                 f"{f' ({event.handed_off} from the leaving nodes)' if event.handed_off else ''}{note}")

    def _plannable_nodes(self, workers: set[Worker], notices: Mapping[str, LeaveNotice]):
        """(the nodes the next plan may use, the nodes cut off): of the whole nodes of
        `workers` told of no leave, the largest group that all reach each other, at most
        `max_nodes` of them (the others wait as spares)."""
        nodes, cut_off = self.partitions.largest_group([n for n in self._whole_nodes(workers) if n not in notices])
        return self.spares.cap(nodes, self.plan.nodes()), cut_off

    def _prepare_next(self, alive_now: Callable[[], set[Worker]], connect_ahead: bool = False) -> None:
        """Plan a leave's or a join's next epoch while the epoch in force still trains, and
        write it as prepared (`PlannedLeaves.prepare`) before the stop is asked for: a
        worker that stops at the agreed step boundary enters it at once, instead of
        waiting for every status, this plan and its publication (30-40 ms of the pause
        with four workers on two cores; with many workers, that many more statuses to
        wait for). Nothing is prepared when the statuses could change the plan: a worker
        gone, a node cut off. A join's (`connect_ahead`) has its groups connected by its
        workers before they stop (`EpochRecord.connect_ahead`): its statuses come that
        much later, the job training meanwhile."""
        members = self._members()
        alive = alive_now() - self._killed
        if members - alive:
            return
        try:
            notices = self.leaves.notices()
            joiners = self.history.out_of_their_epochs({w for w in alive - members if w[0] not in notices},
                                                       self.epoch)
            nodes, cut_off = self._plannable_nodes(members | joiners, notices)
            if cut_off or len(nodes) < self.planner.n0:
                return
            choice = self.epoch_planner.instantiate(nodes, max(1, self.plan.first_iteration), self.plan)
            self.leaves.prepare(self.epoch, self.plan, choice, notices, connect_ahead)
        except ValueError:  # no plan now: the usual way says why, after the statuses
            return

    def _publish_prepared(self, prepared: EpochRecord, statuses: dict[Worker, WorkerStatus], resolution: Resolution,
                          members: set[Worker], alive_now: Callable[[], set[Worker]], reason: str,
                          detected: float, statuses_s: float) -> bool:
        """Publish the prepared epoch: workers that stopped at the step boundary entered it
        already, from the step after it. True when it goes on.

        False when the statuses do not bear it out (`PlannedLeaves.confirm`), or when two of
        its nodes cannot reach each other (a partition during the stop): no step can
        be committed in it then, so it is declared failed before its record is published
        (the record still is, for the workers that may be in it to see that it failed),
        and the caller plans the next one from these statuses, as if it had never been
        prepared: the leaving nodes' layers among them, which a plan made from the failed
        epoch's own statuses would no longer count on. It gets no event: nobody trained in it."""
        record, sound = self.leaves.confirm(prepared, self.plan, statuses, resolution,
                                            lambda: alive_now() - self._killed)
        plan, first = record.plan, resolution.first_iteration
        newcomers = set(plan.rank_of_worker()) - members
        if not sound or self.partitions.cut(plan.nodes(), plan.epoch, self.partitions.unreachable()):
            self.store.set(keys.epoch_reconfigure(plan.epoch), keys.FAILURE)
            self._publish(record)
            self.log(f"controller: epoch {plan.epoch}, prepared for the leave of {list(record.leaving)}, cannot go "
                     f"on (a worker it needs failed during the stop, is cut off, or holds other layers than "
                     f"planned); "
                     f"ended at once, and epoch {plan.epoch + 1} planned from the statuses of epoch {plan.epoch - 1}")
            return False
        self._publish(record)
        self._sources = {t.src for t in record.transfers if t.src[0] in record.leaving}
        failed = tuple(sorted(worker_key(w) for w in members - set(statuses)))
        event = EpochEvent(
            epoch=plan.epoch, reason=reason, detected_s=detected, statuses_s=statuses_s, planned_s=statuses_s,
            published_s=time.time(), failed=failed,
            joined=tuple(sorted(worker_key(w) for w in newcomers)), first_iteration=first,
            rolled_forward=None if resolution.roll_forward is None else resolution.roll_forward.iteration,
            transfers=len(record.transfers), moved_bytes=self.leaves.prepared_moves,
            plan_shape=tuple(len(p.stages) for p in plan.pipelines), left=record.leaving,
            handed_off=sum(t.src[0] in record.leaving for t in record.transfers))
        self._account(event, "; planned before the stop, while the epoch trained")
        return True

    def _complete_checkpoints(self) -> None:
        """Write the manifests of the checkpoints now complete (`JobCheckpoints.complete`)."""
        if self.plan is not None:
            self.checkpoints.complete(self.plan, lambda step: self.history.committing_epoch(step, self.plan))

    def _connecting_ahead(self, reason: str, members: set[Worker]) -> set[Worker]:
        """The joiners of a join whose next epoch's groups connect before the stop
        (`EpochRecord.connect_ahead`): the survivors' statuses wait for that."""
        prepared = self.leaves.prepared(self.epoch) if reason == keys.JOIN else None
        if prepared is None or not prepared.connect_ahead:
            return set()
        return set(prepared.plan.rank_of_worker()) - members

    def _collect_statuses(self, members: set[Worker], alive_now: Callable[[], set[Worker]],
                          kill: Callable[[Worker], None], released: bool,
                          joining: set[Worker] = frozenset()) -> dict[Worker, WorkerStatus]:
        """Statuses of the epoch's live workers (one that dies meanwhile is no longer
        waited for, nor is one on a node cut off from every other: it cannot be heard
        from until the cut heals); the ones that stay silent are killed. A worker lost while a join
        stops the epoch turns the join into a failure: the survivors blocked on it are
        released rather than left to their collective timeout. A joiner (`joining`) lost
        while the next epoch's groups connect ahead gives that epoch up at once: the
        survivors, waiting for it in their connection, stop then instead of at its
        timeout, and the epoch is planned again without it (`_publish_prepared`)."""
        deadline = ReachableDeadline(self.status_timeout_s)  # an etcd outage is no silence
        while True:
            since = generation(self.store)
            # A node every other node of the epoch reports cut off cannot be heard from
            # until the cut heals, whatever its lease says: counted out as a node a probe
            # found gone is (its peers cannot commit a step without it either), and waited
            # for, if it holds what nobody else does, by `cut_wait`.
            live = members & (alive_now() - self._killed)
            waited = live - self._isolated_workers(members)
            # A peer gone, or cut off, while the epoch stops at a step boundary: that step
            # never ends (its collectives wait on the peer), so the stop becomes a failure.
            if not released and (live != members or self._cut()):
                self.store.set(keys.epoch_reconfigure(self.epoch), keys.FAILURE)
                released = True
            if joining and not joining <= alive_now() - self._killed:
                self.log(f"controller: {sorted(worker_key(w) for w in joining - alive_now())} gone while the "
                         f"groups of epoch {self.epoch + 1} connected; given up")
                self.store.set(keys.epoch_reconfigure(self.epoch + 1), keys.FAILURE)
                joining = set()
            statuses = self._statuses(live)
            if set(statuses) >= waited or deadline.expired():
                break
            if self.interrupted():
                raise Interrupted("the leader's node is leaving; the next leader takes the "
                                  f"reconfiguration to epoch {self.epoch + 1} over")
            # The statuses come at the next step boundary, then within milliseconds of
            # each other: once the first is in, the rest are polled for every 2 ms.
            # (Over etcd the statuses are followed: the wait ends at the next one.)
            changed = wait_for_change(self.store, since, 0.25 if self._mirrored else FAST_POLL_S if statuses else 0.02)
            if changed:
                # Woken by one status, with the rest due within milliseconds: gathered for a
                # moment, so that the statuses of thousands of workers are looked at in tens
                # of looks rather than one look per status (each look is O(workers)).
                time.sleep(STATUS_GATHER_S)
        silent = waited - set(statuses)
        if silent:
            self._check_leading()
        for worker in sorted(silent):
            self.log(f"controller: worker {worker_key(worker)} did not report within "
                     f"{self.status_timeout_s:.0f} s; killing it")
            kill(worker)
            self._killed.add(worker)
        return statuses

    def _isolated_workers(self, members: frozenset[Worker]) -> set[Worker]:
        """The workers of `members` on nodes cut off from every other node of the epoch
        (none when every node is: then nobody would be heard from)."""
        nodes = self.plan.nodes()
        alone = isolated(nodes, self.partitions.unreachable())
        return set() if len(alone) == len(nodes) else {w for w in members if w[0] in alone}

    def _cut(self) -> bool:
        """Two nodes of the epoch in force cannot reach each other (`Partitions.cut`)."""
        return self.partitions.cut(self.plan.nodes(), self.epoch, self.partitions.unreachable())

    def _check_leading(self) -> None:
        if not self.leading():
            raise StaleLeader(f"this controller lost its leadership during the reconfiguration to epoch "
                              f"{self.epoch + 1}; it steps down without acting on what it saw")

    def _statuses(self, workers: set[Worker]) -> dict[Worker, WorkerStatus]:
        """The statuses of `workers` in this epoch: parsed once per change of the epoch's
        statuses where the store mirrors them (the leader looks ten times a second; at
        thousands of workers a parse of all at every look took it most of a core)."""
        every = derived(self.store, keys.epoch_statuses(self.epoch), self._parse_statuses)
        if every is not None:
            return {w: status for w, status in every.items() if w in workers}
        wanted = {w: keys.epoch_status(self.epoch, w) for w in workers}
        found = read_present(self.store, keys.epoch_statuses(self.epoch), wanted)
        return {w: WorkerStatus.from_json(value) for w, value in found.items()}

    def _members(self) -> frozenset[Worker]:
        """The workers of the plan in force (made once per plan, not at every look)."""
        if self._members_of is not self.plan:
            self._members_of, self._members_now = self.plan, frozenset(self.plan.rank_of_worker())
        return self._members_now

    def _check_progress(self, first_iteration: int, nodes: list[str]) -> None:
        """Fail the job after `max_stalled` reconfigurations in a row that made no progress
        on the same nodes: the same plan failing again and again is a fault of the job
        (a crash at one step, a bad node), which retrying will not cure. Churn is not:
        when nodes came or went, the next plan differs, and the job waits it out (joins
        are deferred until an epoch commits a step, so churn cannot keep it from training)."""
        if first_iteration > self.plan.first_iteration:
            self._stalled = 0
        elif set(nodes) - self.spares.nodes == {s.node for p in self.plan.pipelines for s in p.stages}:
            self._stalled += 1
        if self._stalled >= self.max_stalled:
            raise JobFailed(f"{self._stalled} reconfigurations in a row on the same nodes without a "
                            f"committed step (stuck at iteration {first_iteration}); see the workers' logs")

    def _epoch_trained(self) -> bool:
        return bool(self.store.check([keys.epoch_trained(self.epoch)]))

    def _whole_nodes(self, workers: set[Worker]) -> list[str]:
        """Nodes all of whose workers are in `workers` (a stage needs the whole node)."""
        by_node: dict[str, set[int]] = {}
        for node, local in workers:
            by_node.setdefault(node, set()).add(local)
        return sorted(n for n, locals_ in by_node.items()
                      if locals_ >= set(range(self.gpus_per_node)))

    def _publish(self, record: EpochRecord) -> None:
        """Publish the next epoch: its record, created only if no leader created one (a
        compare-and-set on the absent key), then `epoch` moved to it from the epoch this
        controller knows (a second compare-and-set). A leader that lost its leadership
        without knowing it can thus neither overwrite its successor's record nor move
        the job to an epoch of its own; it steps down (`StaleLeader`). A record that etcd
        would refuse for its size fails the job (`JobFailed`) before either is written."""
        epoch, text = record.plan.epoch, record.to_json()
        self.record_limit.check(keys.epoch_record(epoch), record, text)
        written = _text(self.store.compare_set(keys.epoch_record(epoch), "", text))
        if written != text:
            raise StaleLeader(f"epoch {epoch} was published by another leader; this one steps down")
        self._advance(self.epoch, epoch)
        self.plan = record.plan

    def _advance(self, known: int, epoch: int) -> None:
        """Move the job's `epoch` from `known` (-1: none yet) to `epoch`, or step down."""
        expected = "" if known < 0 else str(known)
        now = _text(self.store.compare_set(keys.EPOCH, expected, str(epoch)))
        if now != str(epoch):
            raise StaleLeader(f"the job's epoch is {now!r}, not {expected!r} as this controller "
                              f"believed; another leader took over, so this one steps down")
        self.epoch = epoch
        self._follow_epoch(epoch)

    def _follow_epoch(self, epoch: int) -> None:
        """Mirror the epoch in force's statuses and its first step (over etcd: a watch, so
        that the polls of `poll` and `_collect_statuses` read them without a request, and
        a status wakes the wait for the others at once), and no longer the last one's."""
        if self._followed is not None:
            unfollow(self.store, keys.epoch_statuses(self._followed))
            unfollow(self.store, keys.epoch_trained(self._followed))
        self._mirrored = follow(self.store, keys.epoch_statuses(epoch), prefix=True)
        follow(self.store, keys.epoch_trained(epoch))
        self._followed = epoch

    def _end(self, outcome: str) -> None:
        self.outcome = outcome
        self.store.set(keys.DONE, outcome)


class ParsedStatuses:
    """{worker: status} of an epoch's status keys ("epoch/<e>/status/<node>.<local>"),
    each value parsed once: a look after one more status came parses that one, not the
    thousands already in (a full parse per status was quadratic in the workers: minutes
    of the leader's CPU at 2,048 workers)."""

    def __init__(self):
        self._parsed: dict[str, tuple[bytes, Worker, WorkerStatus]] = {}

    def __call__(self, found: dict[str, bytes]) -> dict[Worker, WorkerStatus]:
        parsed = {}
        for key, value in found.items():
            known = self._parsed.get(key)
            if known is None or (known[0] is not value and known[0] != value):
                known = (value, keys.parse_worker_key(key.rpartition("/")[2]), WorkerStatus.from_json(value))
            parsed[key] = known
        self._parsed = parsed
        return {worker: status for _, worker, status in parsed.values()}
