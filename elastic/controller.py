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
   complete record.

A failure during a reconfiguration is one more failure: the epoch that was being
entered ends the same way, and its statuses say what each worker holds.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from planaria.elastic.reachability import cut_pairs, reachable_group, reaches_all

from planaria.runtime.contract import keys
from planaria.runtime.contract.checkpoint_layout import (complete_checkpoints, epoch_dir, missing_shards, prune,
                                                         read_checkpoint_manifest, step_dir, write_manifest)
from planaria.runtime.contract.deadline import ReachableDeadline
from planaria.runtime.contract.epochs import EpochEvent, EpochRecord, Progress
from planaria.runtime.contract.exactly_once import (CommitRecord, InconsistentStatuses, Resolution, SnapshotHeld,
                                                    WorkerStatus, resolve)
from planaria.runtime.contract.keys import worker_key
from planaria.runtime.contract.membership import LeaveNotice
from planaria.runtime.contract.store_reads import FAST_POLL_S, read_if_present, read_present
from planaria.templates.plan import Plan, Worker, missing_from, transfers_from
from planaria.templates.planner import Planner

if TYPE_CHECKING:
    import torch.distributed as dist


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class StepDown(RuntimeError):
    """This controller stops leading; whatever it had not published is redone by the
    next leader (nothing it publishes is half-done: see `_publish`)."""


class StaleLeader(StepDown):
    """Another controller published an epoch this one did not know of."""


class Interrupted(StepDown):
    """The leader's node is going away (its agent got a signal) in the middle of a wait."""


class JobFailed(RuntimeError):
    """The job cannot go on; the message says why and what would fix it."""


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where the job's periodic checkpoints go and how often (the `checkpoint` config)."""

    directory: Path
    every: int
    keep: int = 2


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
                 max_nodes: int | None = None):
        self.store = store
        self.max_nodes = max_nodes
        """The most nodes a plan uses (torchrun's `--nnodes MIN:MAX`); None: every node.
        Live nodes beyond it wait as spares, their workers started, and take a failed
        node's place at the next failure without a cold start (`_cap`)."""
        self.notices = notices
        """{node: its preemption notice} (`planaria.elastic.preemption`, posted by its
        agent): such a node is planned out at the next step boundary, and hands over the
        layers only it holds before it goes (`_leaving`)."""
        self.leave_overhead_s = leave_overhead_s
        """What a planned leave takes beyond two steps (the boundary, then the step that
        may be under way when the notice is seen): statuses, plan, rendezvous and the
        copies. A notice with less time left goes down the failure path."""
        self.node = node
        """The leader's own node (it wins a tie between two sides of a partition)."""
        self.unreachable = unreachable
        """{node: the nodes it reports it cannot reach} (`planaria.elastic.peer_probe`);
        the default, nobody, for a job whose nodes share one host."""
        self.leading = leading
        """Asked before this controller acts on what it saw (publishes an epoch, has a
        worker killed): False when it lost its leadership meanwhile (its node was cut off
        long enough for its lease to lapse), and it steps down (`StaleLeader`) instead."""
        self.interrupted = interrupted
        """Asked while waiting for statuses: True makes this controller step down at once
        (`Interrupted`) rather than at the end of the wait (the status timeout: minutes)."""
        self.planner = planner
        self.total_steps = total_steps
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
        self.checkpoints = checkpoints
        self.completed_checkpoints: list[int] = []
        self._stalled = 0
        self._join_deferred = -1  # the epoch whose join wait was logged
        self._killed: set[Worker] = set()
        self._firsts: dict[int, int] = {}
        self._members_of: dict[int, frozenset[Worker]] = {}
        """Each past epoch's workers (`_last_planned`)."""
        """Each past epoch's first iteration (`_committing_epoch`)."""
        self._said: dict[str, object] = {}
        """What was last logged of a condition that lasts (a cut, joiners out of reach)."""
        self._prepared_moves = 0
        """The layer bytes the prepared leave's plan moves (`_leave_plan`), for its event."""
        self._sources: set[Worker] = set()
        """The leaving workers the epoch in force receives layers from (`EpochRecord.leaving`):
        one gone without its word that its copies landed fails the epoch (`_lost_sources`)."""
        self._unusable: set[str] = set()
        """Nodes alive that no plan could use (the batch has too few microbatches for more
        pipelines, a deeper template does not fit in memory) or that are beyond
        `max_nodes`: they wait as spares, and are tried again at the next failure
        (`keys.SPARES` says which, for `planaria status`)."""

    # ------------------------------------------------------------- start
    def start(self, workers: list[Worker], plan: Plan | None = None) -> Plan:
        """Publish epoch 0: `plan`, or the planner's plan for the workers' nodes.

        With checkpoints on and a complete one in the checkpoint directory, the job goes
        on from the newest (as a plain torchrun job does): the same command run again
        after the whole job was lost resumes instead of starting over. A checkpoint of
        another model ends the job with a message instead."""
        nodes = self._cap(self._whole_nodes(set(workers)))
        if plan is None:
            plan = self.planner.instantiate(len(nodes), node_ids=nodes).plan
        # Nodes the plan leaves out (no set of pipelines uses them all) wait, as idle nodes
        # of later epochs do, rather than join at once.
        idle = sorted(set(nodes) - set(plan.nodes()))
        if idle:
            self._set_unusable(self._unusable | set(idle))
            self._said["idle"] = idle
            self.log(f"controller: epoch 0 uses {len(plan.nodes())} of {len(nodes)} nodes; {idle} "
                     "wait until a node fails")
        found = self._checkpoint_list()
        if not found:
            self._publish(EpochRecord(plan))
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
        self.completed_checkpoints = [k for k, _ in found]
        self.log(f"controller: resuming from the checkpoint of iteration {iteration} ({path})")
        self._publish(EpochRecord(plan, restore=str(path)))
        return plan

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
        self._sources = {t.src for t in record.transfers if t.src[0] in record.leaving}
        # Checkpoints an earlier leader completed (and pruned): not to be completed again.
        self.completed_checkpoints = [i for i, _ in self._checkpoint_list()]
        if self.store.check([keys.DONE]):
            self.outcome = self.store.get(keys.DONE).decode()
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
        if self._unusable - {node for node, _ in alive}:  # a spare that died is no spare
            self._set_unusable(self._unusable & {node for node, _ in alive})
        members = set(self.plan.rank_of_worker())
        gone = (members - alive) | self._lost_sources(alive)
        statuses = self._statuses(members)
        if len(statuses) == len(members) and all(s.finished for s in statuses.values()):
            self._end(keys.JOB_OK)
            return "finished"
        views = self.unreachable()
        notices = self.notices()
        leaving = self._leaving(notices)
        waiting = self._out_of_their_epochs({w for w in alive - members if w[0] not in notices})
        joiners = self._spares_if_full(self._reachable_joiners(set(self._whole_nodes(waiting)) - self._unusable,
                                                                views))
        failed_report = any(not s.finished for s in statuses.values()) or self._cut(views)
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

    def _out_of_their_epochs(self, workers: set[Worker]) -> set[Worker]:
        """The workers of `workers` that can be planned in: new ones, and those that have
        left the last epoch they were planned in (`keys.ready`). A node cut off and back
        shows its workers alive at once, but a worker still blocked in the epoch it was
        cut off in would never reach the next one's rendezvous, and the whole job would
        wait for it there; it is planned in once it has left (said once)."""
        ready = set()
        for worker in workers:
            last = self._last_planned(worker)
            key = keys.ready(worker)
            if last is None or (self.store.check([key]) and int(self.store.get(key)) >= last):
                ready.add(worker)
            elif self._said.get(f"in epoch {worker}") != last:
                self._said[f"in epoch {worker}"] = last
                self.log(f"controller: {worker_key(worker)} is alive but still in epoch {last} (cut off and "
                         "back?); it is planned in once it has left it")
        return ready

    def _last_planned(self, worker: Worker, lookback: int = 50) -> int | None:
        """The newest past epoch whose plan had `worker`, or None (within `lookback`)."""
        for epoch in range(self.epoch - 1, max(-1, self.epoch - 1 - lookback), -1):
            if epoch not in self._members_of:  # published records never change
                key = keys.epoch_record(epoch)
                if not self.store.check([key]):
                    return None
                self._members_of[epoch] = frozenset(EpochRecord.from_json(self.store.get(key)).plan.rank_of_worker())
            if worker in self._members_of[epoch]:
                return epoch
        return None

    def _lost_sources(self, alive: set[Worker]) -> set[Worker]:
        """Leaving workers of this epoch gone before they said their copies landed: the
        workers receiving from them would wait for them until their collective timeout."""
        if not self._sources or self._epoch_trained():
            return set()
        return {w for w in self._sources
                if w not in alive and not self.store.check([keys.epoch_handed_off(self.epoch, w)])}

    def _cut(self, views: Mapping[str, Iterable[str]]) -> bool:
        """True when two nodes of the plan cannot reach each other: the epoch cannot go on
        (its collectives across the cut hang), and is ended as a failure at once rather
        than at the collective timeout."""
        cuts = cut_pairs(self.plan.nodes(), views)
        if cuts and self._said.get("cut") != (self.epoch, cuts):
            self._said["cut"] = (self.epoch, cuts)
            self.log(f"controller: nodes of epoch {self.epoch} cannot reach each other "
                     f"({', '.join(f'{a} - {b}' for a, b in cuts)}); ending the epoch")
        return bool(cuts)

    def _leaving(self, notices: Mapping[str, LeaveNotice]) -> set[str]:
        """The plan's nodes to plan out now: those with a notice whose deadline is near
        enough (`leave_window_s`) and still far enough for a planned leave. Until then a
        noticed node trains on: EC2's two minutes are many steps, and leaving at once
        would give them up. One with too little time left is not acted on: it goes down
        the failure path when it is gone, which loses nothing either. Each is said once."""
        noticed = sorted(set(notices) & set(self.plan.nodes()))
        if not noticed:
            return set()
        needs = self._leave_needs_s()
        leaving = set()
        for node in noticed:
            notice, left = notices[node], notices[node].deadline - time.time()
            if needs <= left <= leave_window_s(needs):
                leaving.add(node)
            elif left < needs:
                self._say_once(f"notice {node}", notice, f"{node} will be gone in {max(left, 0):.1f} s "
                               f"({notice.source}), too soon for a planned leave (about {needs:.1f} s); it is "
                               "recovered as a failure")
            else:
                self._say_once(f"notice {node}", notice, f"{node} will be gone in {left:.0f} s ({notice.source}); "
                               f"it trains on and leaves about {leave_window_s(needs):.0f} s before")
        return leaving

    def _say_once(self, key: str, value, message: str) -> None:
        if self._said.get(key) != value:
            self._said[key] = value
            self.log(f"controller: {message}")

    def _leave_needs_s(self) -> float:
        """Two steps (the one under way, then the one the stop comes after) at the job's
        measured step time (`keys.PROGRESS`, 0 before it is known) and the overhead."""
        step_s = 0.0
        if self.store.check([keys.PROGRESS]):
            step_s = Progress.from_json(self.store.get(keys.PROGRESS)).step_s
        return 2 * step_s + self.leave_overhead_s

    def _cap(self, nodes: list[str]) -> list[str]:
        """`nodes`, at most `max_nodes` of them: the plan's own first (a spare never takes
        the place of a node that trains), then the others in name order. The rest wait as
        spares (said once per set)."""
        if self.max_nodes is None or len(nodes) <= self.max_nodes:
            return nodes
        planned = self.plan.nodes() if self.plan is not None else []
        ordered = [n for n in planned if n in nodes] + sorted(n for n in nodes if n not in planned)
        kept, spares = ordered[:self.max_nodes], ordered[self.max_nodes:]
        self._set_unusable((self._unusable - set(kept)) | set(spares))
        self._say_once("spares", sorted(spares), f"the job is at its maximum of {self.max_nodes} nodes; "
                       f"{sorted(spares)} wait as spares, their workers started, for a node to fail")
        return kept

    def _spares_if_full(self, joiners: set[str]) -> set[str]:
        """`joiners`, or none when the plan already has `max_nodes` nodes: they wait as
        spares rather than end the epoch for a plan that could not take them."""
        if not joiners or self.max_nodes is None or len(self.plan.nodes()) < self.max_nodes:
            return joiners
        self._set_unusable(self._unusable | joiners)
        self._say_once("spares", sorted(self._unusable), f"the job is at its maximum of {self.max_nodes} "
                       f"nodes; {sorted(joiners)} wait as spares, their workers started, for a node to fail")
        return set()

    def _set_unusable(self, nodes: set[str]) -> None:
        """The nodes that wait as spares; `keys.SPARES` says which (for `planaria status`)."""
        if nodes != self._unusable or not self.store.check([keys.SPARES]):
            self.store.set(keys.SPARES, json.dumps(sorted(nodes)))
        self._unusable = set(nodes)

    def _reachable_joiners(self, joiners: set[str], views: Mapping[str, Iterable[str]]) -> set[str]:
        """The joiners that reach every node of the plan; the others wait (said once)."""
        planned = self.plan.nodes()
        out_of_reach = sorted(n for n in joiners if not reaches_all(n, planned, views))
        if out_of_reach and self._said.get("out of reach") != out_of_reach:
            self.log(f"controller: {out_of_reach} cannot reach every node of the job; they wait "
                     "until they can")
        self._said["out of reach"] = out_of_reach
        return joiners - set(out_of_reach)

    # ------------------------------------------------------- reconfigure
    def _reconfigure(self, alive_now: Callable[[], set[Worker]], kill: Callable[[Worker], None],
                     reason: str) -> None:
        detected = time.time()
        members = set(self.plan.rank_of_worker())
        if reason == keys.LEAVE:
            self._prepare_leave(alive_now)
        # A failure: every survivor releases the epoch's collectives at once; a join or a
        # leave: all stop at the next iteration boundary. Either way the epoch's rendezvous
        # is abandoned if it is still going on (a peer died before joining it).
        self.store.set(keys.epoch_reconfigure(self.epoch), reason)
        if self.debounce_s:
            time.sleep(self.debounce_s)
        statuses = self._collect_statuses(members, alive_now, kill, released=reason == keys.FAILURE)
        # One that died after it reported (a second failure a moment after the first) is
        # failed too: its status is of no use to a plan that would count on it.
        still = alive_now() - self._killed
        statuses = {w: s for w, s in statuses.items() if w in still}
        statuses_s = time.time()
        self._check_leading()
        survivors = set(statuses)
        notices = self.notices()
        newcomers = alive_now() - members - self._killed
        # (a noticed node is never planned in; its workers need not be ready to be told so)
        joiners = self._out_of_their_epochs({w for w in newcomers if w[0] not in notices}) | {
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
        prepared = self._prepared()
        # Workers that stopped at the step boundary may be in the prepared epoch already.
        if prepared is not None and self._publish_prepared(prepared, statuses, resolution, members, alive_now,
                                                           reason, detected, statuses_s):
            return
        # (Or it could not go on, and it was published as failed: the next one is planned
        # from these statuses the usual way.)
        # Nodes with a notice are planned out, whatever the reason for this epoch: they
        # hand over the layers only they hold, if their deadline leaves the time to.
        leaving = {w for w in statuses if w[0] in notices
                   and notices[w[0]].deadline - time.time() >= self.leave_overhead_s}
        nodes, cut_off = self._reachable_nodes([n for n in self._whole_nodes(survivors | joiners)
                                                if n not in notices])
        nodes = self._cap(nodes)
        if cut_off and len(nodes) < self.planner.n0:
            self._wait_out_partition(cut_off, f"the largest group of nodes that all reach each other, "
                                              f"{nodes}, is too small for one replica of the model")
            return
        self._check_progress(first, nodes)
        if len(nodes) < self.planner.n0:
            told = sorted(set(notices) & {w[0] for w in survivors | joiners})
            raise JobFailed(f"{len(nodes)} node(s) left, but one replica of the model needs "
                            f"n0={self.planner.n0}"
                            f"{f' ({told} were told they will be gone: a preemption notice or SIGTERM)' if told else ''}"
                            "; add nodes and restart from the last checkpoint")
        # Sources of layer state: what the workers of the group hold, live or in their
        # peer snapshots (a stateless worker may keep snapshots); no copy crosses a cut.
        holders = {w: s for w, s in statuses.items() if w[0] in nodes or w in leaving}
        try:
            choice, transfers, restore, snapshot, first = self._plan_or_leave_out_joiners(nodes, holders, first,
                                                                                       leaving)
        except JobFailed as err:
            if not cut_off:
                raise
            self._wait_out_partition(cut_off, f"{nodes} cannot train on their own ({err})")
            return
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
            cut_off=tuple(cut_off), left=left, handed_off=sum(t.src in leaving for t in transfers))
        self._account(event)

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

    def _prepare_leave(self, alive_now: Callable[[], set[Worker]]) -> None:
        """Plan a leave's next epoch while the epoch in force still trains, and write it as
        prepared (`keys.epoch_prepared`) before the stop is asked for: a worker that stops
        at the agreed step boundary enters it at once, instead of waiting for every
        status, this plan and its publication (30-40 ms of the pause with four workers on
        two cores; with many workers, that many more statuses to wait for)."""
        try:
            record = self._leave_plan(alive_now)
        except (JobFailed, ValueError):  # no plan now: the usual way says why, after the statuses
            return
        if record is not None:
            self.store.compare_set(keys.epoch_prepared(self.epoch), "", record.to_json())

    def _leave_plan(self, alive_now: Callable[[], set[Worker]]) -> EpochRecord | None:
        """The record a planned leave's statuses would lead to, from what the plan in force
        has each worker hold (a worker that trains holds exactly its plan's layers, and
        the stop comes after a committed step); None when the statuses could change it:
        a worker gone, a node cut off, a plan that leaves nodes idle or that would restore
        a layer from elsewhere. Its first iteration is a placeholder."""
        members = set(self.plan.rank_of_worker())
        alive = alive_now() - self._killed
        if members - alive:
            return None
        notices = self.notices()
        joiners = self._out_of_their_epochs({w for w in alive - members if w[0] not in notices})
        nodes, cut_off = self._reachable_nodes([n for n in self._whole_nodes(members | joiners) if n not in notices])
        nodes = self._cap(nodes)
        if cut_off or len(nodes) < self.planner.n0:
            return None
        choice = self._instantiate(nodes, max(1, self.plan.first_iteration))
        held = self._plan_holds()
        leaving = {w for w in members if w[0] in notices
                   and notices[w[0]].deadline - time.time() >= self.leave_overhead_s}
        if choice.idle_nodes or missing_from(held, choice.plan, leaving):
            return None
        left = tuple(sorted(set(notices) & {w[0] for w in members | joiners}))
        self._prepared_moves = choice.moved_bytes
        return EpochRecord(choice.plan, transfers=tuple(transfers_from(held, choice.plan, leaving)), leaving=left)

    def _plan_holds(self) -> dict[tuple[int, int], set[Worker]]:
        """Layer shard -> the workers the plan in force has hold it."""
        return {shard: {self.plan.worker(r) for r in ranks} for shard, ranks in self.plan.replica_groups().items()}

    def _prepared(self) -> EpochRecord | None:
        """The next epoch as prepared for a leave of the epoch in force (by this leader or
        the one before it), if any."""
        value = read_if_present(self.store, keys.epoch_prepared(self.epoch))
        return None if value is None else EpochRecord.from_json(value)

    def _publish_prepared(self, prepared: EpochRecord, statuses: dict[Worker, WorkerStatus], resolution: Resolution,
                          members: set[Worker], alive_now: Callable[[], set[Worker]], reason: str,
                          detected: float, statuses_s: float) -> bool:
        """Publish the prepared epoch: workers that stopped at the step boundary entered it
        already, from the step after it (`resolution`'s first iteration: no worker is ahead
        of a stop all agreed on). True when it goes on.

        False when the statuses do not bear it out: a worker it needs (in its plan, or a
        source of its copies) failed during the stop, or holds other than its plan's
        layers. No step can be committed in it then (its rendezvous or its copies wait
        for that worker, and training begins only after both), so it is declared failed
        before its record is published (the record still is, for the workers that may be
        in it to see that it failed), and the caller plans the next one from these
        statuses, as if it had never been prepared: the leaving nodes' layers among
        them, which a plan made from the failed epoch's own statuses would no longer
        count on. It gets no event: nobody trained in it."""
        first = resolution.first_iteration
        plan = replace(prepared.plan, first_iteration=first)
        record = replace(prepared, plan=plan, roll_forward=resolution.roll_forward)
        needed = ({w for w in plan.rank_of_worker() if w in members}
                  | {t.src for t in prepared.transfers})
        held = self._plan_holds()
        holds_as_planned = all({shard for shard, workers in held.items() if w in workers}
                               == {tuple(shard) for shard in statuses[w].holds} for w in needed & set(statuses))
        newcomers = set(plan.rank_of_worker()) - members
        sound = (needed <= set(statuses) and holds_as_planned and resolution.roll_forward is None
                 and newcomers <= alive_now() - self._killed)
        if not sound:
            self.store.set(keys.epoch_reconfigure(plan.epoch), keys.FAILURE)
            self._publish(record)
            self.log(f"controller: epoch {plan.epoch}, prepared for the leave of {list(record.leaving)}, cannot go "
                     f"on (a worker it needs failed during the stop, or holds other layers than planned); "
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
            transfers=len(record.transfers), moved_bytes=self._prepared_moves,
            plan_shape=tuple(len(p.stages) for p in plan.pipelines), left=record.leaving,
            handed_off=sum(t.src[0] in record.leaving for t in record.transfers))
        self._account(event, "; planned before the stop, while the epoch trained")
        return True

    def _reachable_nodes(self, nodes: list[str]) -> tuple[list[str], list[str]]:
        """(the largest group of `nodes` that all reach each other, the rest): the rest
        stay alive and wait, and join again once they reach the job's nodes."""
        group = reachable_group(nodes, self._settled_views(nodes), leader=self.node)
        rest = sorted(set(nodes) - set(group))
        if rest and self._said.get("partition") != (group, rest):
            self._said["partition"] = (group, rest)
            self.log(f"controller: {rest} cannot reach {group} (a partition); planning over "
                     f"{group}, the others wait until they reach it")
        return group, rest

    def _wait_out_partition(self, cut_off: list[str], why: str) -> None:
        """Publish nothing: every node is alive, only the network splits them, and the
        epoch is tried again at the next poll (the failed epoch's statuses stand), with
        the reachability of then. A job is never failed for a partition: it heals."""
        if self._said.get("waiting") != (tuple(cut_off), why):
            self._said["waiting"] = (tuple(cut_off), why)
            self.log(f"controller: {why}; waiting for the partition to heal ({cut_off} alive, out of reach)")

    def _settled_views(self, nodes: list[str], quiet_s: float = 4.0, limit_s: float = 12.0):
        """The nodes' reachability once every cut is reported from both ends (a moment
        later), or once nothing changed for `quiet_s` (longer than a probe round: a node
        cut off etcd as well cannot report), at most `limit_s`. Each node's probes see a
        cut on their own clock: planned over the first reports alone, a side could keep
        a node whose own cuts were not reported yet, and the epoch would fail once more."""
        views = self.unreachable()
        if not cut_pairs(nodes, views):
            return views
        started = changed = time.monotonic()
        while time.monotonic() - started < limit_s:
            quiet = time.monotonic() - changed
            if quiet >= quiet_s or (quiet >= 0.5 and _both_ends_report(cut_pairs(nodes, views), views)):
                break
            time.sleep(0.25)
            now = self.unreachable()
            if cut_pairs(nodes, now) != cut_pairs(nodes, views):
                views, changed = now, time.monotonic()
        return views

    def _plan_or_leave_out_joiners(self, nodes: list[str], statuses: dict[Worker, WorkerStatus], first: int,
                                   leaving: set[Worker] = frozenset()):
        """`_next_plan` for `nodes`. Where no set of pipelines uses them all, the planner's
        plan leaves some idle (new nodes first), and they wait (`_leave_idle`); where it
        has no plan at all, the one for the nodes already in the job, the new ones left
        waiting the same way. A job is failed only when the nodes it had cannot go on,
        never because one more arrived."""
        try:
            found = self._next_plan(nodes, statuses, first, leaving)
            self._leave_idle(found[0], nodes)
            return found
        except ValueError as err:
            newcomers = [n for n in nodes if n not in self.plan.nodes()]
            if not newcomers or len(newcomers) == len(nodes):
                raise JobFailed(f"the planner has no plan for {len(nodes)} node(s): {err}") from None
            self.log(f"controller: no plan uses {len(nodes)} nodes ({err}); {newcomers} wait "
                     "until a node fails")
            self._set_unusable(self._unusable | set(newcomers))
            return self._plan_or_leave_out_joiners([n for n in nodes if n not in newcomers], statuses, first,
                                                   leaving)

    def _leave_idle(self, choice, nodes: list[str]) -> None:
        """The nodes of `nodes` that `choice` leaves idle wait (`_unusable`): alive, not
        in the plan, their workers waiting for an epoch that names them (as they do for
        any epoch without them), and planned again at the next failure. Said once per
        set of idle nodes."""
        idle = set(choice.idle_nodes)
        self._set_unusable((self._unusable - set(nodes)) | idle)
        if idle and self._said.get("idle") != sorted(idle):
            self.log(f"controller: no plan uses {len(nodes)} nodes ({choice.idle_reason}); "
                     f"{sorted(idle)} wait until a node fails")
        self._said["idle"] = sorted(idle)

    def _next_plan(self, nodes: list[str], statuses: dict[Worker, WorkerStatus], first: int,
                   leaving: set[Worker] = frozenset()):
        """(plan choice, transfers, checkpoint to restore or None, peer snapshot to restore
        or None, first iteration): the planner's plan for `nodes`, fed from what the
        survivors hold (the `leaving` workers' layers too, for the shards nobody staying
        holds: a planned leave); when some shard has no holder left, from the newest step whose
        every shard some survivor keeps in its peer snapshots, or else from the newest
        checkpoint (whichever is newer: replicas first, peers' memory second, disk last)."""
        choice = self._instantiate(nodes, first)
        if first == 0:  # before the first step every layer is its seeded initial state
            return choice, [], None, None, first
        held: dict[tuple[int, int], set[Worker]] = {}
        for worker, status in statuses.items():
            for shard in status.holds:
                held.setdefault(tuple(shard), set()).add(worker)
        missing = missing_from(held, choice.plan, leaving)
        if not missing:
            return choice, transfers_from(held, choice.plan, leaving), None, None, first
        found = self._newest_snapshot(statuses, first, choice.plan)
        on_disk = [i for i, _ in self._checkpoint_list() if i < first]
        if found is not None and (not on_disk or found[0].step >= on_disk[-1]):
            snapshot, kept = found
            self.log(f"controller: layer shards {missing} lost every replica; going back to the peer "
                     f"snapshots of iteration {snapshot.step} ({first - 1 - snapshot.step} step(s) trained again)")
            self._forget_after(snapshot.step)
            choice = self._instantiate(nodes, snapshot.step + 1)
            return choice, transfers_from(kept, choice.plan), None, snapshot, snapshot.step + 1
        restore, first = self._checkpoint_before(first, missing)
        return self._instantiate(nodes, first), [], restore, None, first

    def _instantiate(self, nodes: list[str], first: int):
        return self.planner.instantiate(len(nodes), node_ids=nodes, current=self.plan,
                                        epoch=self.epoch + 1, first_iteration=first)

    def _newest_snapshot(self, statuses: dict[Worker, WorkerStatus], first: int, plan: Plan):
        """(the step's `SnapshotHeld`, shard -> the workers that keep it) of the newest
        step before `first` whose every shard some worker of `plan` keeps, or None.

        Only snapshots of the job's own history count: of a step as committed by the
        epoch that committed it (`_committing_epoch`). One kept by a worker from a
        timeline the job went back from (it was cut off meanwhile) is never used."""
        kept: dict[tuple[int, int], dict[tuple[int, int], set[Worker]]] = {}
        commits: dict[tuple[int, int], CommitRecord] = {}
        for worker, status in statuses.items():
            for held in status.snapshots:
                if held.step < first and held.epoch == self._committing_epoch(held.step):
                    key = (held.step, held.epoch)
                    commits[key] = held.commit
                    for shard in held.shards:
                        kept.setdefault(key, {}).setdefault(tuple(shard), set()).add(worker)
        for key in sorted(kept, reverse=True):
            if not missing_from(kept[key], plan):
                return SnapshotHeld(commit=commits[key], epoch=key[1]), kept[key]
        return None

    def _forget_after(self, iteration: int) -> None:
        """The job goes back to `iteration`: checkpoints of later steps are written again
        by the epochs that commit those steps again (under their own keys and directories:
        nothing of the earlier ones is counted)."""
        if self.checkpoints is not None and self.checkpoints.every:
            prune(self.checkpoints.directory, self.checkpoints.keep, after=iteration)
        self.completed_checkpoints = [k for k in self.completed_checkpoints if k <= iteration]

    def _checkpoint_before(self, first: int, missing) -> tuple[Path, int]:
        """The newest complete checkpoint before `first` and the iteration after it; the
        work since is lost. JobFailed when there is none."""
        usable = [(i, path) for i, path in self._checkpoint_list() if i < first]
        if not usable:
            raise JobFailed(f"no surviving worker holds layer shards {missing} (layer, tp rank), none keeps "
                            "them all in a peer snapshot, and there is no complete checkpoint to go back "
                            "to: more failures than replicas and snapshot copies; set checkpoint.every, "
                            "or raise checkpoint.memory_copies or fault_tolerance.f")
        iteration, path = usable[-1]
        self.log(f"controller: layer shards {missing} lost every replica and peer snapshot; going back "
                 f"to the checkpoint of iteration {iteration} ({first - 1 - iteration} step(s) of work lost)")
        self._forget_after(iteration)
        return path, iteration + 1

    def _checkpoint_list(self) -> list[tuple[int, Path]]:
        if self.checkpoints is None or not self.checkpoints.every:
            return []
        return complete_checkpoints(self.checkpoints.directory)

    def _complete_checkpoints(self) -> None:
        """Write the manifest of each checkpoint whose shard files are all on disk.

        Checkpoints complete in order while an epoch trains. One that a failure left
        incomplete (a worker died before writing its shards) is passed over once the
        epoch in force began after it: no worker will write it any more, and waiting
        for it would keep every later checkpoint from counting.

        Only the shards of the epoch that committed the step count (`_committing_epoch`):
        reports and files of any other epoch's workers (one cut off and replaced, writing
        late; one of a timeline the job went back from) are never counted nor named."""
        policy = self.checkpoints
        if policy is None or not policy.every or self.plan is None:
            return
        total = self.plan.num_layers * self.plan.tp
        newest = self.completed_checkpoints[-1] if self.completed_checkpoints else -1
        for k in range(newest + policy.every, self.total_steps, policy.every):
            epoch = self._committing_epoch(k)
            key = keys.checkpoint_shards(k, epoch)
            reported = self.store.check([key]) and self.store.add(key, 0) >= total
            if reported and not step_dir(policy.directory, k).is_dir():  # completed and pruned already
                self.completed_checkpoints.append(k)
                continue
            # The files themselves decide, not the count alone: a report retried after its
            # reply was lost counts twice, and a manifest must never name a missing shard.
            if not reported or missing_shards(epoch_dir(policy.directory, k, epoch), self.plan.num_layers, self.plan.tp):
                if k < self.plan.first_iteration:
                    continue  # abandoned (or its last shards still being written: asked again)
                break
            commit = CommitRecord.from_json(self.store.get(keys.checkpoint_commit(k, epoch)))
            write_manifest(policy.directory, commit, self.plan.num_layers, self.plan.tp, epoch=epoch)
            self.completed_checkpoints.append(k)
            prune(policy.directory, policy.keep)
            self.log(f"controller: checkpoint of iteration {k} complete")

    def _committing_epoch(self, iteration: int) -> int:
        """The epoch that commits (or committed) step `iteration` in the job's history: the
        newest one whose plan starts at or before it. Its workers, and only they, write
        that step's checkpoint."""
        epoch = self.epoch
        while epoch > 0 and self._first_iteration(epoch) > iteration:
            epoch -= 1
        return epoch

    def _first_iteration(self, epoch: int) -> int:
        if epoch == self.epoch:
            return self.plan.first_iteration
        if epoch not in self._firsts:  # published records never change
            key = keys.epoch_record(epoch)
            if not self.store.check([key]):  # (never: records are not deleted) the walk stops here
                return -1
            self._firsts[epoch] = EpochRecord.from_json(self.store.get(key)).plan.first_iteration
        return self._firsts[epoch]

    def _collect_statuses(self, members: set[Worker], alive_now: Callable[[], set[Worker]],
                          kill: Callable[[Worker], None], released: bool) -> dict[Worker, WorkerStatus]:
        """Statuses of the epoch's live workers (one that dies meanwhile is no longer
        waited for); the ones that stay silent are killed. A worker lost while a join
        stops the epoch turns the join into a failure: the survivors blocked on it are
        released rather than left to their collective timeout."""
        deadline = ReachableDeadline(self.status_timeout_s)  # an etcd outage is no silence
        while True:
            expected = members & (alive_now() - self._killed)
            if not released and expected != members:
                self.store.set(keys.epoch_reconfigure(self.epoch), keys.FAILURE)
                released = True
            statuses = self._statuses(expected)
            if len(statuses) == len(expected) or deadline.expired():
                break
            if self.interrupted():
                raise Interrupted("the leader's node is leaving; the next leader takes the "
                                  f"reconfiguration to epoch {self.epoch + 1} over")
            # The statuses come at the next step boundary, then within milliseconds of
            # each other: once the first is in, the rest are polled for every 2 ms.
            time.sleep(FAST_POLL_S if statuses else 0.02)
        if expected - set(statuses):
            self._check_leading()
        for worker in sorted(expected - set(statuses)):
            self.log(f"controller: worker {worker_key(worker)} did not report within "
                     f"{self.status_timeout_s:.0f} s; killing it")
            kill(worker)
            self._killed.add(worker)
        return statuses

    def _check_leading(self) -> None:
        if not self.leading():
            raise StaleLeader(f"this controller lost its leadership during the reconfiguration to epoch "
                              f"{self.epoch + 1}; it steps down without acting on what it saw")

    def _statuses(self, workers: set[Worker]) -> dict[Worker, WorkerStatus]:
        wanted = {w: keys.epoch_status(self.epoch, w) for w in workers}
        found = read_present(self.store, keys.epoch_statuses(self.epoch), wanted)
        return {w: WorkerStatus.from_json(value) for w, value in found.items()}

    def _check_progress(self, first_iteration: int, nodes: list[str]) -> None:
        """Fail the job after `max_stalled` reconfigurations in a row that made no progress
        on the same nodes: the same plan failing again and again is a fault of the job
        (a crash at one step, a bad node), which retrying will not cure. Churn is not:
        when nodes came or went, the next plan differs, and the job waits it out (joins
        are deferred until an epoch commits a step, so churn cannot keep it from training)."""
        if first_iteration > self.plan.first_iteration:
            self._stalled = 0
        elif set(nodes) - self._unusable == {s.node for p in self.plan.pipelines for s in p.stages}:
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
        the job to an epoch of its own; it steps down (`StaleLeader`)."""
        epoch, text = record.plan.epoch, record.to_json()
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

    def _end(self, outcome: str) -> None:
        self.outcome = outcome
        self.store.set(keys.DONE, outcome)


def leave_window_s(needs_s: float) -> float:
    """How long before its deadline a noticed node is planned out, given what a leave
    needs (`Controller._leave_needs_s`, which counts two steps where one is expected):
    ten seconds more, for a step or a copy slower than those measured. Every second
    earlier is a second the job trains without the node."""
    return needs_s + 10.0


def _both_ends_report(cuts: list[tuple[str, str]], views: Mapping[str, Iterable[str]]) -> bool:
    """True when each node of every cut pair reports the other (a cut seen whole)."""
    return all(b in views.get(a, ()) and a in views.get(b, ()) for a, b in cuts)
