"""A store whose blocking reads give up when told to: an epoch's process-group rendezvous
that the control plane can abandon (`planaria.runtime.worker.coordination`)."""
from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta

import torch.distributed as dist


class AbandonableStore(dist.Store):
    """`base`, whose blocking reads (`get`, `wait`) give up with a DistStoreError when
    `abandoned()` turns true. Written here because c10d's stores only give up on their
    timeout, and a rendezvous cannot be interrupted from outside.

    Two ways, by what `base` can do:
    - a base that can interrupt its own blocked operations (`interrupt(why)`: an epoch's
      TCPStore, `planaria.runtime.worker.epoch_store.EpochStoreClient`) runs them
      itself: a wait is one request that its server answers when the keys are set. A
      watch thread asks `abandoned()` every `poll_s` while an operation has been under
      way that long, and interrupts the base when it turns true. Its server is polled
      by nobody, which at thousands of ranks on one host matters;
    - any other base (the job's TCPStore under a prefix) is polled: `check` every
      `poll_s` until the keys are there, `abandoned()` between two."""

    def __init__(self, base: dist.Store, abandoned, message: str, poll_s: float = 0.01, changes=None,
                 change_wait_s: float | None = None, make_watch=None):
        """`changes`: where `abandoned()` reads a mirror that a watch keeps (the control
        plane's store follows the epoch's end): `(generation, wait_changed)`, the
        store's, so that the watch waits for the word instead of asking every `poll_s`;
        `change_wait_s`: how long it waits for a change before it looks anyway
        (`CHANGE_WAIT_S` by default). `make_watch(interrupt, poll_s, change_wait_s)`:
        the watch of an interruptible base, when not a thread of its own (`_AbandonWatch`:
        the scale harness runs thousands of them as tasks of one event loop; it has
        `running()`, `fired` and `stop()`)."""
        super().__init__()
        self.base, self.abandoned, self.message, self.poll_s = base, abandoned, message, poll_s
        interrupt = getattr(base, "interrupt", None)
        change_wait_s = CHANGE_WAIT_S if change_wait_s is None else change_wait_s
        if interrupt is None:
            self._watch = None
        elif make_watch is not None:
            self._watch = make_watch(lambda: interrupt(message), poll_s, change_wait_s)
        else:
            self._watch = _AbandonWatch(abandoned, lambda: interrupt(message), poll_s, changes, change_wait_s)

    def _wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self.base.timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self.base.check(keys):
            if self.abandoned():
                raise dist.DistStoreError(f"{self.message} (waiting for {keys})")
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"wait timeout after {limit * 1000:.0f}ms, keys: {keys}")
            time.sleep(self.poll_s)

    def _op(self, keys: list[str], operation):
        """An operation of an interruptible base, under the watch: abandoned meanwhile, it
        fails saying so (whatever the interrupted connection raised)."""
        with self._watch.running():
            try:
                return operation()
            except dist.DistError as err:
                if self._watch.fired:
                    raise dist.DistStoreError(f"{self.message} (waiting for {keys})") from err
                raise

    def set(self, key, value) -> None:
        if self._watch is None:
            return self.base.set(key, value)
        self._op([key], lambda: self.base.set(key, value))

    def get(self, key) -> bytes:
        if self._watch is None:
            self._wait([key])
            return self.base.get(key)
        return self._op([key], lambda: self.base.get(key))

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        keys = list(keys)
        if self._watch is None:
            return self._wait(keys, timeout)
        self._op(keys, lambda: self.base.wait(keys, timeout))

    def check(self, keys) -> bool:
        if self._watch is None:
            return self.base.check(keys)
        return self._op(list(keys), lambda: self.base.check(keys))

    def add(self, key, amount: int) -> int:
        if self._watch is None:
            return self.base.add(key, amount)
        return self._op([key], lambda: self.base.add(key, amount))

    def compare_set(self, key, expected, desired) -> bytes:
        if self._watch is None:
            return self.base.compare_set(key, expected, desired)
        return self._op([key], lambda: self.base.compare_set(key, expected, desired))

    def delete_key(self, key) -> bool:
        return self.base.delete_key(key)

    def num_keys(self) -> int:
        return self.base.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.base.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self.base.timeout

    def close(self) -> None:
        """The epoch is over for this worker: its base closed (if it can be), the watch ended."""
        if self._watch is not None:
            self._watch.stop()
        close = getattr(self.base, "close", None)
        if close is not None:
            close()


CHANGE_WAIT_S = 1.0
"""With `changes`, how long the watch waits for a change before it looks anyway (a guard:
the word wakes it at once)."""


class _AbandonWatch:
    """A thread that calls `interrupt()` once `abandoned()` is true while an operation is
    under way (`running`). It looks only at operations that lasted `poll_s`: an operation
    that returns at once (most of a rendezvous's) costs no look. Then every `poll_s`, or,
    given `changes` (`AbandonableStore`), at each change of what the store follows: a
    worker waiting for its peers asks its node's relay once, not a hundred times a second
    (at 8 workers a node, thousands of nodes waiting in an epoch's bootstrap, that was
    most of what the relays served)."""

    def __init__(self, abandoned, interrupt, poll_s: float, changes=None, change_wait_s: float = 1.0):
        self.abandoned, self.interrupt, self.poll_s = abandoned, interrupt, poll_s
        self.changes, self.change_wait_s = changes, change_wait_s
        self.fired = False
        self._running = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    @contextlib.contextmanager
    def running(self):
        with self._cond:
            self._running += 1
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, daemon=True, name="rendezvous-abandon-watch")
                self._thread.start()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._running or self._stopped)
                if self._stopped:
                    return
            since = self._generation()
            time.sleep(self.poll_s)
            with self._cond:
                if not self._running:
                    continue
            try:
                gone = self.abandoned()
            except Exception:  # noqa: BLE001 - the control plane's store is away: ask again
                gone = False
            if gone:
                self.fired = True
                self.interrupt()
                return
            if since is not None:
                self._wait_changed(since)

    def _generation(self) -> int | None:
        if self.changes is None:
            return None
        try:
            return self.changes[0]()
        except Exception:  # noqa: BLE001 - the store is away: look every `poll_s` meanwhile
            return None

    def _wait_changed(self, since: int) -> None:
        try:
            self.changes[1](since, self.change_wait_s)
        except Exception:  # noqa: BLE001 - as above
            time.sleep(self.poll_s)
