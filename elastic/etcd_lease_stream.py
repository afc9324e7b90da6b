"""One LeaseKeepAlive stream per client, kept open across renewals.

Owns `KeepAliveStream`: the gRPC `LeaseKeepAlive` call an `EtcdClient` renews its leases
on. etcd's lease keep-alive is a bidirectional stream only (no unary renewal); opening a
new one for each renewal, as pyetcd's `refresh_lease` does, costs a call's set-up and a
thread that gRPC starts to feed the request, every third of a TTL, for every agent. etcd's
own clientv3 keeps one keep-alive stream per client and sends each renewal on it; so does
this: one `LeaseKeepAliveRequest` per renewal on the open stream, and its answer (in
order: etcd answers a stream's requests one by one) read back by one reader thread.
etcd still counts one message received per renewal (`grpc_server_msg_received_total`).

A renewal is one at a time per client (a lock): an agent holds one lease. An answer that
does not come within the client's `timeout_s`, a gRPC error, or a stream that ended
drops the call (canceled) and raises what pyetcd's own call would have raised (so the
client's retries and member failover treat it as before); the next renewal opens a new
call on the member in use then. A lease that no longer exists is answered with TTL 0
(etcd's keep-alive does not fail for it): `renew` returns that TTL.

The stream carries etcd's require-leader metadata: a member cut off from its quorum ends
it, rather than keep answering renewals it cannot make (clientv3 does the same).

Written here because pyetcd has no kept-open keep-alive (its `refresh_lease` is one
stream per renewal).
"""
from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planaria.elastic.etcd_client import EtcdClient

_REQUIRE_LEADER = (("hasleader", "true"),)
_ENDED = object()
"""Put on a call's answers when its stream ends without an error."""


class KeepAliveStream:
    """The kept-open LeaseKeepAlive call of one `EtcdClient` (module docstring)."""

    def __init__(self, client: "EtcdClient"):
        self._client = client
        self._lock = threading.Lock()
        self._call = None
        self._requests: queue.SimpleQueue | None = None
        self._answers: queue.SimpleQueue | None = None
        self._closed = False

    def renew(self, lease_id: int) -> int:
        """Renew lease `lease_id` once; the TTL etcd granted (0: the lease is gone).
        Raises pyetcd's connection errors (the client's `_call` retries them)."""
        import pyetcd.exceptions as errors
        from pyetcd.etcdrpc import rpc_pb2

        with self._lock:
            if self._closed:
                raise errors.ConnectionFailedError("the client is closed")
            requests, answers = self._open()
            requests.put(rpc_pb2.LeaseKeepAliveRequest(ID=lease_id))
            try:
                answer = answers.get(timeout=self._client.settings.timeout_s)
            except queue.Empty:
                self._drop()
                raise errors.ConnectionTimeoutError(
                    f"no answer to a lease renewal in {self._client.settings.timeout_s} s") from None
            if answer is _ENDED or isinstance(answer, BaseException):
                self._drop()
                raise _as_pyetcd(answer)
            return int(answer.TTL)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()

    # -------------------------------------------------------------- the call
    def _open(self) -> tuple[queue.SimpleQueue, queue.SimpleQueue]:
        if self._call is None:
            requests, answers = queue.SimpleQueue(), queue.SimpleQueue()
            stub = self._client._client.leasestub  # the member in use now
            self._call = stub.LeaseKeepAlive(iter(requests.get, None),
                                             metadata=self._client.call_metadata + _REQUIRE_LEADER)
            self._requests, self._answers = requests, answers
            threading.Thread(target=_read, args=(self._call, answers), daemon=True,
                             name=f"planaria-lease stream {self._client.endpoint}").start()
        return self._requests, self._answers

    def _drop(self) -> None:
        """End the call in use (its reader ends with it); the next renewal opens another."""
        if self._call is None:
            return
        self._requests.put(None)  # ends the request iterator: gRPC's feeding thread returns
        self._call.cancel()
        self._call = self._requests = self._answers = None


def _read(call, answers: queue.SimpleQueue) -> None:
    """The reader of one call: each answer, then how the stream ended."""
    try:
        for answer in call:
            answers.put(answer)
        answers.put(_ENDED)
    except Exception as err:  # noqa: BLE001 - handed to the renewal waiting, as its error
        answers.put(err)


def _as_pyetcd(answer) -> Exception:
    """What pyetcd's own keep-alive call raises for the same end (`_handle_errors`)."""
    import grpc
    import pyetcd.exceptions as errors

    if answer is _ENDED:
        return errors.ConnectionFailedError("the lease keep-alive stream ended")
    if isinstance(answer, grpc.RpcError):
        if answer.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return errors.ConnectionTimeoutError(str(answer.details()))
        if answer.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return errors.ConnectionFailedError(str(answer.details()))
    return answer
