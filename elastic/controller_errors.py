"""How a controller stops acting: it steps down (another leader took over, or its node is
going away), or the job cannot go on. Shared by the controller and the modules it
decides with; the leader's agent catches `StepDown`.
"""
from __future__ import annotations


class StepDown(RuntimeError):
    """This controller stops leading; whatever it had not published is redone by the
    next leader (nothing it publishes is half-done: see `Controller._publish`)."""


class StaleLeader(StepDown):
    """Another controller published an epoch this one did not know of."""


class Interrupted(StepDown):
    """The leader's node is going away (its agent got a signal) in the middle of a wait."""


class JobFailed(RuntimeError):
    """The job cannot go on; the message says why and what would fix it."""


class CutHoldsState(Exception):
    """Layer shards no reachable worker holds are held by nodes out of reach but maybe
    alive (`cut_wait`): the controller may wait for them rather than go back to `back_to`
    (None: no older state)."""

    def __init__(self, missing: list, holders: dict, back_to: int | None, first: int):
        super().__init__(f"layer shards {missing} are held only by nodes out of reach")
        self.missing, self.holders, self.back_to, self.first = missing, holders, back_to, first
