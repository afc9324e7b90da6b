"""A worker's store operations, traced: one JSON line per request it makes to the job's
store (`PLANARIA_STORE_TRACE=<dir>`, docs/control_plane.md, "Tracing a worker's store").

`TracingStore` wraps the store `connect_store` returns, so every request of the worker
goes through it: the coordinator's (`StoreCoordinator`), and the process groups'
rendezvous, which c10d's `PrefixStore` over it calls back into Python with full keys
(`epoch/<e>/pg/...`). Each line is the operation, its key or keys as the worker gave
them (relative to the job's prefix), for a write the value's size, when it began (`t`,
the wall clock), how long it took (`s`: a blocking `get` waits for its key) and the
error it raised, if any; a line is written once the operation returned or failed:

    {"op": "set", "key": "epoch/0/pg//0//cpu//0/1", "bytes": 186, "t": 1766.25, "s": 0.0021}
    {"op": "check", "keys": ["epoch/0/reconfigure"], "t": 1766.27, "s": 0.0009}

The scale harness's simulated workers write their traces through the same class
(`planaria.chaos.scale`), so that a real job's and a simulated job's traces can be
compared, worker by worker and key by key (`planaria.chaos.scale.traffic`).
"""
from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from planaria.runtime.contract import env
from planaria.templates.plan import Worker


def trace_path(directory: str | Path, worker: Worker) -> Path:
    """The trace of `worker` in `directory`: `<node>.<local>.jsonl`."""
    return Path(directory) / f"{worker[0]}.{worker[1]}.jsonl"


class TracingStore(dist.Store):
    """`base`, with every operation appended to `path` as a JSON line once it returned
    or failed: when it began (`t`), how long it took (`s`), and the error it raised,
    if any (`error`). A request cut short by the process's death is in no trace, as it
    reached no one. Thread-safe: a worker's watcher, publisher and connection threads
    share its store."""

    def __init__(self, base: dist.Store, path: str | Path):
        super().__init__()  # c10d's half first: pybind requires it
        self.base = base
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # Line-buffered: a worker SIGKILLed mid-epoch leaves every request it made.
        self._out = open(self.path, "a", encoding="utf-8", buffering=1)

    def _traced(self, call, op: str, key: str | None = None, keys=None, size: int | None = None):
        line, started = _line(op, key, keys, size), time.monotonic()
        try:
            result = call()
        except Exception as err:  # (a simulated node's death, a BaseException, is no answer)
            self._write(line, started, error=type(err).__name__)
            raise
        self._write(line, started)
        return result

    async def traced_async(self, call, op: str, key: str | None = None, keys=None, size: int | None = None):
        """`_traced` of a coroutine function's call, for a caller on an event loop (the
        scale harness's simulated workers' watches); the same line."""
        line, started = _line(op, key, keys, size), time.monotonic()
        try:
            result = await call()
        except Exception as err:
            self._write(line, started, error=type(err).__name__)
            raise
        self._write(line, started)
        return result

    def _write(self, line: dict, started: float, **more) -> None:
        text = json.dumps({**line, "s": round(time.monotonic() - started, 6), **more}) + "\n"
        with self._lock:
            if not self._out.closed:
                self._out.write(text)

    def close(self) -> None:
        with self._lock:
            self._out.close()

    # -- the Store interface --------------------------------------------------------
    def set(self, key, value) -> None:
        self._traced(lambda: self.base.set(key, value), "set", key, size=len(_bytes(value)))

    def get(self, key) -> bytes:
        return self._traced(lambda: self.base.get(key), "get", key)

    def check(self, keys) -> bool:
        return self._traced(lambda: self.base.check(keys), "check", keys=keys)

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._traced(lambda: self.base.wait(keys), "wait", keys=keys)
        else:
            self._traced(lambda: self.base.wait(keys, timeout), "wait", keys=keys)

    def add(self, key, amount: int) -> int:
        return self._traced(lambda: self.base.add(key, amount), "add", key)

    def compare_set(self, key, expected, desired) -> bytes:
        return self._traced(lambda: self.base.compare_set(key, expected, desired), "compare_set", key,
                            size=len(_bytes(desired)))

    def delete_key(self, key) -> bool:
        return self._traced(lambda: self.base.delete_key(key), "delete_key", key)

    def num_keys(self) -> int:
        return self._traced(self.base.num_keys, "num_keys")

    def set_timeout(self, timeout: timedelta) -> None:
        self.base.set_timeout(timeout)  # not a request: the store's own setting

    @property
    def timeout(self) -> timedelta:
        return self.base.timeout

    # -- the one-round-trip read of `store_reads`, where the base has it -------------
    # Traced as what it is, so that tracing never changes what a worker asks for: over a
    # base without it a key is read with `check` then `get`, as `read_if_present` would.
    # (`items_under`, the controller's read of a prefix, is no worker's.)
    def get_if_present(self, key: str) -> bytes | None:
        fast = getattr(self.base, "get_if_present", None)
        if fast is None:
            return self.get(key) if self.check([key]) else None
        return self._traced(lambda: fast(key), "get_if_present", key)

    # -- following (`store_reads.follow`), where the base can ---------------------------
    # A follow is traced (over etcd it is a read and a watch); reads of a followed key are
    # traced as any read, though a mirror answers them; waiting for a change asks nothing.
    def __getattr__(self, name: str):
        if name in ("follow", "unfollow") and name != "base":
            method = getattr(self.base, name)  # AttributeError: the base cannot follow
            return lambda key, *args: self._traced(lambda: method(key, *args), name, key)
        if name in ("generation", "wait_changed"):
            return getattr(self.base, name)
        raise AttributeError(name)


def traced(store: dist.Store, environ) -> dist.Store:
    """`store`, traced into `PLANARIA_STORE_TRACE`'s directory when `environ` sets it,
    under the name of the worker `environ` names (`PLANARIA_NODE`, `PLANARIA_LOCAL_RANK`);
    else `store` itself."""
    directory = environ.get(env.STORE_TRACE)
    if not directory:
        return store
    missing = [name for name in (env.NODE, env.LOCAL_RANK) if name not in environ]
    if missing:
        raise RuntimeError(f"{env.STORE_TRACE} is set but {', '.join(missing)} is not: a trace is named "
                           "after its worker")
    return TracingStore(store, trace_path(directory, (environ[env.NODE], int(environ[env.LOCAL_RANK]))))


def _line(op: str, key: str | None, keys, size: int | None) -> dict:
    """A trace line's fields before the operation's outcome: what was asked, and when."""
    line: dict = {"op": op}
    if key is not None:
        line["key"] = key
    if keys is not None:
        line["keys"] = list(keys)
    if size is not None:
        line["bytes"] = size
    line["t"] = round(time.time(), 6)
    return line


def _bytes(value) -> bytes:
    """A value as c10d stores it (bytes, a str as UTF-8, or a list of byte values)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
