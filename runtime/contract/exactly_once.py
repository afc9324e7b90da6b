"""Exactly-once optimizer steps across failures (docs/recovery.md): statuses and the rule.

A worker steps iteration `k` only after its commit all-reduce for `k` completed. If
that all-reduce completed on any worker, every worker had entered it, so every
survivor holds fully synced gradients for `k`. After a failure each survivor reports:

- `last_stepped`: the last iteration whose optimizer step it applied (-1: none yet);
- `state` of iteration `last_stepped + 1`: `synced` (its gradient sync completed, its
  commit did not) or `incomplete`;
- `commit`: the commit record (loss, gradient norm) of `last_stepped`, so that a
  worker whose own commit all-reduce failed can apply the same step (None for a
  worker that joined after that step: it received the state, not the step);
- `holds`: the (layer, tp rank) shards whose state it holds at `last_stepped`;
- `snapshots`: the peer snapshots it keeps in host memory (`SnapshotHeld`): which
  shards, of which committed step, complete (one still arriving is not reported).

In the design's words, a worker with `last_stepped == k` "stepped" `k`. The rule
(`resolve`): let `K` be the largest `last_stepped`. Workers at `K - 1` must be
`synced` for `K` (anything else means the statuses contradict the commit protocol);
they step `K` now with the commit record of a worker that stepped it (roll forward).
The next plan starts at `K + 1`; gradients of any later, uncommitted iteration are
dropped and that iteration runs again. Every survivor then holds the state of step `K`,
so any of them can be the source of a layer.

The control plane (`planaria.elastic`) applies the rule; the workers report statuses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from planaria.runtime.contract.record import JsonRecord
from planaria.templates.plan import Worker

StepState = Literal["synced", "incomplete"]
SYNCED, INCOMPLETE = get_args(StepState)
STATES = get_args(StepState)


class InconsistentStatuses(RuntimeError):
    """The statuses contradict the commit protocol; resuming would break exactly-once."""


@dataclass(frozen=True)
class CommitRecord(JsonRecord):
    """What the commit all-reduce of one iteration agreed on."""

    iteration: int
    """0-based (a log's `step`)."""
    loss: float
    """The global batch's mean loss, summed over the pipelines in float64."""
    grad_norm: float
    """The global gradient norm before clipping: the step clips with it."""


@dataclass(frozen=True)
class SnapshotHeld(JsonRecord):
    """Layer shards of one committed step kept in a worker's host memory (a peer
    snapshot: `planaria.runtime.state.peer_snapshots`), or, in an epoch record, the step every
    worker restores from (`shards` empty there)."""

    commit: CommitRecord
    """The commit record of the step (its `iteration` is the step)."""
    epoch: int
    """The epoch that committed the step: only snapshots of the job's own history count
    (one of a timeline the job went back from never does; see the controller)."""
    shards: tuple[tuple[int, int], ...] = field(default=())
    """(layer, tp rank) shards held whole."""

    @property
    def step(self) -> int:
        return self.commit.iteration


@dataclass(frozen=True)
class WorkerStatus(JsonRecord):
    """A worker's report after its epoch ended (module docstring)."""

    worker: Worker
    """(node, local rank): a worker's name across epochs."""
    last_stepped: int
    state: StepState
    commit: CommitRecord | None = None
    holds: tuple[tuple[int, int], ...] = field(default=())
    finished: bool = False
    """It stepped the job's last iteration and is waiting for the job to end."""
    snapshots: tuple[SnapshotHeld, ...] = field(default=())
    """The peer snapshots it keeps (its own shards' and other nodes'), complete ones only."""

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {self.state!r}")
        if self.commit is not None and self.commit.iteration != self.last_stepped:
            raise ValueError(f"worker {self.worker} last stepped iteration {self.last_stepped} but "
                             f"reports the commit record of {self.commit.iteration}")


@dataclass(frozen=True)
class Resolution:
    """What the survivors do before the next epoch."""

    first_iteration: int
    """The iteration the next plan starts with."""
    roll_forward: CommitRecord | None
    """When set, workers whose `last_stepped` is one less apply this step first."""


def resolve(statuses: list[WorkerStatus]) -> Resolution:
    """The exactly-once rule over the survivors' statuses (module docstring)."""
    if not statuses:
        raise InconsistentStatuses("no survivor reported its status")
    newest = max(s.last_stepped for s in statuses)
    behind = [s for s in statuses if s.last_stepped != newest]
    for s in behind:
        if s.last_stepped != newest - 1 or s.state != SYNCED:
            raise InconsistentStatuses(
                f"worker {s.worker} last stepped iteration {s.last_stepped} ({s.state} after it) "
                f"while another stepped {newest}: a step was committed without it")
    if not behind:
        return Resolution(first_iteration=newest + 1, roll_forward=None)
    record = next((s.commit for s in statuses if s.last_stepped == newest and s.commit), None)
    if record is None:
        raise InconsistentStatuses(f"iteration {newest} must be rolled forward, but no worker that "
                                   "stepped it reports its commit record")
    return Resolution(first_iteration=newest + 1, roll_forward=record)
