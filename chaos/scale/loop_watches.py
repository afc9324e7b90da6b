"""A simulated worker's two watches, as tasks of its node process's relay loop.

A real worker watches its epoch from two threads of its own: the epoch watcher
(`planaria.runtime.worker.epoch_watcher.EpochWatcher`: is the epoch over? the job's
progress) and, while a rendezvous operation waits, the rendezvous's abandon watch
(`planaria.runtime.worker.abandonable_store._AbandonWatch`). Thousands of simulated
workers in one process made those two threads an epoch each: at 1,024 nodes × 8, a
node process of 256 workers started 512 threads at every epoch while some 900 others
wanted its interpreter, and the starts alone took minutes (docs/benchmarks.md). Here
they are coroutines on the loop the node's relay serves on, making the same requests
through the worker's own relay connection (`InProcessRelayStore.call_async`), traced
into the worker's trace as a thread's would be (`TracingStore.traced_async`):
tests/chaos/test_scale_traffic.py compares them with a real worker's, key by key. Each
follows the runtime's loop step for step; where it differs (it awaits instead of
blocking), a comment says so.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Callable

from planaria.chaos.scale.cutoff import Killed
from planaria.chaos.scale.sim_relay import InProcessRelayStore
from planaria.elastic import node_relay_protocol as wire
from planaria.elastic.etcd_kv import store_bytes
from planaria.runtime.contract import keys
from planaria.runtime.contract.epochs import Progress
from planaria.runtime.contract.logs import error_line
from planaria.runtime.worker.coordination import StoreCoordinator
from planaria.runtime.worker.epoch_watcher import QUIET_S
from planaria.runtime.worker.store_trace import TracingStore


class LoopStore:
    """The requests of a worker's watches to its relay, awaited on the relay's loop and
    traced as `TracingStore` traces a thread's (`store`: the worker's store, traced or not)."""

    def __init__(self, store):
        self.trace = store if isinstance(store, TracingStore) else None
        self.relay: InProcessRelayStore = store.base if self.trace is not None else store
        self.loop = self.relay._relay.loop

    async def _ask(self, op: str, traced: tuple | None = None, wait_s: float = 0.0, **args):
        def call():
            return self.relay.call_async(op, wait_s, **args)
        if self.trace is None or traced is None:
            return await call()
        name, key, keys_, size = traced
        return await self.trace.traced_async(call, name, key, keys_, size)

    async def generation(self) -> int:
        return await self._ask("generation")

    async def wait_changed(self, since: int, timeout_s: float) -> bool:
        return await self._ask("wait_changed", wait_s=timeout_s, since=since, timeout_s=timeout_s)

    async def get_if_present(self, key: str) -> bytes | None:
        return wire.unpack(await self._ask("get_if_present", ("get_if_present", key, None, None), key=key))

    async def check(self, keys_: list[str]) -> bool:
        return await self._ask("check", ("check", None, keys_, None), keys_=list(keys_))

    async def set(self, key: str, value) -> None:
        data = store_bytes(value)
        await self._ask("set", ("set", key, None, len(data)), key=key, value=wire.pack(data))

    async def unfollow(self, key: str) -> None:
        await self._ask("unfollow", ("unfollow", key, None, None), key=key)


def watches_on_loop(store) -> bool:
    """Whether a worker over `store` can watch from its relay's loop (over a relay in this
    process; a simulated worker straight on etcd watches from threads, as a real one)."""
    base = store.base if isinstance(store, TracingStore) else store
    return isinstance(base, InProcessRelayStore)


class LoopEpochWatcher:
    """`EpochWatcher` as a task (module docstring): `start`, `requested`, `done` and
    `quiet_s` as its; the release on a failure is `release.release()`."""

    def __init__(self, coordinator: StoreCoordinator, store: LoopStore, epoch: int, release,
                 log: Callable[[str], None], period_s: float = 0.2,
                 progress: Callable[[], Progress | None] | None = None,
                 connect_ahead: Callable[[], threading.Event | None] | None = None):
        self.coordinator, self.store, self.epoch = coordinator, store, epoch
        self.connect_ahead = connect_ahead
        self.release, self.log, self.period_s, self.progress = release, log, period_s, progress
        self.quiet_s = QUIET_S
        self.requested, self.done = threading.Event(), threading.Event()
        self._published: tuple[Progress | None, float] = (None, 0.0)
        self._followed = False

    def start(self, followed: bool | None = None) -> None:
        """On the worker's thread, as `EpochWatcher.start`: the epoch's end followed first
        (so that the rendezvous's asks read the mirror; `followed`: already, by groups
        connected ahead), then the watch goes on the loop."""
        self._followed = self.coordinator.follow_epoch(self.epoch) if followed is None else followed
        asyncio.run_coroutine_threadsafe(self._run(), self.store.loop)

    async def _run(self) -> None:
        try:
            await self._watch()
        finally:
            try:
                await self.store.unfollow(keys.epoch_reconfigure(self.epoch))
            except (Killed, Exception):  # noqa: BLE001 - a dead worker's follows go with its connection
                pass

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            since = await self.store.generation()
            try:
                await self._publish_progress(loop.time())
                value = await self.store.get_if_present(keys.epoch_reconfigure(self.epoch))
                reason = None if value is None else value.decode()
            except Exception:  # noqa: BLE001 - the store is unreachable: ask again later
                reason = None
            if self.done.is_set():
                return
            if reason is None:
                if self._followed:
                    await self.store.wait_changed(since, self.period_s if self.progress else self.quiet_s)
                else:  # (the thread's `done.wait(period_s)`; `done` is looked at after the next read)
                    await asyncio.sleep(self.period_s)
                continue
            if reason == keys.JOIN and self.connect_ahead is not None:
                reason = await self._connected_ahead(reason)
                if reason is None:
                    return
            self.requested.set()
            if reason == keys.FAILURE and self.release is not None:
                done = self.release.release()
                self.log(f"epoch {self.epoch}: the control plane declared it failed; released "
                         f"its collectives ({done})")
            return

    async def _connected_ahead(self, reason: str) -> str | None:
        """`EpochWatcher._connected_ahead`: the connection starts off the loop (its requests
        are the worker's own, made from a thread as the real watcher's are); the wait for
        it looks at the word every period, as the thread's `wait(period_s)` does."""
        try:
            connecting = await asyncio.to_thread(self.connect_ahead)
        except Exception as err:  # noqa: BLE001 - as `EpochWatcher._connected_ahead`: the watch goes on
            self.log(f"epoch {self.epoch}: could not connect the next epoch's groups ahead "
                     f"({error_line(err)}); stopping without")
            return reason
        if connecting is None:
            return reason
        while not connecting.is_set():
            await asyncio.sleep(self.period_s)
            if connecting.is_set():
                break
            if self.done.is_set():
                return None
            try:
                value = await self.store.get_if_present(keys.epoch_reconfigure(self.epoch))
                reason = reason if value is None else value.decode()
            except Exception:  # noqa: BLE001 - the store away: the connection goes on
                pass
            if reason == keys.FAILURE:
                break
        return reason

    async def _publish_progress(self, now: float, every_s: float = 1.0) -> None:
        if self.progress is None or now - self._published[1] < every_s:
            return
        progress = self.progress()
        if progress is not None and progress != self._published[0]:
            await self.store.set(keys.PROGRESS, progress.to_json())
            self._published = (progress, now)


class LoopAbandonWatch:
    """`_AbandonWatch` as a task (module docstring): `running()` around each operation of
    the epoch's store (on the worker's thread), `fired`, `stop()`. While an operation has
    been under way `poll_s`, it asks whether the epoch is over (a `check` of its word,
    which the epoch watcher's follow makes a mirror's read), then waits for a change of
    what the relay follows for the worker; abandoned, it has `interrupt` called (off the
    loop: it looks through the process's sockets)."""

    def __init__(self, store: LoopStore, epoch: int, interrupt: Callable[[], None], poll_s: float,
                 change_wait_s: float):
        self.store, self.epoch, self.interrupt = store, epoch, interrupt
        self.poll_s, self.change_wait_s = poll_s, change_wait_s
        self.fired = False
        self._lock = threading.Lock()
        self._running = 0
        self._stopped = False
        self._started = False
        self._kick: asyncio.Event | None = None

    @contextlib.contextmanager
    def running(self):
        """Around an operation of the epoch's store, on the worker's thread."""
        self._enter()
        try:
            yield
        finally:
            self._exit()

    def _enter(self) -> None:
        with self._lock:
            self._running += 1
            start = not self._started and not self._stopped
            self._started = self._started or start
        if start:
            asyncio.run_coroutine_threadsafe(self._run(), self.store.loop)
        else:
            self.store.loop.call_soon_threadsafe(self._wake)

    def _exit(self) -> None:
        with self._lock:
            self._running -= 1

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        self.store.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        if self._kick is not None:
            self._kick.set()

    def _state(self) -> tuple[int, bool]:
        with self._lock:
            return self._running, self._stopped

    async def _run(self) -> None:
        self._kick = asyncio.Event()
        while True:
            running, stopped = self._state()
            if stopped:
                return
            if not running:  # (the thread's `wait_for(running or stopped)`)
                self._kick.clear()
                await self._kick.wait()
                continue
            since = await self._generation()
            await asyncio.sleep(self.poll_s)
            if not self._state()[0]:
                continue
            try:
                gone = await self.store.check([keys.epoch_reconfigure(self.epoch)])
            except Exception:  # noqa: BLE001 - the control plane's store is away: ask again
                gone = False
            if gone:
                self.fired = True
                await asyncio.get_running_loop().run_in_executor(None, self.interrupt)
                return
            if since is not None:
                try:
                    await self.store.wait_changed(since, self.change_wait_s)
                except Exception:  # noqa: BLE001 - as above
                    await asyncio.sleep(self.poll_s)

    async def _generation(self) -> int | None:
        try:
            return await self.store.generation()
        except Exception:  # noqa: BLE001 - the store is away: look every `poll_s` meanwhile
            return None

