"""A node's relay to etcd: its agent serves the job's store to the node's workers.

Without it, every worker is an etcd client of its own: at a reconfiguration each of a
node's eight workers reads the same epoch record, follows the same keys (a Range and a
watch each), and writes its status and timing in a request of its own, so that etcd's
load per reconfiguration grows with the workers, not the nodes (docs/control_plane.md,
"At scale"). The relay answers the node's workers from one etcd client, the agent's:

- keys a worker follows are followed once per node (counted per worker; a key nobody
  follows any more is kept for `unfollow_linger_s`, as the workers of a node follow and
  drop an epoch's keys one after another), and their reads and waits cost no request;
- a key the contract writes once (`keys.written_once`: an epoch's record, a prepared
  record, the epoch store's address) is read once per node: simultaneous reads share
  one request, later ones are answered from what it found;
- writes (`set`) are committed in groups: those that arrive while one is on its way,
  or within `linger_s` of the first, go in one transaction (within etcd's limits); a
  worker's status or timing of an epoch waits for its node's other workers' of that
  epoch (`planaria.elastic.relay_reports`), so that a reconfiguration costs etcd a few
  transactions per node whatever the node's workers and however late one of them is;
- anything else (`add`, `compare_set`, a key not followed) goes to etcd as it would
  from the worker, one request each.

What a worker sees is what it saw over etcd: the same keys and values, waits woken by
the same changes (`generation`/`wait_changed`), errors of the same kinds (a wait's
timeout, a write over etcd's limits). Writes are acknowledged once etcd has them.

Why hand-written: etcd's own gRPC proxy coalesces watches, but forwards every write and
every linearizable read, so a node's statuses and record reads would still cost one
request per worker; nothing else serves a `torch.distributed.Store`'s operations over
one shared etcd client. The protocol is `planaria.elastic.node_relay_protocol`'s; the
worker's side, `planaria.elastic.node_relay_store`. Torch-free: the agent runs it.

It serves on asyncio, one task per connection and no thread per worker; calls that
block (etcd requests, a mirror's first read) run on a small pool. One loop can serve
many relays (the scale harness runs a thousand nodes' relays on one).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from planaria.elastic import node_relay_protocol as wire
from planaria.elastic.etcd_kv import EtcdKeyValue
from planaria.elastic.etcd_limits import EtcdLimitExceeded
from planaria.elastic.relay_reports import LINGER_S as REPORT_LINGER_S, EpochReports
from planaria.runtime.contract import keys
from planaria.runtime.contract.store_reads import poll_pause

_log = logging.getLogger("planaria.relay")
_POLL_S, _FAST_FOR_S = 0.01, 0.1
_KEPT_ONCE = 16
"""Written-once values kept (an epoch's record and its neighbours: older epochs are
never read again)."""


@dataclass
class _Worker:
    """A worker's connections and follows: its follows go when its last connection does."""

    connections: int = 0
    followed: collections.Counter = field(default_factory=collections.Counter)


class NodeRelay:
    """Serves the job's store (`store`, the agent's) to the node's workers (module
    docstring). `start()` it, give the workers `url`, `close()` it with the agent."""

    def __init__(self, store: EtcdKeyValue, *, host: str = "127.0.0.1", linger_s: float = 0.002,
                 unfollow_linger_s: float = 10.0, loop: asyncio.AbstractEventLoop | None = None,
                 pool_threads: int = 4, token: str | None = None, report_linger_s: float = REPORT_LINGER_S):
        """`loop`: an event loop running on a thread of its own, shared with other relays
        (None: one of the relay's own). `linger_s`: how long a write waits for others to
        commit with. `report_linger_s`: how long an epoch's reports wait for the node's
        late workers' (`relay_reports`)."""
        self.store, self.host = store, host
        self.linger_s, self.unfollow_linger_s = linger_s, unfollow_linger_s
        self.report_linger_s = report_linger_s
        self._reports: EpochReports | None = None
        """The node's workers' reports of each epoch, held until the last is in (made on the loop)."""
        self.token = token or secrets.token_hex(16)
        self._own_loop = loop is None
        self._closed = False
        self._loop = loop
        self._pool = ThreadPoolExecutor(max_workers=pool_threads, thread_name_prefix="relay")
        self._server: asyncio.AbstractServer | None = None
        self.port = 0
        self._connections: set[asyncio.StreamWriter] = set()
        self._workers: dict[str, _Worker] = {}
        # What the node's workers follow: {key: workers' count}, the keys the relay
        # followed itself (the agent's own it never drops), pending drops.
        self._follows: collections.Counter = collections.Counter()
        self._owned: set[str] = set()
        self._drops: dict[str, asyncio.TimerHandle] = {}
        self._following: dict[str, asyncio.Future] = {}
        self._once: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._reading: dict[str, asyncio.Future] = {}
        self._pending: list[tuple[str, bytes, asyncio.Future]] = []
        self._flushing = False
        self._change: asyncio.Future | None = None
        self._generation = 0
        """Changes of keys the node's workers follow, so far (their `generation`)."""
        self.counts = collections.Counter()
        """What the relay sent to etcd and what it answered itself, by kind."""

    # ------------------------------------------------------------------ life
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def url(self) -> str:
        return wire.relay_url(self.host, self.port, self.token)

    def start(self, timeout_s: float = 30.0) -> "NodeRelay":
        if self._own_loop:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, daemon=True, name="node-relay").start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout_s)
        self.store.on_any_change(self._wake)
        return self

    async def _serve(self) -> None:
        self._change = self._loop.create_future()
        self._reports = EpochReports(self._loop, self._commit, self.report_linger_s)
        self._server = await asyncio.start_server(self._handle, self.host, 0, limit=2**16)
        self.port = self._server.sockets[0].getsockname()[1]

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving: every worker's connection closes (its next request fails)."""
        if self._loop is None or self._loop.is_closed() or self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout_s)
        except Exception:  # noqa: BLE001 - closing what may be gone already
            pass
        if self._own_loop:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._pool.shutdown(wait=False, cancel_futures=True)
        owned, self._owned = list(self._owned), set()
        for key in owned:  # its watches end with it
            self.store.unfollow(key)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):
            writer.close()
        for handle in self._drops.values():
            handle.cancel()

    # ------------------------------------------------------------------ connections
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn: _Worker | None = None
        self._connections.add(writer)
        try:
            conn = await self._hello(reader, writer)
            if conn is None:
                return
            while True:
                request = await _read(reader)
                if request is None:
                    return
                writer.write(wire.encode(await self.answer(conn, request)))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._connections.discard(writer)
            writer.close()
            if conn is not None:
                self.disconnected(conn)

    async def _hello(self, reader, writer) -> _Worker | None:
        """The worker's first frame: the relay's token, and a name for its connections."""
        hello = await _read(reader)
        if hello is None or not secrets.compare_digest(str(hello.get("token", "")), self.token):
            writer.write(wire.encode({"error": "refused", "message": ("wrong or missing token for this node's relay: a worker reaches it only with the "
                                                       "PLANARIA_STORE URL its agent started it with (node://host:port/token)")}))
            await writer.drain()
            return None
        conn = self.connected(str(hello.get("worker", "?")))
        writer.write(wire.encode({"ok": self.limits()}))
        await writer.drain()
        return conn

    def connected(self, name: str) -> _Worker:
        """A new connection of the worker `name` (on the relay's loop)."""
        conn = self._workers.setdefault(name, _Worker())
        conn.connections += 1
        return conn

    def limits(self) -> dict:
        """etcd's request limits, as a worker's store tells its callers."""
        limits = self.store.limits
        return {"max_request_bytes": limits.max_request_bytes, "max_txn_ops": limits.max_txn_ops,
                "user": limits.user}

    def disconnected(self, conn: _Worker) -> None:
        """A connection of `conn`'s worker closed (on the relay's loop)."""
        conn.connections -= 1
        if conn.connections > 0:
            return
        for name, known in list(self._workers.items()):
            if known is conn:
                del self._workers[name]
        for key, count in conn.followed.items():  # a worker gone takes its follows with it
            for _ in range(count):
                self._release(key)
        conn.followed.clear()
        if self._reports is not None:
            self._reports.gone()

    async def answer(self, conn: _Worker, request: dict) -> dict:
        """The answer to one request of `conn`'s worker (on the relay's loop)."""
        op = request.get("op")
        handler = getattr(self, f"_op_{op}", None)
        if handler is None:
            return {"error": "failed", "message": f"the node relay has no operation {op!r}"}
        try:
            return {"ok": await handler(conn, **request.get("args", {}))}
        except TimeoutError as err:
            return {"error": "timeout", "message": str(err)}
        except EtcdLimitExceeded as err:
            return {"error": "limit", "message": str(err)}
        except Exception as err:  # noqa: BLE001 - said to the worker, who raises it
            return {"error": "failed", "message": f"{type(err).__name__}: {err}"}

    def _blocking(self, fn, *args):
        return self._loop.run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------------ reads
    def _local(self, key: str) -> tuple[bool, bytes | None]:
        """(answered here, value): from a mirror or a written-once value, no request."""
        if key in self._once:
            self.counts["answered"] += 1
            return True, self._once[key]
        if self.store.followed_key(key):
            self.counts["answered"] += 1
            return True, self.store.get_if_present(key)
        return False, None

    async def _read(self, key: str) -> bytes | None:
        answered, value = self._local(key)
        if answered:
            return value
        if not keys.written_once(key):
            self.counts["reads"] += 1
            return await self._blocking(self.store.get_if_present, key)
        shared = self._reading.get(key)
        if shared is None:
            shared = self._reading[key] = self._loop.create_future()
            try:
                self.counts["reads"] += 1
                value = await self._blocking(self.store.get_if_present, key)
            except Exception as err:  # noqa: BLE001 - given to everyone who waited on it
                shared.set_exception(err)
                shared.exception()  # retrieved: no "never retrieved" warning if nobody shared it
                raise
            finally:
                self._reading.pop(key, None)
            if value is not None:
                self._keep(key, value)
            shared.set_result(value)
            return value
        value = await asyncio.shield(shared)
        # Absent from a read that began before this one asked: ask again, alone.
        return value if value is not None else await self._blocking(self.store.get_if_present, key)

    def _keep(self, key: str, value: bytes) -> None:
        self._once[key] = value
        while len(self._once) > _KEPT_ONCE:
            self._once.popitem(last=False)

    async def _op_get_if_present(self, conn, key: str):
        return wire.pack(await self._read(key))

    async def _op_get(self, conn, key: str, timeout_s: float):
        """The value once present; TimeoutError after `timeout_s`."""
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            since = self._generation
            value = await self._read(key)
            if value is not None:
                return wire.pack(value)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"wait timeout after {timeout_s * 1000:.0f}ms, keys: [{key!r}] "
                                   f"(node relay of etcd {self.store.client.endpoint})")
            if self.store.followed_key(key):
                await self._until_changed(since, left)
            else:
                await asyncio.sleep(min(left, poll_pause(started, _FAST_FOR_S, _POLL_S)))

    async def _op_check(self, conn, keys_: list[str]):
        for key in keys_:
            if await self._read(key) is None:
                return False
        return True

    async def _op_items_under(self, conn, prefix: str):
        if self.store.followed_key(prefix):
            self.counts["answered"] += 1
        else:
            self.counts["reads"] += 1
        items = await self._blocking(self.store.items_under, prefix)
        return {key: wire.pack(value) for key, value in items.items()}

    async def _op_num_keys(self, conn):
        self.counts["reads"] += 1
        return await self._blocking(self.store.num_keys)

    # ------------------------------------------------------------------ writes
    async def _op_set(self, conn, key: str, value: str):
        done = self._loop.create_future()
        if not self._reports.hold(conn, key, wire.unpack(value), done):
            self._commit([(key, wire.unpack(value), done)])
        await done
        return None

    def _commit(self, writes: list[tuple[str, bytes, asyncio.Future]]) -> None:
        """Into the next group commit."""
        self._pending.extend(writes)
        if not self._flushing:
            self._flushing = True
            self._loop.create_task(self._flush())

    async def _flush(self) -> None:
        """Group commit: while writes wait, one transaction of them (the last value of a
        key written twice meanwhile), within etcd's limits (`EtcdClient.put_many`)."""
        try:
            while self._pending:
                await asyncio.sleep(self.linger_s)
                batch, self._pending = self._pending, []
                latest = {key: value for key, value, _ in batch}
                try:
                    self.counts["writes"] += await self._blocking(self.store.set_many, list(latest.items()))
                    self.counts["sets"] += len(batch)
                except Exception as err:  # noqa: BLE001 - every writer of the batch hears it
                    for _, _, done in batch:
                        if not done.done():
                            done.set_exception(err)
                    continue
                for _, _, done in batch:
                    if not done.done():
                        done.set_result(None)
        finally:
            self._flushing = False

    async def _op_add(self, conn, key: str, amount: int):
        self.counts["writes"] += 1
        return await self._blocking(self.store.add, key, int(amount))

    async def _op_compare_set(self, conn, key: str, expected: str, desired: str):
        self.counts["writes"] += 1
        found = await self._blocking(self.store.compare_set, key, wire.unpack(expected), wire.unpack(desired))
        return wire.pack(found)

    async def _op_compare_set_bytes(self, conn, key: str, expected: str, desired: str):
        return self.store.compare_set_bytes(key, wire.unpack(expected), wire.unpack(desired))

    async def _op_delete_key(self, conn, key: str):
        self.counts["writes"] += 1
        return await self._blocking(self.store.delete_key, key)

    # ------------------------------------------------------------------ follows
    async def _op_follow(self, conn, key: str, prefix: bool = False):
        self._reports.followed(conn, key)
        conn.followed[key] += 1
        self._follows[key] += 1
        handle = self._drops.pop(key, None)
        if handle is not None:
            handle.cancel()
        if self.store.following(key):
            return None
        pending = self._following.get(key)
        if pending is None:
            pending = self._following[key] = self._loop.create_future()
            try:
                self.counts["follows"] += 1
                await self._blocking(self.store.follow, key, prefix)
                self._owned.add(key)
                pending.set_result(None)
            except Exception as err:  # noqa: BLE001 - the worker polls instead (store_reads.follow)
                conn.followed[key] -= 1
                self._follows[key] -= 1
                pending.set_exception(err)
                pending.exception()
                raise
            finally:
                self._following.pop(key, None)
        else:
            await asyncio.shield(pending)
        return None

    async def _op_unfollow(self, conn, key: str):
        if conn.followed[key] > 0:
            conn.followed[key] -= 1
            self._release(key)
        return None

    def _release(self, key: str) -> None:
        self._follows[key] -= 1
        if self._follows[key] <= 0 and key in self._owned and key not in self._drops:
            self._drops[key] = self._loop.call_later(self.unfollow_linger_s, self._drop, key)

    def _drop(self, key: str) -> None:
        self._drops.pop(key, None)
        if self._follows[key] <= 0 and key in self._owned:
            self._owned.discard(key)
            del self._follows[key]
            self._blocking(self.store.unfollow, key)

    # ------------------------------------------------------------------ changes
    def _wake(self, key: str) -> None:
        """A mirror of the agent's store changed (on the mirror's thread): the workers'
        waits wake when it is one of theirs (the agent's own, such as every node's
        `probe/` key or, on the leader's node, every worker's `alive/`, would wake every
        wait of the node at each change for nothing)."""
        if not self._closed and self._follows.get(key, 0) > 0:
            self._loop.call_soon_threadsafe(self._changed)

    def _changed(self) -> None:
        self._generation += 1
        if self._change is not None and not self._change.done():
            self._change.set_result(None)
            self._change = self._loop.create_future()

    async def _until_changed(self, since: int, timeout_s: float) -> bool:
        if self._generation != since:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self._change), timeout_s)
        except asyncio.TimeoutError:
            pass
        return self._generation != since

    async def _op_generation(self, conn):
        return self._generation

    async def _op_wait_changed(self, conn, since: int, timeout_s: float):
        return await self._until_changed(since, timeout_s)


async def _read(reader: asyncio.StreamReader) -> dict | None:
    try:
        header = await reader.readexactly(wire.HEADER.size)
    except asyncio.IncompleteReadError:
        return None
    return wire.decode(await reader.readexactly(wire.frame_length(header)))
