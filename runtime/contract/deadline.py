"""A deadline for polling a store that may itself be away: both sides of the contract
wait on the store (workers for an epoch, the controller for statuses) and must not read
an outage of the control plane as the other side's silence."""
from __future__ import annotations

import time


class ReachableDeadline:
    """A deadline that counts only the time in which the store answered.

    Polling loops over the store (waiting for an epoch, for the workers' statuses) call
    `expired()` once per pass. A pass that took longer than `slack_s` means a store call
    blocked (etcd away, its client retrying); the excess moves the deadline, so that an
    outage of the control plane never reads as a worker's or a controller's silence."""

    def __init__(self, seconds: float, slack_s: float = 1.0):
        self.seconds, self.slack_s = seconds, slack_s
        self._deadline = time.monotonic() + seconds
        self._last = time.monotonic()

    def expired(self) -> bool:
        now = time.monotonic()
        stalled = now - self._last - self.slack_s
        if stalled > 0:
            self._deadline += stalled
        self._last = now
        return now > self._deadline
