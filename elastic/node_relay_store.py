"""A worker's side of its node's relay: the job's store, through its agent.

`NodeRelayStore` has the methods of the job's etcd store (`planaria.elastic.etcd_kv`:
a `torch.distributed.Store`'s, and `get_if_present`, `items_under`, `follow`,
`generation`, `wait_changed`, `limits`), each one request to the node's relay
(`planaria.elastic.node_relay`), which answers it from its mirrors or its etcd client.
`connect_store` gives a worker one for `node://host:port/token` (the `planaria.stores`
entry point), the URL its agent puts in `PLANARIA_STORE`.

Each thread that calls at once gets a connection of its own from a pool (the epoch
watcher waits on a change while the main thread writes), kept for the store's life: the
relay counts a worker's follows until its last connection closes, which the worker's
exit does. A relay that cannot be reached (the agent is gone) is a `ConnectionError`
naming it, at once: a worker without its agent has no control plane left to wait for.
"""
from __future__ import annotations

import os
import socket
import threading
import uuid
from datetime import timedelta

import torch.distributed as dist

from planaria.elastic import node_relay_protocol as wire
from planaria.elastic.etcd_kv import store_bytes
from planaria.elastic.etcd_limits import EtcdLimitExceeded, EtcdLimits
from planaria.runtime.contract import env

ANSWER_MARGIN_S = 30.0
"""A request that waits (a `get`, a `wait_changed`) is answered within its own timeout;
the socket waits this much longer before calling the relay unresponsive."""


class NodeRelayKeyValue:
    """The job's store through the node's relay (module docstring); torch-free."""

    timeout_error: type[Exception] = TimeoutError

    def __init__(self, url: str, worker: str = "?", timeout: timedelta = timedelta(seconds=300),
                 connect_timeout_s: float = 30.0):
        self.url = url
        self.host, self.port, self._token = wire.parse_relay_url(url)
        self.worker, self._timeout, self.connect_timeout_s = worker, timeout, connect_timeout_s
        self._client_id = f"{worker}/{uuid.uuid4().hex[:12]}"
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._limits: EtcdLimits | None = None
        self._closed = False
        self._open()

    def _open(self) -> None:
        self._release(self._connect())  # the first connection says whether the relay is there

    # ------------------------------------------------------------------ connections
    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
        except OSError as err:
            raise ConnectionError(f"the node's relay at {self.host}:{self.port} cannot be reached ({err}); "
                                  "is this node's agent alive?") from err
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        answer = self._exchange(sock, {"token": self._token, "worker": self._client_id}, self.connect_timeout_s)
        limits = self._result(answer, "connect")
        if self._limits is None:
            self._limits = EtcdLimits(limits["max_request_bytes"], limits["max_txn_ops"], limits["user"])
        return sock

    def _acquire(self) -> socket.socket:
        with self._lock:
            if self._closed:
                raise ConnectionError(f"the store through the node's relay at {self.host}:{self.port} was closed")
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(sock)
                return
        sock.close()

    def _exchange(self, sock: socket.socket, message: dict, wait_s: float) -> dict:
        try:
            sock.settimeout(wait_s)
            sock.sendall(wire.encode(message))
            header = _receive(sock, wire.HEADER.size)
            return wire.decode(_receive(sock, wire.frame_length(header)))
        except (OSError, EOFError) as err:
            sock.close()
            raise ConnectionError(f"the node's relay at {self.host}:{self.port} stopped answering "
                                  f"({type(err).__name__}: {err}); is this node's agent alive?") from err

    def _call(self, op: str, wait_s: float = 0.0, **args):
        sock = self._acquire()
        answer = self._exchange(sock, {"op": op, "args": args}, wait_s + ANSWER_MARGIN_S)
        self._release(sock)
        return self._result(answer, op)

    def _result(self, answer: dict, op: str):
        if "ok" in answer:
            return answer["ok"]
        kind, message = answer.get("error"), answer.get("message", "")
        if kind == "timeout":
            raise self.timeout_error(message)
        if kind == "limit":
            raise EtcdLimitExceeded(message)
        raise wire.RelayError(f"{op} through the node's relay at {self.host}:{self.port}: {message}")

    def close(self) -> None:
        """Close every connection (the relay drops this worker's follows)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    # ------------------------------------------------------------------ followed keys
    def follow(self, key: str, prefix: bool = False) -> None:
        self._call("follow", key=key, prefix=prefix)

    def unfollow(self, key: str) -> None:
        self._call("unfollow", key=key)

    def generation(self) -> int:
        return self._call("generation")

    def wait_changed(self, since: int, timeout_s: float) -> bool:
        return self._call("wait_changed", wait_s=timeout_s, since=since, timeout_s=timeout_s)

    # ------------------------------------------------------------------ the Store interface
    def set(self, key: str, value) -> None:
        self._call("set", key=key, value=wire.pack(store_bytes(value)))

    def get(self, key: str) -> bytes:
        limit = self._timeout.total_seconds()
        return wire.unpack(self._call("get", wait_s=limit, key=key, timeout_s=limit))

    def get_if_present(self, key: str) -> bytes | None:
        return wire.unpack(self._call("get_if_present", key=key))

    def items_under(self, prefix: str) -> dict[str, bytes]:
        return {key: wire.unpack(value) for key, value in self._call("items_under", prefix=prefix).items()}

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys_=list(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        for key in keys:
            self._call("get", wait_s=limit, key=key, timeout_s=limit)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key=key, amount=int(amount))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return wire.unpack(self._call("compare_set", key=key, expected=wire.pack(store_bytes(expected)),
                                      desired=wire.pack(store_bytes(desired))))

    def compare_set_bytes(self, key: str, expected, desired) -> int:
        return self._call("compare_set_bytes", key=key, expected=wire.pack(store_bytes(expected)),
                          desired=wire.pack(store_bytes(desired)))

    @property
    def limits(self) -> EtcdLimits:
        return self._limits

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key=key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return self._timeout


class NodeRelayStore(NodeRelayKeyValue, dist.Store):
    """`NodeRelayKeyValue` as a `torch.distributed.Store`."""

    timeout_error = dist.DistStoreError

    def __init__(self, url: str, worker: str = "?", timeout: timedelta = timedelta(seconds=300),
                 connect_timeout_s: float = 30.0):
        dist.Store.__init__(self)  # c10d's half first: pybind requires it
        NodeRelayKeyValue.__init__(self, url, worker, timeout, connect_timeout_s)


def store_from_url(url: str, timeout_s: float = 300.0) -> NodeRelayStore:
    """`node://host:port/token` (the `planaria.stores` entry point for a node's relay)."""
    found = env.elastic_worker(os.environ)
    worker = f"{found[1]}.{found[2]}" if found else f"pid{os.getpid()}"
    return NodeRelayStore(url, worker, timeout=timedelta(seconds=timeout_s))


def _receive(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 2**20))
        if not chunk:
            raise EOFError("the relay closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)

