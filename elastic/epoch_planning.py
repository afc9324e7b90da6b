"""The plan of the next epoch and where each of its layers comes from (docs/recovery.md,
step 3 of a reconfiguration: "Decide").

The planner's plan for the nodes the controller chose, preferring the one that moves the
least layer state from the plan in force, fed from what the survivors hold (the leaving
workers' layers too, for the shards nobody staying holds: a planned leave). When some
shard has no holder left, the job goes back to peer snapshots or a checkpoint
(`JobCheckpoints.restore`). Where no set of pipelines uses every node, the plan leaves
some idle; where the planner has no plan at all, the one for the nodes already in the
job is made: either way the others wait as spares. A job is failed only when the nodes
it had cannot go on, never because one more arrived.

Which nodes may be planned (alive, whole, reachable, told of no leave), the exactly-once
rule and the publication are the controller's. Loaded by an agent, through the
controller: no torch.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

from planaria.elastic.controller_errors import CutHoldsState, JobFailed
from planaria.elastic.epoch_history import EpochHistory
from planaria.elastic.job_checkpoints import JobCheckpoints
from planaria.elastic.spare_nodes import Spares
from planaria.runtime.contract.exactly_once import WorkerStatus
from planaria.templates.plan import Plan, Worker, missing_from, transfers_from
from planaria.templates.planner import PlanChoice, Planner


class EpochPlanner:
    """The next epochs' plans and their layers' sources (module docstring)."""

    def __init__(self, planner: Planner, spares: Spares, checkpoints: JobCheckpoints, history: EpochHistory,
                 log: Callable[[str], None] = print):
        self.planner = planner
        self.spares = spares
        self.checkpoints = checkpoints
        self.history = history
        self.log = log

    def instantiate(self, nodes: list[str], first: int, current: Plan) -> PlanChoice:
        """The planner's plan of the epoch after `current` (the plan in force) for `nodes`,
        from iteration `first`."""
        return self.planner.instantiate(len(nodes), node_ids=nodes, current=current,
                                        epoch=current.epoch + 1, first_iteration=first)

    def plan(self, nodes: list[str], statuses: dict[Worker, WorkerStatus], first: int, current: Plan,
             leaving: set[Worker] = frozenset(), out_of_reach: Mapping[Worker, set] | None = None):
        """`with_sources` for `nodes`. Where no set of pipelines uses them all, the planner's
        plan leaves some idle (new nodes first), and they wait (`Spares.leave_idle`); where
        it has no plan at all, the one for the nodes already in the job, the new ones left
        waiting the same way. `out_of_reach`: see `with_sources`."""
        try:
            found = self.with_sources(nodes, statuses, first, current, leaving, out_of_reach)
            self.spares.leave_idle(found[0], nodes)
            return found
        except ValueError as err:
            newcomers = [n for n in nodes if n not in current.nodes()]
            if not newcomers or len(newcomers) == len(nodes):
                raise JobFailed(f"the planner has no plan for {len(nodes)} node(s): {err}") from None
            self.log(f"controller: no plan uses {len(nodes)} nodes ({err}); {newcomers} wait "
                     "until a node fails")
            self.spares.set_nodes(self.spares.nodes | set(newcomers))
            return self.plan([n for n in nodes if n not in newcomers], statuses, first, current, leaving,
                             out_of_reach)

    def with_sources(self, nodes: list[str], statuses: dict[Worker, WorkerStatus], first: int, current: Plan,
                     leaving: set[Worker] = frozenset(), out_of_reach: Mapping[Worker, set] | None = None):
        """(plan choice, transfers, checkpoint to restore or None, peer snapshot to restore
        or None, first iteration): the planner's plan for `nodes`, fed from what the
        survivors hold (the `leaving` workers' layers too, for the shards nobody staying
        holds: a planned leave); when some shard has no holder left, from the newest step whose
        every shard some survivor keeps in its peer snapshots, or else from the newest
        checkpoint (whichever is newer: replicas first, peers' memory second, disk last).
        `out_of_reach`: {worker: the shards it may hold} of workers out of reach but maybe
        alive (`cut_wait.may_hold`); when they hold every missing shard and going back
        would train steps again (or there is nothing to go back to), `CutHoldsState` is
        raised instead, for the controller to wait for them."""
        choice = self.instantiate(nodes, first, current)
        if first == 0:  # before the first step every layer is its seeded initial state
            return choice, [], None, None, first
        held: dict[tuple[int, int], set[Worker]] = {}
        for worker, status in statuses.items():
            for shard in status.holds:
                held.setdefault(tuple(shard), set()).add(worker)
        missing = missing_from(held, choice.plan, leaving)
        if not missing:
            return choice, transfers_from(held, choice.plan, leaving), None, None, first
        self._check_out_of_reach(missing, out_of_reach, statuses, first, choice.plan, current)
        restore = self.checkpoints.restore(statuses, first, choice.plan, missing,
                                           lambda step: self.history.committing_epoch(step, current))
        if restore is None:
            raise JobFailed(f"no surviving worker holds layer shards {missing} (layer, tp rank), none keeps "
                            "them all in a peer snapshot, and there is no complete checkpoint to go back "
                            "to: more failures than replicas and snapshot copies; set checkpoint.every, "
                            "or raise checkpoint.memory_copies or fault_tolerance.f")
        choice = self.instantiate(nodes, restore.step + 1, current)
        transfers = [] if restore.snapshot is None else transfers_from(restore.keepers, choice.plan)
        return choice, transfers, restore.checkpoint, restore.snapshot, restore.step + 1

    def _check_out_of_reach(self, missing, out_of_reach, statuses, first: int, plan: Plan, current: Plan) -> None:
        """Raise `CutHoldsState` when the workers out of reach hold every `missing` shard
        and the newest older state would train steps again (`with_sources`)."""
        if not out_of_reach:
            return
        holders = {w: shards & set(missing) for w, shards in out_of_reach.items() if shards & set(missing)}
        if not set(missing) <= set().union(*holders.values()):
            return  # waiting would not bring them all back
        back_to = self.checkpoints.newest_step(statuses, first, plan,
                                               lambda step: self.history.committing_epoch(step, current))
        if back_to is None or back_to + 1 < first:
            raise CutHoldsState(missing, holders, back_to, first)
