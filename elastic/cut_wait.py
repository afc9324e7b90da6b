"""A cut is not a death (issue 45): before the job goes back to older state, it waits
for nodes it cannot reach that may hold the layers it lacks.

When the nodes the leader can plan over hold neither every layer shard nor a peer
snapshot as new as the job's progress, those layers may still live in the memory of
nodes that are only out of reach:

- nodes alive in etcd, on the other side of a partition (the controller's `cut_off`);
  their statuses are in, so what they hold is known exactly;
- nodes whose lease lapsed and that no probe found dead: a node whose agent is gone
  refuses a probe's connection (`peer_probe.PeerProbe.gone`), a node cut off the network
  lets it time out. What such a node may hold is its ranks' layers in the failed epoch's
  plan.

If those nodes between them hold every missing shard, the controller publishes nothing
and asks again at each poll (the failed epoch's statuses standing), as it does below
the minimum (`node_wait`): a node that comes back reports its status for the failed
epoch, and the next plan copies its layers instead of training steps again. A machine
that vanished looks the same as one cut off, so the wait is bounded
(`fault_tolerance.cut_wait_s`, 60 s by default): past it the job goes back to the peer
snapshots or the disk as before, or fails where neither has the state. Only a wait
that saves work is made: a restore that trains no step again needs no wait.
Loaded by an agent, through the controller: no torch.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Callable

from planaria.runtime.contract.exactly_once import WorkerStatus
from planaria.templates.plan import Plan, Worker

LIMIT_S = 60.0
"""How long the job waits for cut-off nodes that may hold the only live copies of some
layers (`fault_tolerance.cut_wait_s`)."""

Shard = tuple[int, int]


def may_hold(plan: Plan, members: Iterable[Worker], statuses: Mapping[Worker, WorkerStatus],
             planned: Iterable[str], cut_off: Iterable[str], alive: set[Worker],
             gone: set[str]) -> dict[Worker, set[Shard]]:
    """{worker: the shards it may hold} of the failed epoch's workers that are out of
    reach but maybe alive (module docstring): on a node of `cut_off`, or not `alive`,
    on a node neither `gone` nor `planned`. What its status says it holds, or without
    one (it could not report), its rank's layers in the failed plan."""
    planned, cut_off = set(planned), set(cut_off)
    rank_of = plan.rank_of_worker()
    found: dict[Worker, set[Shard]] = {}
    for worker in members:
        node = worker[0]
        if node in planned or node in gone:
            continue
        if node not in cut_off and worker in alive:
            continue  # reachable and alive: it reported
        if worker in statuses:
            found[worker] = {tuple(shard) for shard in statuses[worker].holds}
        elif worker in rank_of:
            rank = rank_of[worker]
            tp_rank = plan.rank_info(rank).tp_rank
            found[worker] = {(layer, tp_rank) for layer in plan.layers_of(rank)}
    return {w: shards for w, shards in found.items() if shards}


class CutWait:
    """The controller's wait for cut-off holders (module docstring)."""

    def __init__(self, limit_s: float = LIMIT_S, log: Callable[[str], None] = print):
        self.limit_s, self.log = limit_s, log
        self.since: float | None = None
        self.detected = 0.0
        """When the controller detected the change it waits to plan (its first try)."""
        self._said: tuple | None = None

    @property
    def waited_s(self) -> float | None:
        return None if self.since is None else time.time() - self.since

    def wait(self, missing: list[Shard], holders: Mapping[Worker, set[Shard]], back_to: int | None,
             first: int, detected: float) -> bool:
        """True while the job may wait for `holders`' nodes, which between them hold
        every `missing` shard (the caller checked); said once per set of nodes. False
        once `limit_s` passed: the job goes back to step `back_to` (None: no state)."""
        now = time.time()
        if self.since is None:
            self.since, self.detected = now, detected
        nodes = sorted({w[0] for w in holders})
        instead = ("fail" if back_to is None
                   else f"go back to step {back_to} ({first - 1 - back_to} step(s) trained again)")
        if self._said != (tuple(nodes), tuple(missing)):
            self._said = (tuple(nodes), tuple(missing))
            self.log(f"controller: layer shards {missing} are held only by {nodes}, out of reach but not "
                     f"known dead (cut off, or out of etcd with no probe refused); waiting up to "
                     f"{self.limit_s:g} s (fault_tolerance.cut_wait_s) for them to come back rather than "
                     f"{instead}")
        if now - self.since < self.limit_s:
            return True
        self.log(f"controller: {nodes} did not come back within {self.limit_s:g} s; the job will {instead}")
        self._forget()
        return False

    def over(self) -> float | None:
        """The job goes on (the nodes came back, or it stopped waiting): how long it
        waited, or None when it did not."""
        waited = self.waited_s
        if waited is not None:
            self.log(f"controller: the nodes out of reach came back after {waited:.1f} s; their layers are "
                     "copied, no step is trained again")
        self._forget()
        return waited

    def _forget(self) -> None:
        self.since, self._said = None, None
