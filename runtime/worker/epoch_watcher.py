"""The control plane's word on an epoch, watched off the training step: a worker learns
that its epoch is over (a join or leave: stop at the next step boundary; a failure:
release the epoch's blocked collectives) without any step waiting on the store, and
publishes the job's progress from the same thread.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable

from planaria.runtime.contract import keys
from planaria.runtime.contract.epochs import Progress
from planaria.runtime.contract.exits import EXIT_STUCK_AFTER_RELEASE
from planaria.runtime.contract.logs import error_line
from planaria.runtime.worker.coordination import StoreCoordinator


QUIET_S = 5.0
"""Over a store that follows the epoch's end, how long a watcher with no progress to
publish waits for a change before it looks again (the word wakes it at once): the
only cost of the wait is how late a watcher whose worker left the epoch ends."""


class EpochWatcher(threading.Thread):
    """Asks the control plane whether it ended this epoch (at every change of a followed
    key, else every `period_s`), off the training step: a step never waits on the store, and a store that is away (etcd down)
    only means that no word is seen until it is back.

    A join (`keys.JOIN`) sets `requested`: the commit of the current iteration carries
    it, and every worker stops after the same step; when the join's next epoch asks for
    its groups to be connected ahead (`connect_ahead`), only once they are, the epoch
    training meanwhile. A failure (`keys.FAILURE`) releases
    the epoch's collectives at once (`release`), wherever the main thread is blocked:
    a peer that stopped answering without closing anything holds nobody up past the
    controller's decision. Runs from before the epoch's rendezvous to after its groups
    are torn down, so that transfers and the rendezvous are released as steps are.

    A release that does not free the main thread within `stuck_s` ends the process
    (`EXIT_STUCK_AFTER_RELEASE`). It happens to a node cut off the network and back: by
    the time the decision reaches it, its peers' sockets are gone (their resets made its
    own unconnected, so there is nothing left to shut down), and gloo can wait on such a
    pair until the operation's timeout. Meanwhile its agent, back on etcd, shows the
    worker alive, the leader plans it in, and the whole job would wait for a worker that
    never arrives. A fresh worker costs only this worker's layers, which the plan that
    declared the epoch failed already does without."""

    def __init__(self, coordinator: StoreCoordinator, epoch: int, release, log: Callable[[str], None],
                 period_s: float = 0.2, stuck_s: float = 10.0, exit=os._exit,
                 progress: Callable[[], Progress | None] | None = None,
                 connect_ahead: Callable[[], threading.Event | None] | None = None):
        """`connect_ahead`: called at a join's word; an event set once the next epoch's
        groups are connected (or failed to), the stop waiting for it, or None when there
        is nothing to connect (`prepared_groups`)."""
        super().__init__(daemon=True, name=f"epoch-watcher-{epoch}")
        self.coordinator, self.epoch, self.period_s = coordinator, epoch, period_s
        self.progress, self._published = progress, (None, 0.0)
        self.connect_ahead = connect_ahead
        self.release, self.log = release, log
        self.stuck_s, self._exit = stuck_s, exit
        self.quiet_s = QUIET_S
        self.requested, self.done, self._local = threading.Event(), threading.Event(), threading.Event()
        self._followed = False

    def start(self, followed: bool | None = None) -> None:
        """`followed`: the epoch's word is followed already (True, or False where the store
        cannot follow it), by groups connected ahead for it (`ConnectAhead.take`): this
        watcher takes the follow over, and ends it as its own."""
        # Over etcd the epoch's end is followed: the polls below read a mirror, and a watch
        # wakes this thread at the word (docs/control_plane.md, "At scale"). Followed
        # before the thread starts, so that the rendezvous's own asks for the word (made
        # on the caller's thread next) read the mirror too: before, whether the first of
        # them came before the follow was a race between two threads, a request more
        # per worker when it lost.
        self._followed = self.coordinator.follow_epoch(self.epoch) if followed is None else followed
        super().start()

    def run(self) -> None:
        try:
            self._watch(self._followed)
        finally:
            self.coordinator.unfollow_epoch(self.epoch)

    def _watch(self, followed: bool) -> None:
        # Asked at once, then every period: an epoch can be over before it began (one that
        # a planned leave prepared, given up during the stop: `Controller._publish_prepared`).
        while True:
            since = self.coordinator.generation()
            try:
                self._publish_progress()
                reason = self.coordinator.epoch_over(self.epoch)
            except Exception:  # the store is unreachable: keep training, ask again later
                reason = None
            if self.done.is_set():
                # The worker has left the epoch: a word about it now must not release the
                # collectives of the next one (a release shuts down what the process opened).
                return
            if reason is None:
                if followed:  # woken by the word itself (or, to publish progress, each period)
                    self.coordinator.wait_changed(since, self.period_s if self.progress else self.quiet_s)
                elif self.done.wait(self.period_s):
                    return
                continue
            if reason == keys.JOIN and self.connect_ahead is not None:
                reason = self._connected_ahead(reason)
                if reason is None:
                    return
            self.requested.set()
            if reason == keys.FAILURE and self.release is not None:
                done = self.release.release()
                self.log(f"epoch {self.epoch}: the control plane declared it failed; released "
                         f"its collectives ({done})")
                self._exit_if_stuck()
            return

    def _connected_ahead(self, reason: str) -> str | None:
        """At a join's word: wait, the epoch training on, until the next epoch's groups
        are connected (`connect_ahead`), so that the stop at the step boundary holds no
        rendezvous. The word becoming a failure meanwhile (a peer lost) ends the wait; so
        does the worker leaving the epoch (None). The word that ends it."""
        try:
            connecting = self.connect_ahead()
        except Exception as err:  # noqa: BLE001 - the watch must go on: a later failure's release needs it
            # (A store error reading the prepared record, say: unguarded, it ended this
            # thread, and with it the release of the epoch's collectives at a failure.)
            self.log(f"epoch {self.epoch}: could not connect the next epoch's groups ahead "
                     f"({error_line(err)}); stopping without")
            return reason
        if connecting is None:
            return reason
        while not connecting.wait(self.period_s):
            if self.done.is_set():
                return None
            with contextlib.suppress(Exception):  # the store away: the connection goes on
                reason = self.coordinator.epoch_over(self.epoch) or reason
            if reason == keys.FAILURE:
                break
        return reason

    def _publish_progress(self, every_s: float = 1.0) -> None:
        """The job's progress (`keys.PROGRESS`), at most every `every_s`, when it moved:
        written from here, never from the step."""
        if self.progress is None or time.monotonic() - self._published[1] < every_s:
            return
        progress = self.progress()
        if progress is not None and progress != self._published[0]:
            self.coordinator.publish_progress(progress)
            self._published = (progress, time.monotonic())

    @contextlib.contextmanager
    def local_work(self):
        """Around work of the main thread that waits on no peer (building a model's layers
        can take minutes): a release does not free it, and it is not counted as stuck."""
        self._local.set()
        try:
            yield
        finally:
            self._local.clear()

    def _exit_if_stuck(self) -> None:
        while self.stuck_s and not self.done.wait(self.stuck_s):
            if not self._local.is_set():
                self.log(f"epoch {self.epoch}: its collectives did not return {self.stuck_s:.0f} s "
                         "after their release; this worker exits, to be started again as a new one")
                self._exit(EXIT_STUCK_AFTER_RELEASE)
                return
