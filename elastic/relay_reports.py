"""A node's workers' reports of an epoch, committed together: the relay's rule that keeps
the writes at a reconfiguration a constant per node.

At an epoch's end each of the node's workers writes its status, then its timing
(`keys.epoch_status`, `keys.epoch_timing`). The relay's group commit (`NodeRelay`'s
`linger_s`) joins the writes that arrive within a few milliseconds of each other, which
a node's workers, woken by the same watch, usually do; but where one of them is late
(its collective released a little later, a busy host), the node's reports go to etcd in
two, four, eight transactions, and the count per node grows with its workers.

So a report of epoch E is held until every worker of the node that is in E (it followed
E's end, `keys.epoch_reconfigure`: every worker that runs an epoch does) has written
the same kind of report for E or has gone (its last connection closed), or until
`linger_s` passed since the first. Holding costs the job nothing: the controller
plans only once every live worker's status is in, so it waits for the node's last
report anyway; a worker that never reports (hung) is waited for no longer than
`linger_s`, and not at all once its agent killed it. Runs on the relay's event loop
(no locks). Torch-free.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from planaria.runtime.contract import keys

LINGER_S = 5.0
"""How long a node's reports of an epoch wait for its late workers' (module docstring)."""

_EPOCHS_KEPT = 4
"""Epochs whose workers are remembered (older epochs' reports are not held)."""


@dataclass
class _Held:
    """One epoch's reports of one kind: who wrote one, and the writes not yet released."""

    reported: set[int] = field(default_factory=set)
    writes: list[tuple[str, bytes, asyncio.Future]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    expired: bool = False
    """`linger_s` passed: its later writes go at once."""


class EpochReports:
    """The node's workers of each epoch, and their reports held until the last is in."""

    def __init__(self, loop: asyncio.AbstractEventLoop, release: Callable[[list], None],
                 linger_s: float = LINGER_S):
        """`release`: given the writes (key, value, future) to commit, in one group."""
        self._loop, self._release, self.linger_s = loop, release, linger_s
        self._members: dict[int, dict[int, object]] = {}
        """{epoch: {id(connection): connection}}: the node's workers that followed its end."""
        self._held: dict[tuple[int, str], _Held] = {}

    def followed(self, conn, key: str) -> None:
        """`conn`'s worker followed `key`: if it is an epoch's end, the worker is in it."""
        epoch = keys.reconfigure_epoch(key)
        if epoch is None:
            return
        self._members.setdefault(epoch, {})[id(conn)] = conn
        for old in [e for e in self._members if e <= epoch - _EPOCHS_KEPT]:
            del self._members[old]
            self._forget(old)

    def hold(self, conn, key: str, value: bytes, done: asyncio.Future) -> bool:
        """Take the write if it is a report of an epoch `conn`'s worker is in (True; `done`
        is resolved when its group is committed), else leave it to the caller (False)."""
        report = keys.epoch_report(key)
        if report is None or id(conn) not in self._members.get(report[0], {}):
            return False
        held = self._held.setdefault(report, _Held())
        held.reported.add(id(conn))
        held.writes.append((key, value, done))
        if held.expired:
            self._flush(report)
            return True
        if held.timer is None:
            held.timer = self._loop.call_later(self.linger_s, self._expire, report)
        self._flush_if_complete(report)
        return True

    def gone(self) -> None:
        """A worker has no connection left: nobody waits for its reports any more."""
        for report in list(self._held):
            self._flush_if_complete(report)

    def _flush_if_complete(self, report: tuple[int, str]) -> None:
        members = self._members.get(report[0], {})
        held = self._held[report]
        waiting = [c for i, c in members.items() if i not in held.reported and c.connections > 0]
        if not waiting:
            self._flush(report)

    def _expire(self, report: tuple[int, str]) -> None:
        held = self._held.get(report)
        if held is not None:
            held.expired, held.timer = True, None
            self._flush(report)

    def _flush(self, report: tuple[int, str]) -> None:
        """Hand the held writes of `report` over (later ones of the same report are held
        again while a worker that has not reported is still connected)."""
        held = self._held.get(report)
        if held is None:
            return
        if held.timer is not None:
            held.timer.cancel()
            held.timer = None
        writes, held.writes = held.writes, []
        if writes:
            self._release(writes)

    def _forget(self, epoch: int) -> None:
        """An old epoch's reports: what is still held goes now, and nothing more is kept."""
        for report in [r for r in self._held if r[0] == epoch]:
            self._flush(report)
            del self._held[report]
