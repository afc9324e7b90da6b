"""A planned leave, as the leader plans it (docs/spot.md, "What happens"): a node told that
it will be preempted is planned out at a step boundary before its deadline, and hands
over the layers only it holds before it goes.

- When: `PlannedLeaves.leaving` names the plan's nodes whose deadline is near enough
  (`leave_window_s`) and still far enough for a leave (`PlannedLeaves.needs_s`).
- The prepared epoch: the next epoch is planned while the epoch in force still trains,
  from what its plan has each worker hold, and written as prepared
  (`keys.epoch_prepared`) before the stop is asked for (`PlannedLeaves.prepare`). A
  worker that stops at the agreed step boundary enters it at once. A join is prepared
  the same way (its joiners announced, their start-up over: `EpochHistory`), so that
  it costs the job about what a leave does.
- After the stop: the prepared epoch read back (`prepared`), and whether the statuses
  bear it out (`confirm`).

Which nodes the next plan may use (reachability, spares) and the publication of an
epoch are the controller's: it passes the plan it chose, and publishes the record.
Loaded by an agent, through the controller: no torch.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from planaria.runtime.contract import keys
from planaria.runtime.contract.epochs import EpochRecord, Progress
from planaria.runtime.contract.exactly_once import Resolution, WorkerStatus
from planaria.runtime.contract.membership import LeaveNotice
from planaria.runtime.contract.store_reads import read_if_present
from planaria.templates.plan import Plan, Worker, missing_from, transfers_from

if TYPE_CHECKING:
    import torch.distributed as dist


def leave_window_s(needs_s: float) -> float:
    """How long before its deadline a noticed node is planned out, given what a leave
    needs (`PlannedLeaves.needs_s`, which counts two steps where one is expected): ten
    seconds more, for a step or a copy slower than those measured. Every second earlier
    is a second the job trains without the node."""
    return needs_s + 10.0


class PlannedLeaves:
    """The leader's planning of the leaves its nodes were given notice of (module docstring)."""

    def __init__(self, store: dist.Store, notices: Callable[[], Mapping[str, LeaveNotice]] = dict,
                 overhead_s: float = 3.0, log: Callable[[str], None] = print):
        self.store = store
        self.notices = notices
        """{node: its preemption notice} (`planaria.elastic.preemption`, posted by its
        agent): such a node is planned out at the next step boundary, and hands over the
        layers only it holds before it goes (`leaving`)."""
        self.overhead_s = overhead_s
        """What a planned leave takes beyond two steps (the boundary, then the step that
        may be under way when the notice is seen): statuses, plan, rendezvous and the
        copies. A notice with less time left goes down the failure path."""
        self.log = log
        self.prepared_moves = 0
        """The layer bytes the prepared epoch's plan moves (`prepare`), for its event."""
        self._said: dict[str, LeaveNotice] = {}
        """The notice last said of each node (`leaving`)."""

    def leaving(self, planned: list[str], notices: Mapping[str, LeaveNotice]) -> set[str]:
        """The nodes of `planned` to plan out now: those with a notice whose deadline is
        near enough (`leave_window_s`) and still far enough for a planned leave. Until
        then a noticed node trains on: EC2's two minutes are many steps, and leaving at
        once would give them up. One with too little time left is not acted on: it goes
        down the failure path when it is gone, which loses nothing either. Each is said
        once."""
        noticed = sorted(set(notices) & set(planned))
        if not noticed:
            return set()
        needs = self.needs_s()
        leaving = set()
        for node in noticed:
            notice, left = notices[node], notices[node].deadline - time.time()
            if needs <= left <= leave_window_s(needs):
                leaving.add(node)
            elif left < needs:
                self._say_once(node, notice, f"{node} will be gone in {max(left, 0):.1f} s ({notice.source}), "
                               f"too soon for a planned leave (about {needs:.1f} s); it is recovered as a failure")
            else:
                self._say_once(node, notice, f"{node} will be gone in {left:.0f} s ({notice.source}); "
                               f"it trains on and leaves about {leave_window_s(needs):.0f} s before")
        return leaving

    def _say_once(self, node: str, notice: LeaveNotice, message: str) -> None:
        if self._said.get(node) != notice:
            self._said[node] = notice
            self.log(f"controller: {message}")

    def needs_s(self) -> float:
        """Two steps (the one under way, then the one the stop comes after) at the job's
        measured step time (`keys.PROGRESS`, 0 before it is known) and the overhead."""
        step_s = 0.0
        if self.store.check([keys.PROGRESS]):
            step_s = Progress.from_json(self.store.get(keys.PROGRESS)).step_s
        return 2 * step_s + self.overhead_s

    def handing_over(self, workers: Iterable[Worker], notices: Mapping[str, LeaveNotice]) -> set[Worker]:
        """The workers of `workers` on noticed nodes whose deadline leaves the time to hand
        over the layers only they hold."""
        return {w for w in workers if w[0] in notices and notices[w[0]].deadline - time.time() >= self.overhead_s}

    def prepare(self, epoch: int, plan: Plan, choice, notices: Mapping[str, LeaveNotice],
                connect_ahead: bool = False) -> None:
        """Write the next epoch as prepared for the leave (or join) of `epoch`, whose plan is `plan`:
        `choice` (the planner's, for the nodes that stay), its transfers from what `plan`
        has each worker hold (a worker that trains holds exactly its plan's layers, and
        the stop comes after a committed step). Nothing is written when the statuses could
        change it: a plan that leaves nodes idle, or that would restore a layer from
        elsewhere. Its first iteration is a placeholder (`confirm` sets it).
        `connect_ahead` (a join's): its workers connect its groups before they stop
        (`EpochRecord.connect_ahead`); a leave's stop is not held for that (its deadline)."""
        held = plan_holds(plan)
        members = set(plan.rank_of_worker())
        leaving = self.handing_over(members, notices)
        if choice.idle_nodes or missing_from(held, choice.plan, leaving):
            return
        left = tuple(sorted(set(notices) & {w[0] for w in members}))
        self.prepared_moves = choice.moved_bytes
        record = EpochRecord(choice.plan, transfers=tuple(transfers_from(held, choice.plan, leaving)), leaving=left,
                             connect_ahead=connect_ahead and not left)
        self.store.compare_set(keys.epoch_prepared(epoch), "", record.to_json())

    def prepared(self, epoch: int) -> EpochRecord | None:
        """The next epoch as prepared for a leave of `epoch` (by this leader or the one
        before it), if any."""
        value = read_if_present(self.store, keys.epoch_prepared(epoch))
        return None if value is None else EpochRecord.from_json(value)

    def confirm(self, prepared: EpochRecord, plan: Plan, statuses: dict[Worker, WorkerStatus],
                resolution: Resolution, alive_now: Callable[[], set[Worker]]) -> tuple[EpochRecord, bool]:
        """(the prepared record from the step after the stop, whether the statuses bear it
        out), `plan` being the plan in force. Workers that stopped at the step boundary
        entered it already, from the step after it (`resolution`'s first iteration: no
        worker is ahead of a stop all agreed on).

        The statuses do not bear it out when a worker it needs (in its plan, or a source
        of its copies) failed during the stop, or holds other than its plan's layers.
        No step can be committed in it then: its rendezvous or its copies wait for that
        worker, and training begins only after both."""
        members = set(plan.rank_of_worker())
        first = resolution.first_iteration
        record = replace(prepared, plan=replace(prepared.plan, first_iteration=first),
                         roll_forward=resolution.roll_forward)
        needed = ({w for w in record.plan.rank_of_worker() if w in members}
                  | {t.src for t in prepared.transfers})
        held = plan_holds(plan)
        holds_as_planned = all({shard for shard, workers in held.items() if w in workers}
                               == {tuple(shard) for shard in statuses[w].holds} for w in needed & set(statuses))
        newcomers = set(record.plan.rank_of_worker()) - members
        sound = (needed <= set(statuses) and holds_as_planned and resolution.roll_forward is None
                 and newcomers <= alive_now())
        return record, sound


def plan_holds(plan: Plan) -> dict[tuple[int, int], set[Worker]]:
    """Layer shard -> the workers `plan` has hold it."""
    return {shard: {plan.worker(r) for r in ranks} for shard, ranks in plan.replica_groups().items()}
