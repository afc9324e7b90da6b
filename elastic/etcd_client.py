"""The etcd v3 client layer: one connection, retries on transient errors, clear failures.

Through `etcd-sdk-python` (imports as `pyetcd`; the maintained fork of python-etcd3,
which no longer imports with current protobuf). Every call that talks to etcd retries
with exponential backoff (`tenacity`) while the error is transient (server unavailable,
connection refused or timed out, no leader yet), for up to `retry_s` (which may be
infinite: a running job's agents and workers wait out an etcd outage); then it raises
`EtcdUnavailable` naming the endpoint. An outage longer than a second is reported once
when it starts and once when etcd answers again (`on_outage`), and `back_at` tells when
the last one ended. TLS (CA, client certificate and key) and username/password are
passed through; files that do not exist are refused up front.

Every write and every transaction is checked against etcd's request limits before it is
sent (`planaria.elastic.etcd_limits`: 1.5 MiB a request, 128 operations a transaction,
unless the settings give the values etcd was started with): one over them raises
`EtcdLimitExceeded` at once, naming the key, the size, the limit and the etcd flag,
instead of etcd's bare refusal after the fact. It is never retried.

Streams (`etcd_watch`'s watches) outlive any one call: `stream_targets` gives them the
client's channels, one per member, to pick from, and the channels ping their member
while a call is open (`keepalive_s`) so that a stream on a frozen or cut-off member ends.
All the mirrors of a client share one Watch stream (`watch_stream`, made with the first
and ended with the last, or when the client closes), and its lease renewals one kept-open
keep-alive stream (`etcd_lease_stream`).

`EtcdSettings.to_env` / `from_env` carry the settings from an agent to the workers it
starts (`PLANARIA_ETCD_*`, not on the command line where `ps` shows them), so that a
worker reaches etcd exactly as its agent does.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from planaria.elastic.etcd_limits import MAX_REQUEST_BYTES, MAX_TXN_OPS, EtcdLimitExceeded, EtcdLimits
from planaria.runtime.contract import env

if TYPE_CHECKING:
    import grpc

    from planaria.elastic.etcd_lease_stream import KeepAliveStream
    from planaria.elastic.etcd_watch_stream import WatchStream

_OUTAGE_REPORT_S = 1.0
"""An error that lasts this long is an outage worth a line (a blip is not)."""
_RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                      ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.max_receive_message_length", -1)]
"""gRPC backs off its reconnections up to 120 s by default: after a long etcd outage a
channel would stay down for many seconds after etcd is back. Our own retries pace the
attempts, so the channel may try again within a second.

gRPC also refuses, by default, an answer over 4 MiB ("Received message larger than
max"), and the controller reads every status of an epoch in one range read: 2.8 MiB
of them at 1,024 nodes of 8 workers (LLaMA 3 70B), 8.3 MiB at 4,096, and more with the
keys. etcd sends answers of any size (its own send limit is 2 GiB), so the client
takes them whole (-1: no cap); what the job writes bounds them."""


def _grpc_options(settings: "EtcdSettings") -> list[tuple[str, int]]:
    """The channels' options: fast reconnection, and keepalive pings while a call is open.

    A watch stream (`etcd_watch`) is open for hours with nothing to carry: without pings,
    a member that froze or whose network vanished without a reset leaves it silent for as
    long as TCP holds. gRPC pings only while a call is open (not on an idle channel, which
    etcd would take for abuse), and needs `ping_timeout_ms` besides `keepalive_timeout_ms`
    to act on a missing answer (measured: with the latter alone a SIGSTOPped member's
    stream stayed open); `max_pings_without_data` 0 keeps pinging a stream that carries
    nothing."""
    keepalive_ms = int(settings.keepalive_s * 1000)
    answer_ms = keepalive_ms // 2  # not timeout_s: a test's 0.2 s would close live connections
    return [*_RECONNECT_OPTIONS, ("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_timeout_ms", answer_ms), ("grpc.http2.ping_timeout_ms", answer_ms),
            ("grpc.http2.max_pings_without_data", 0)]


class LeaseExpired(RuntimeError):
    """A write bound to a lease that etcd no longer has: it expired while this client could
    not reach etcd (a node cut off the network, then back). The node must register again."""


class EtcdUnavailable(RuntimeError):
    """etcd could not be reached for longer than the retry budget."""


@dataclass(frozen=True)
class EtcdSettings:
    """How to reach etcd: `endpoint` is host:port; the rest is optional."""

    endpoint: str = "127.0.0.1:2379"
    """host:port, or several, comma separated (the client fails over between them)."""
    ca_cert: str | None = None
    cert_cert: str | None = None
    cert_key: str | None = None
    user: str | None = None
    password: str | None = None
    timeout_s: float = 5.0
    """Per request."""
    retry_s: float = 30.0
    """How long transient errors are retried before giving up."""
    max_request_bytes: int = MAX_REQUEST_BYTES
    """etcd's `--max-request-bytes`: give the value etcd was started with, if not its default."""
    max_txn_ops: int = MAX_TXN_OPS
    """etcd's `--max-txn-ops`: give the value etcd was started with, if not its default."""
    keepalive_s: float = 10.0
    """While a call (a watch) is open, its member is pinged this often and must answer
    within half that: a stream on a frozen or cut-off member ends within 1.5 times it.
    etcd refuses pings more often than every 5 s (its `--grpc-keepalive-min-time`)."""

    def __post_init__(self) -> None:
        for part in self.endpoint.split(","):
            host, _, port = part.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"etcd endpoint must be host:port (or several, comma separated), "
                                 f"got {self.endpoint!r}")
        for name in ("ca_cert", "cert_cert", "cert_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"etcd TLS file {name}={path!r} does not exist; give the path of "
                                 "an existing PEM file, or leave it out for plain connections")
        if (self.cert_cert is None) != (self.cert_key is None):
            raise ValueError("etcd client TLS needs both cert_cert and cert_key, or neither")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd authentication needs both user and password, or neither")
        if self.keepalive_s < 5.0:
            raise ValueError(f"etcd keepalive_s must be at least 5 s (etcd's default "
                             f"--grpc-keepalive-min-time closes connections that ping more often), "
                             f"got {self.keepalive_s}")
        EtcdLimits(self.max_request_bytes, self.max_txn_ops)  # refuse impossible limits now, not at a write

    @property
    def limits(self) -> EtcdLimits:
        """The request limits every write is checked against before it is sent."""
        return EtcdLimits(self.max_request_bytes, self.max_txn_ops, user=self.user)

    _ENV = {"ca_cert": env.ETCD_CA_CERT, "cert_cert": env.ETCD_CERT, "cert_key": env.ETCD_KEY,
            "user": env.ETCD_USER, "password": env.ETCD_PASSWORD}
    _LIMITS_ENV = {"max_request_bytes": (env.ETCD_MAX_REQUEST_BYTES, MAX_REQUEST_BYTES),
                   "max_txn_ops": (env.ETCD_MAX_TXN_OPS, MAX_TXN_OPS)}

    def to_env(self) -> dict[str, str]:
        """TLS, credentials and limits other than etcd's defaults as environment variables,
        for `from_env`."""
        found = {var: getattr(self, name) for name, var in self._ENV.items() if getattr(self, name) is not None}
        return found | {var: str(getattr(self, name)) for name, (var, default) in self._LIMITS_ENV.items()
                        if getattr(self, name) != default}

    @classmethod
    def from_env(cls, endpoint: str, environ=os.environ, **others) -> "EtcdSettings":
        """Settings for `endpoint` with the TLS, credentials and limits `to_env` put in `environ`."""
        given = {name: environ[var] for name, var in cls._ENV.items() if var in environ}
        return cls(endpoint=endpoint, **given, **_limits_from(environ, cls._LIMITS_ENV), **others)


def _limits_from(environ, names: dict[str, tuple[str, int]]) -> dict[str, int]:
    """{setting: value} of the limits set in `environ`; a value that is no integer is an
    error naming the variable."""
    found = {}
    for name, (var, _) in names.items():
        if var in environ:
            try:
                found[name] = int(environ[var])
            except ValueError:
                raise ValueError(f"{var}={environ[var]!r} must be an integer: the value etcd was started "
                                 f"with (--{name.replace('_', '-')})") from None
    return found


_LIMIT_REFUSALS = {"etcdserver: request is too large": "--max-request-bytes",
                   "etcdserver: too many operations in txn request": "--max-txn-ops"}
"""etcd's refusals of a request over its limits, and the flag that sets each limit: seen
only when etcd's limits are lower than the client was told (the client checks first)."""

_SERVER_TIMEOUTS = ("context deadline exceeded", "etcdserver: request timed out", "etcdserver: no leader",
                    "etcdserver: leader changed")
"""What a member that cannot serve says with another status than UNAVAILABLE: a member cut
off from the others (a minority) answers a linearizable read with UNKNOWN "context
deadline exceeded" once its own wait for the leader runs out. Another member may answer."""


def _transient(err: BaseException) -> bool:
    import grpc
    import pyetcd.exceptions as errors

    if isinstance(err, (errors.ConnectionFailedError, errors.ConnectionTimeoutError,
                        errors.NoServerAvailableError)):
        return True
    if isinstance(err, grpc.RpcError):
        if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return True
        details = err.details() if hasattr(err, "details") else ""
        return any(text in (details or "") for text in _SERVER_TIMEOUTS)
    return False


def _no_server_error():
    import pyetcd.exceptions as errors

    return errors.NoServerAvailableError


def _credentials(settings: EtcdSettings):
    """gRPC TLS credentials from the settings' PEM files, or None for plain connections."""
    if settings.ca_cert is None:
        return None
    import grpc

    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    return grpc.ssl_channel_credentials(read(settings.ca_cert), read(settings.cert_key),
                                        read(settings.cert_cert))


class EtcdClient:
    """The calls Planaria makes to etcd, each retried on transient errors.

    `retry_s` starts as the settings' and may be changed (an agent retries for a bounded
    time while it starts, then waits out outages); `on_outage(line)` is told when etcd
    stops answering and when it answers again (default: a logging warning)."""

    def __init__(self, settings: EtcdSettings, on_outage: Callable[[str], None] | None = None):
        import pyetcd

        self.settings = settings
        self.limits = settings.limits
        self.retry_s = settings.retry_s
        self.on_outage = on_outage or logging.getLogger("planaria.etcd").warning
        self.abort = threading.Event()
        """Set: a call that is retrying gives up at its next attempt (an agent told to stop
        while etcd is away must not wait for etcd first)."""
        self.back_at: float | None = None
        """time.monotonic() when the last outage ended; None if there was none."""
        self.away_s = 0.0
        """How long the last outage lasted: from this client's first failed try to its
        next answer."""
        self._down_since: float | None = None
        self._reported = False
        self._lock = threading.Lock()
        self._stream = None
        self._lease_stream = None
        self._stream_lock = threading.Lock()
        parts = [p.rpartition(":") for p in settings.endpoint.split(",")]
        if len(parts) == 1:
            host, _, port = parts[0]
            self._client = pyetcd.client(host=host, port=int(port), ca_cert=settings.ca_cert,
                                         cert_key=settings.cert_key, cert_cert=settings.cert_cert,
                                         timeout=settings.timeout_s, user=settings.user,
                                         password=settings.password, grpc_options=_grpc_options(settings))
        else:
            creds = _credentials(settings)
            endpoints = [pyetcd.Endpoint(host, int(port), secure=creds is not None, creds=creds,
                                         opts=_grpc_options(settings)) for host, _, port in parts]
            self._client = pyetcd.MultiEndpointEtcd3Client(
                endpoints=endpoints, timeout=settings.timeout_s, user=settings.user,
                password=settings.password, failover=True)
        # pyetcd refuses a failed endpoint for `time_retry` (300 s) before trying it again.
        # With one endpoint our own backoff decides when to retry, so every attempt must
        # reach it; with several, failover skips a failed member for a few seconds.
        for endpoint in self._client.endpoints.values():
            endpoint.time_retry = 0.0 if len(parts) == 1 else 5.0

    @property
    def endpoint(self) -> str:
        return self.settings.endpoint

    def _call(self, what: str, fn, *args, **kwargs):
        started = time.monotonic()
        try:
            for attempt in Retrying(retry=retry_if_exception(_transient),
                                    stop=stop_after_delay(self.retry_s) | self._aborted,
                                    wait=wait_exponential(multiplier=0.05, max=1.0), reraise=True,
                                    before_sleep=lambda state: self._failed(what, state)):
                with attempt:  # an error in here is retried (the block swallows it)
                    result = fn(*args, **kwargs)
                    self._answered()
                    return result
        except Exception as err:
            if _transient(err):
                waited = time.monotonic() - started
                raise EtcdUnavailable(
                    f"etcd at {self.endpoint} did not answer {what} for {waited:.0f} s "
                    f"({type(err).__name__}); check that it runs and that this host can reach it") from err
            if "requested lease not found" in str(err):
                raise LeaseExpired(f"{what}: this client's lease expired (etcd was out of reach for "
                                   "longer than its TTL)") from err
            for refusal, flag in _LIMIT_REFUSALS.items():
                if refusal in str(err):
                    raise EtcdLimitExceeded(
                        f"{what}: etcd at {self.endpoint} refused it ({refusal}): its {flag} is lower than this "
                        f"client was told ({self.limits.max_request_bytes} bytes a request, "
                        f"{self.limits.max_txn_ops} operations a transaction); give Planaria etcd's values "
                        "(EtcdSettings, PLANARIA_ETCD_MAX_REQUEST_BYTES / PLANARIA_ETCD_MAX_TXN_OPS)") from err
            raise

    def _aborted(self, state) -> bool:
        return self.abort.is_set()

    def _failed(self, what: str, state) -> None:
        err = state.outcome.exception()
        if len(self._client.endpoints) > 1 and not isinstance(err, _no_server_error()):
            # pyetcd fails over only on UNAVAILABLE and DEADLINE_EXCEEDED: a member that
            # answers, but cannot serve (a minority), would be asked again and again.
            current = self._client.endpoint_in_use
            if current is not None and not current.is_failed():
                current.fail()
                # pyetcd keeps its stubs (bound to the failed member's channel) until the
                # member in use changes: dropped here, the next try picks the next member.
                self._client._clear_old_stubs()
        if isinstance(err, _no_server_error()):
            # Every member is marked failed (pyetcd then skips them for `time_retry`):
            # with none left, trying them all again is the only way to see one come back.
            for endpoint in self._client.endpoints.values():
                endpoint.last_failed = 0
        with self._lock:
            now = time.monotonic()
            if self._down_since is None:
                self._down_since, self._reported = now, False
            if self._reported or now - self._down_since < _OUTAGE_REPORT_S:
                return
            self._reported = True
        limit = "as long as it takes" if math.isinf(self.retry_s) else f"up to {self.retry_s:.0f} s"
        self.on_outage(f"etcd at {self.endpoint} is unreachable ({what}: {type(err).__name__}); "
                       f"waiting for it, {limit}")

    def _answered(self) -> None:
        if self._down_since is None:  # the common case: no lock taken
            return
        with self._lock:
            if self._down_since is None:
                return
            down_s, reported = time.monotonic() - self._down_since, self._reported
            self._down_since, self.back_at, self.away_s = None, time.monotonic(), down_s
        if reported:
            self.on_outage(f"etcd at {self.endpoint} answers again, after {down_s:.1f} s away")

    # -- keys -------------------------------------------------------------------------
    def get(self, key: str) -> tuple[bytes | None, int]:
        """(value, version); (None, 0) when absent."""
        value, meta = self._call(f"get {key}", self._client.get, key)
        return value, (meta.version if meta is not None else 0)

    def put(self, key: str, value: bytes, lease=None, *, why: str | None = None) -> None:
        """Write `value` (`why`: what makes it big, for the error if it is over etcd's limit)."""
        size = self.limits.request_bytes([key.encode(), value], ops=1)
        self.limits.check(f"put {key}", key, size, why=why)
        self._call(f"put {key}", self._client.put, key, value, lease=lease)

    def put_many(self, items: list[tuple[str, bytes]]) -> int:
        """Write every (key, value) of `items` (distinct keys), in as few transactions as
        etcd's limits allow (one, for a node's statuses); the number of transactions.
        Atomic within each transaction only: callers write keys that stand each alone."""
        sent = 0
        for batch in self._fitting(items):
            t = self.ops
            what = f"put {len(batch)} keys"
            self.transaction(what, batch[0][0], compare=[], success=[t.put(k, v) for k, v in batch])
            sent += 1
        return sent

    def _fitting(self, items: list[tuple[str, bytes]]):
        """`items` cut into runs that each fit one transaction (a value too large alone is
        left to `transaction`'s check, which names it)."""
        batch: list[tuple[str, bytes]] = []
        for key, value in items:
            grown = batch + [(key, value)]
            size = self.limits.request_bytes([part for k, v in grown for part in (k.encode(), v)], len(grown))
            if batch and (len(grown) > self.limits.max_txn_ops or size > self.limits.max_request_bytes):
                yield batch
                grown = [(key, value)]
            batch = grown
        if batch:
            yield batch

    def delete(self, key: str) -> bool:
        return bool(self._call(f"delete {key}", self._client.delete, key))

    def count_prefix(self, prefix: str) -> int:
        return len(self.keys_with_prefix(prefix))

    def put_if_absent(self, key: str, value: bytes, lease=None, *, why: str | None = None) -> bool:
        t = self.ops
        ok, _ = self.transaction(f"create {key}", key, compare=[t.create(key) == 0],
                                 success=[t.put(key, value, lease=lease)], why=why)
        return bool(ok)

    def atomic_add(self, key: str, amount: int) -> int:
        """Add to an integer kept as decimal text; a compare-and-swap loop on its version.

        At least once, not exactly once: a swap whose reply was lost is retried, finds the
        version moved (by itself) and adds again. Callers count nothing that a double
        count would break (checkpoint shards are counted, then their files checked)."""
        while True:
            value, version = self.get(key)
            new = (int(value) if value is not None else 0) + amount
            if self._swap(key, version, str(new).encode()):
                return new

    def compare_and_set(self, key: str, expected: bytes, desired: bytes, *, why: str | None = None) -> bytes:
        """c10d's compare_set: set `desired` if the value is `expected` (or the key is absent
        and `expected` is empty); return the value after."""
        ok, _ = self.transaction(f"compare-and-set {key}", key, *self._compare_and_set_ops(key, expected, desired),
                                 why=why)
        return desired if ok else (self.get(key)[0] or b"")

    def compare_and_set_bytes(self, key: str, expected: bytes, desired: bytes) -> int:
        """The size of `compare_and_set`'s request, as checked against etcd's limit: for a
        check before the write, where the caller knows what makes it big."""
        return self.limits.txn_bytes(*self._compare_and_set_ops(key, expected, desired), [])

    def _compare_and_set_ops(self, key: str, expected: bytes, desired: bytes) -> tuple[list, list]:
        t = self.ops
        compare = [t.value(key) == expected] if expected else [t.version(key) == 0]
        return compare, [t.put(key, desired)]

    def set_if_revision(self, key: str, revision: int | None, value: bytes, *, lease=None,
                        clear_prefix: str | None = None, why: str | None = None) -> tuple[bool, bytes | None, int]:
        """Put `value` (bound to `lease`, if given) if the key's mod revision is `revision`
        (None: if it is absent), in one transaction that also reads the key back:
        (succeeded, value now, mod revision now; None and 0 when absent). Creating it
        (`revision` None) deletes the keys under `clear_prefix` in the same transaction."""
        from pyetcd.utils import prefix_range_end

        t = self.ops
        compare = [t.version(key) == 0] if revision is None else [t.mod(key) == revision]
        success = [t.put(key, value, lease=lease), t.get(key)]
        if revision is None and clear_prefix:
            success.insert(0, t.delete(clear_prefix, range_end=prefix_range_end(clear_prefix.encode())))
        ok, responses = self.transaction(f"compare-and-set {key}", key, compare=compare, success=success,
                                         failure=[t.get(key)], why=why)
        found = responses[-1]
        if not found:
            return ok, None, 0
        value_now, meta = found[0]
        return ok, value_now, meta.mod_revision

    def get_with_revision(self, key: str) -> tuple[bytes | None, int]:
        """(value, mod revision); (None, 0) when absent."""
        value, meta = self._call(f"get {key}", self._client.get, key)
        return value, (meta.mod_revision if meta is not None else 0)

    def _swap(self, key: str, version: int, value: bytes) -> bool:
        t = self.ops
        ok, _ = self.transaction(f"swap {key}", key, compare=[t.version(key) == version], success=[t.put(key, value)])
        return ok

    # -- transactions -----------------------------------------------------------------
    @property
    def ops(self):
        """The compares and operations of a `transaction` (`pyetcd.transactions`:
        `ops.put(key, value)`, `ops.version(key) == 0`, ...)."""
        return self._client.transactions

    def transaction(self, what: str, key: str, compare: list, success: list, failure: list = (), *,
                    why: str | None = None):
        """One etcd transaction of `ops` compares and operations: (succeeded, responses).
        Checked against etcd's limits before it is sent (`EtcdLimitExceeded`); `what` says
        what it does and `key` which key it is for, in errors; `why` what makes it big."""
        failure = list(failure)
        largest = max(len(compare), len(success), len(failure))  # etcd limits each branch
        self.limits.check(what, key, self.limits.txn_bytes(compare, success, failure), largest, why=why)
        return self._call(what, self._client.transaction, compare=compare, success=success, failure=failure)

    # -- leases -----------------------------------------------------------------------
    def lease(self, ttl_s: int):
        """A new lease of `ttl_s` seconds (keep it alive with `refresh`)."""
        return self._call("grant a lease", self._client.lease, int(ttl_s))

    def refresh(self, lease) -> bool:
        """Keep `lease` alive; False if it no longer exists (it expired: its keys are gone).
        On the client's one kept-open keep-alive stream (`etcd_lease_stream`)."""
        return self._call("refresh a lease", self._keep_alive().renew, lease.id) > 0

    def _keep_alive(self) -> "KeepAliveStream":
        from planaria.elastic.etcd_lease_stream import KeepAliveStream

        with self._stream_lock:
            if self._lease_stream is None:
                self._lease_stream = KeepAliveStream(self)
            return self._lease_stream

    def revoke(self, lease) -> None:
        """End `lease` now: its keys go at once, not when its TTL runs out."""
        self._call("revoke a lease", lease.revoke)

    def keys_with_prefix(self, prefix: str) -> list[str]:
        """The keys under `prefix`, without it."""
        found = self._call(f"list {prefix}", lambda: list(self._client.get_prefix(prefix, keys_only=True)))
        return [meta.key.decode()[len(prefix):] for _, meta in found]

    def items_with_prefix(self, prefix: str) -> dict[str, bytes]:
        """{key without `prefix`: value} of the keys under `prefix`."""
        found = self._call(f"read {prefix}", lambda: list(self._client.get_prefix(prefix)))
        return {meta.key.decode()[len(prefix):]: value for value, meta in found}

    def leases_with_prefix(self, prefix: str) -> dict[str, int]:
        """{key without `prefix`: the id of the lease it is bound to (0: none)}."""
        found = self._call(f"read {prefix}", lambda: list(self._client.get_prefix(prefix, keys_only=True)))
        return {meta.key.decode()[len(prefix):]: meta.lease_id for _, meta in found}

    def lease_age_s(self, lease_id: int) -> float | None:
        """Seconds since the lease was last renewed (its granted TTL less what is left of
        it); None when it has expired or was revoked."""
        info = self._call(f"look at lease {lease_id:x}", self._client.get_lease_info, lease_id)
        return None if info.TTL < 0 else float(info.grantedTTL - info.TTL)

    def read_range(self, key: str,
                   range_end: bytes | None = None) -> tuple[list[tuple[bytes, bytes, int]], int]:
        """One Range: the (key, value, mod revision) of `key`, or of the keys in [`key`,
        `range_end`), and the revision etcd was at when it read them."""
        kwargs = {} if range_end is None else {"range_end": range_end}
        response = self._call(f"read {key}", self._client.get_response, key, **kwargs)
        return [(kv.key, kv.value, kv.mod_revision) for kv in response.kvs], response.header.revision

    # -- for streams ------------------------------------------------------------------
    # A stream (a watch) outlives any one call: it picks its member itself and moves on
    # when that member fails, on the client's own channels (one connection per member).
    def stream_targets(self) -> list[tuple[str, grpc.Channel]]:
        """(host:port, gRPC channel) of every member, the one the calls use now first."""
        current = self._client.endpoint_in_use
        endpoints = sorted(self._client.endpoints.values(), key=lambda ep: ep is not current)
        return [(ep.netloc, ep.channel) for ep in endpoints]

    @property
    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call carries besides its request: the auth token, when there is one."""
        return tuple(self._client.metadata or ())

    def watch_stream(self) -> "WatchStream":
        """The one Watch stream that carries all this client's mirrors (`etcd_watch_stream`):
        made for the first, a new one once the last has closed and ended it."""
        from planaria.elastic.etcd_watch_stream import WatchStream

        with self._stream_lock:
            if self._stream is None or self._stream.ended:
                self._stream = WatchStream(self)
            return self._stream

    def close(self) -> None:
        """End the watch stream and its mirrors, and close the connections."""
        with self._stream_lock:
            stream, self._stream = self._stream, None
            lease_stream, self._lease_stream = self._lease_stream, None
        if stream is not None:
            stream.close()
        if lease_stream is not None:
            lease_stream.close()
        self._client.close()
