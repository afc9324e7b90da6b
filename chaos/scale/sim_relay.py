"""A simulated worker's store: its node's relay, reached without a socket.

A real worker talks to its agent's relay over a loopback connection
(`planaria.elastic.node_relay_store`); 8,192 simulated workers in one process would need
twice as many sockets as the harness may open (each connection's two ends), beside the
epochs' bootstrap stores. So a simulated worker hands its request to the relay's own
handler (`NodeRelay.answer`) on the relay's loop, as the relay's connection task would:
the same operations, arguments and answers, the same follows counted for it, and so the
same requests to etcd, which is what the harness measures. The socket path is the
unit tests' and every real job's (tests/elastic/test_node_relay.py, the agents' tests).

Its calls raise `Killed` once its worker or its node is killed, as `CutClient`'s do.
"""
from __future__ import annotations

import asyncio
from datetime import timedelta

import torch.distributed as dist

from planaria.chaos.scale.cutoff import Killed
from planaria.elastic.etcd_limits import EtcdLimits
from planaria.elastic.node_relay import NodeRelay
from planaria.elastic.node_relay_store import ANSWER_MARGIN_S, NodeRelayStore

MARGIN_S = ANSWER_MARGIN_S
"""How long past its own wait a call may take to be answered: a real worker's, unless
the harness is given more slack."""


class InProcessRelayStore(NodeRelayStore):
    """`NodeRelayStore`'s methods, each call answered by `relay` in this process."""

    def __init__(self, relay: NodeRelay, worker: str, killed, timeout: timedelta = timedelta(seconds=300),
                 margin_s: float = MARGIN_S):
        """`killed`: an event (`is_set`), set when the worker or its node dies."""
        dist.Store.__init__(self)  # c10d's half first: pybind requires it
        self._relay, self._killed = relay, killed
        self.url, self.host, self.port = relay.url, relay.host, relay.port
        self.worker, self._timeout, self.connect_timeout_s = worker, timeout, margin_s
        self._closed = False
        self._conn = self._on_loop(self._connect_here(), 0.0)
        self._limits = EtcdLimits(**relay.limits())

    async def _connect_here(self):
        return self._relay.connected(self.worker)

    def _on_loop(self, coroutine, wait_s: float):
        return asyncio.run_coroutine_threadsafe(coroutine, self._relay.loop).result(wait_s + self.connect_timeout_s)

    def _call(self, op: str, wait_s: float = 0.0, **args):
        if self._killed.is_set():
            raise Killed(op)
        if self._closed:
            raise ConnectionError(f"the store through the node's relay at {self.host}:{self.port} was closed")
        answer = self._on_loop(self._relay.answer(self._conn, {"op": op, "args": args}), wait_s)
        if self._killed.is_set():  # the answer to a dead worker reaches nobody
            raise Killed(op)
        return self._result(answer, op)

    async def call_async(self, op: str, wait_s: float = 0.0, **args):
        """`_call` from the relay's own loop (the simulated workers' watches, `loop_watches`):
        the same request and answer, awaited instead of waited for on a thread."""
        if self._killed.is_set():
            raise Killed(op)
        if self._closed:
            raise ConnectionError(f"the store through the node's relay at {self.host}:{self.port} was closed")
        answer = await asyncio.wait_for(self._relay.answer(self._conn, {"op": op, "args": args}),
                                        wait_s + self.connect_timeout_s)
        if self._killed.is_set():
            raise Killed(op)
        return self._result(answer, op)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._relay.loop.call_soon_threadsafe(self._relay.disconnected, self._conn)
