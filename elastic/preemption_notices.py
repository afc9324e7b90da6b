"""A node's preemption notice, as its agent handles it: received, posted for the
leader, served (the node leaves at a step boundary), or withdrawn (docs/spot.md).

    notice/<member>         this node's notice (`LeaveNotice`), bound to its agent's lease

A notice comes from a signal (`--preemption-notice signal`: a signal of
`--preemption-signals` means "gone in `--preemption-grace` seconds"; the same signal
again stops the node at once) or from the cloud's metadata (`planaria.elastic.preemption`,
asked every `NOTICE_POLL_S` from a thread). The agent posts it under its lease, so it
goes with the node; the leader plans the node out at a step boundary, its workers hand
their layers over and exit, and then the agent leaves. A notice the cloud takes back
before then is deleted, and the node stays.

`PreemptionNotices` owns this node's notice and the leader's reading of every node's.
Imports no torch (a node's agent loads it).
"""
from __future__ import annotations

import signal
import threading
import time
from typing import TYPE_CHECKING, Callable

from planaria.elastic.etcd_client import EtcdClient
from planaria.elastic.preemption import Notice, signal_notice
from planaria.runtime.contract import keys
from planaria.runtime.contract.membership import LeaveNotice

if TYPE_CHECKING:
    from planaria.elastic.preemption import _Watcher

NOTICE_POLL_S = 2.0
"""How often a cloud's metadata is asked for a notice (AWS advises every 5 s; GCP's
answer waits for a change itself)."""


class PreemptionNotices:
    """This node's notice, from a signal or the cloud, and the posted notices of all."""

    def __init__(self, client: EtcdClient, prefix: str, *, watcher: _Watcher | None, grace_s: float,
                 signals: list[signal.Signals], log: Callable[[str], None], store=None):
        """`signals`: those read as a notice (none: every signal stops the node at once);
        `store`: the job's `EtcdKeyValue` (the leader's follows the notices: `posted`
        reads them of its mirror), or None: read through `client`."""
        self.client, self.prefix, self.log, self.store = client, prefix, log, store
        self.watcher = watcher
        """The cloud's notice watcher (`preemption.make_watcher`; None for `signal`: `on_signal` is it)."""
        self.grace_s = grace_s
        self.signals = signals
        """Signals that mean "gone in `grace_s`" (a planned leave) rather than "stop now"."""
        self.notice: Notice | None = None
        self._signal: int | None = None
        self._posted = False
        self._withdrawn = False
        self._read: tuple[float, dict[str, LeaveNotice]] = (-1.0, {})

    @property
    def pending(self) -> bool:
        return self.notice is not None

    def on_signal(self, signum: int) -> bool:
        """True when `signum` is a notice (the first of `signals`), not a stop: the node
        leaves at a step boundary within the grace period (`serve`)."""
        if signum in self.signals and self.notice is None:
            self.notice = signal_notice(signal.Signals(signum).name, self.grace_s)
            self._signal = signum
            return True
        return False

    def watch(self, stop: threading.Event) -> None:
        """The cloud's word, asked every `NOTICE_POLL_S` until `stop` (a watcher never
        raises): a notice becomes this node's; one that goes away again before the node
        left is withdrawn."""
        while not stop.wait(NOTICE_POLL_S):
            notice = self.watcher.poll()
            if notice is not None and self.notice is None:
                self._withdrawn = False
                self.notice = notice
            elif (notice is None and self.watcher.answered and self.notice is not None
                  and self._signal is None):  # (not when the metadata could not say)
                self._withdrawn = True

    def post_again(self) -> None:
        """The lease was replaced: a notice goes with its lease, so it is posted again
        under the new one."""
        self._posted = False

    def serve(self, member: str, lease, running: Callable[[], list], leave: Callable[[int], object]) -> int | None:
        """This node has a notice: post it for the leader under `lease` (it goes with the
        node), then `leave` once the workers have left (they hand their layers over first:
        `ElasticWorker._leave`), or stop them at the deadline if they are still there; the
        agent's exit code then. A withdrawn notice is taken back while the workers still
        train."""
        notice = self.notice
        key = self.prefix + keys.notice(member)
        if self._withdrawn:
            self.log(f"the preemption notice ({notice.source}) was withdrawn; this node stays in the job")
            self.client.delete(key)
            self.notice, self._posted, self._withdrawn = None, False, False
            return None
        if not self._posted:
            self.log(f"preemption notice ({notice.detail or notice.source}): the node leaves the job at a "
                     f"step boundary within {notice.left_s():.0f} s")
            record = LeaveNotice(source=notice.source, deadline=notice.deadline, posted=time.time())
            self.client.put(key, record.to_json().encode(), lease=lease)
            self._posted = True
        code = 128 + self._signal if self._signal is not None else 0
        if not running():
            self.log("this node's workers have left; the node leaves the job")
        elif notice.left_s() <= 1.0:
            self.log("the notice's deadline is here and this node's workers still run; stopping them")
            code = code or 1
        else:
            return None
        leave(signal.SIGKILL)
        if self.watcher is not None:
            self.watcher.acknowledge(notice)  # Azure need not wait for NotBefore
        return code

    def posted(self) -> dict[str, LeaveNotice]:
        """{node: its notice}, for the controller (read at most four times a second)."""
        read_at, notices = self._read
        if time.monotonic() - read_at >= 0.25:
            if self.store is not None:
                found = {key[len(keys.NOTICE):]: value for key, value in self.store.items_under(keys.NOTICE).items()}
            else:
                found = self.client.items_with_prefix(self.prefix + keys.NOTICE)
            notices = {node: LeaveNotice.from_json(value) for node, value in found.items()}
            self._read = (time.monotonic(), notices)
        return notices
