"""A node's etcd client as the scale harness gives it: one that can be cut off at once
(the node died) and that notes the size of every write (etcd's request limit).

A killed node must stop making requests mid-call, wherever its threads are: the agent's
loop, its lease's keep-alive, its workers' waits. `Killed` is a BaseException so that
no `except Exception` on the way (a worker's epoch watcher keeps going through etcd
errors) catches it: the thread that made the call ends, as the process would have.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field


class Killed(BaseException):
    """The node this client belongs to was killed: its threads end here."""


@dataclass
class WriteSizes:
    """The largest write seen, and how many writes there were by kind (thread-safe)."""

    largest: int = 0
    largest_key: str = ""
    writes: Counter = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, kind: str, key: str, size: int) -> None:
        with self._lock:
            self.writes[kind] += 1
            if size > self.largest:
                self.largest, self.largest_key = size, key


class CutClient:
    """`client` (an `EtcdClient`) until `cut()`; every call after raises `Killed`.

    Several cut clients may share one `EtcdClient` (one gRPC channel for a node's agent
    and its workers: what etcd serves is the same, and the harness's process holds one
    connection per node instead of nine)."""

    _WRITES = {"put": 1, "put_if_absent": 1, "compare_and_set": 2, "set_if_revision": 2}
    """The methods that write, and which argument is the value."""

    def __init__(self, client, sizes: WriteSizes, cut: threading.Event | None = None):
        self._client, self._sizes = client, sizes
        self.killed = cut or threading.Event()

    def cut(self) -> None:
        self.killed.set()

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr
        value_at = self._WRITES.get(name)

        def call(*args, **kwargs):
            if self.killed.is_set():
                raise Killed(name)
            if value_at is not None and len(args) > value_at:
                self._sizes.note(name, args[0], len(args[0]) + len(args[value_at] or b""))
            elif name == "put_many" and args and args[0]:  # a node relay's group commit: one request
                self._sizes.note(name, args[0][0][0], sum(len(k) + len(v) for k, v in args[0]))
            result = attr(*args, **kwargs)
            if self.killed.is_set():  # the reply of a node that died meanwhile reaches nobody
                raise Killed(name)
            return result

        return call

    # attributes the agent sets on its client (`retry_s`, `abort`) are the shared client's
    def __setattr__(self, name: str, value) -> None:
        if name.startswith("_") or name == "killed":
            object.__setattr__(self, name, value)
        else:
            setattr(self._client, name, value)
