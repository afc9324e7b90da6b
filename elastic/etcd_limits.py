"""etcd's limits on one request, as the client knows them: what is checked before a write
or a transaction is sent, and the error that says which limit a request would break.

etcd refuses, by default, any request whose raft entry is over 1.5 MiB
(`--max-request-bytes`, 1572864: "etcdserver: request is too large") and any transaction
with more than 128 operations in its compares, its success or its failure branch
(`--max-txn-ops`: "etcdserver: too many operations in txn request"). Both errors come
back only once the request is on the wire, as a bare gRPC INVALID_ARGUMENT that names
neither the key nor the flag; and nothing about them is transient. So the client checks
first (`EtcdLimits.check`) and raises `EtcdLimitExceeded`, which names the key, the
size, the limit, the flag to raise and, when the caller knows it, what in the job makes
the request big.

The size of a request is counted as etcd counts it, less its protobuf framing: the bytes
of every key, value and range end it carries (a key compared and then written counts
twice, as it is sent twice), plus an allowance for the framing (`envelope_bytes`). The
allowance was fitted to etcd 3.5 (`tests/elastic/test_etcd_limits.py` finds the largest
value etcd takes): its framing is 24 bytes for a put, 40 for a create-if-absent
transaction, about 57 for `set_if_revision`'s four operations, some 10 bytes more with a
lease, and the user name with authentication. The allowance covers each with room to
spare, and for Planaria's own requests (up to four operations) it is at most 72 bytes
over etcd's framing: the client refuses nothing that etcd would take by more than that.

Torch-free and without gRPC: the controller checks an epoch record with it before the
record is written (`planaria.elastic.controller`).
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_REQUEST_BYTES = 1572864
"""etcd's default `--max-request-bytes` (1.5 MiB)."""
MAX_TXN_OPS = 128
"""etcd's default `--max-txn-ops`."""
REQUEST_ENVELOPE_BYTES = 64
"""The allowance for the framing of a whole request (raft header, field tags, lengths)."""
OP_ENVELOPE_BYTES = 16
"""The allowance for the framing of each compare and each operation (a lease id included)."""
WARN_FRACTION = 0.5
"""A request over this fraction of the limit is worth a warning: the job grows with its
nodes, and an operator should learn of the limit long before a job reaches it."""


class EtcdLimitExceeded(ValueError):
    """A request etcd would refuse for its size or its number of operations; not transient,
    so never retried: the message says which limit, and which etcd flag raises it."""


@dataclass(frozen=True)
class EtcdLimits:
    """The limits of the etcd a client talks to (etcd's defaults unless it was started
    with other `--max-request-bytes` / `--max-txn-ops`)."""

    max_request_bytes: int = MAX_REQUEST_BYTES
    max_txn_ops: int = MAX_TXN_OPS
    user: str | None = None
    """With authentication, every request carries the user name: it counts."""

    def __post_init__(self) -> None:
        if self.max_request_bytes < 256:  # below, not even a small key and its framing fit
            raise ValueError(f"max_request_bytes must be etcd's --max-request-bytes (default {MAX_REQUEST_BYTES}), "
                             f"at least 256, got {self.max_request_bytes}")
        if self.max_txn_ops < 3:
            raise ValueError(f"max_txn_ops must be etcd's --max-txn-ops (default {MAX_TXN_OPS}), at least 3 "
                             f"(Planaria's own transactions have up to 3 operations a branch), got {self.max_txn_ops}")

    def envelope_bytes(self, ops: int) -> int:
        """The allowance for the framing of a request of `ops` compares and operations."""
        return REQUEST_ENVELOPE_BYTES + OP_ENVELOPE_BYTES * ops + len((self.user or "").encode())

    def request_bytes(self, parts: list[bytes], ops: int) -> int:
        """The size of a request carrying `parts` (every key, value and range end in it) in
        `ops` compares and operations, as checked against `max_request_bytes`."""
        return sum(len(part) for part in parts) + self.envelope_bytes(ops)

    def near(self, size: int) -> bool:
        """`size` is over the warning fraction of the limit."""
        return size > WARN_FRACTION * self.max_request_bytes

    def txn_bytes(self, compare: list, success: list, failure: list) -> int:
        """The size of a transaction of `pyetcd.transactions` compares and operations."""
        ops = [*compare, *success, *failure]
        return self.request_bytes([part for op in ops for part in op_parts(op)], len(ops))

    def check(self, what: str, key: str, size: int, ops: int = 1, *, why: str | None = None) -> None:
        """`EtcdLimitExceeded` when a request of `size` bytes, or a transaction whose
        largest branch (compares, success or failure: etcd limits each) has `ops`
        operations, is over the limits; `what` says what the request does (as in the
        client's other errors), `why` what makes it big."""
        because = f" ({why})" if why else ""
        if ops > self.max_txn_ops:
            raise EtcdLimitExceeded(
                f"{what}: a transaction of {ops} operations on key {key!r} is over etcd's limit of "
                f"{self.max_txn_ops}{because}; etcd would refuse it. Start etcd with a larger "
                f"--max-txn-ops and give Planaria the same (EtcdSettings.max_txn_ops, PLANARIA_ETCD_MAX_TXN_OPS), "
                "or split the transaction")
        if size > self.max_request_bytes:
            raise EtcdLimitExceeded(
                f"{what}: the request for key {key!r} is {readable(size)}, {self.envelope_bytes(ops)} bytes of it "
                f"allowed for etcd's framing, over etcd's request limit of {readable(self.max_request_bytes)}"
                f"{because}; "
                f"etcd would refuse it. Start etcd with a larger --max-request-bytes and give Planaria the same "
                "(EtcdSettings.max_request_bytes, PLANARIA_ETCD_MAX_REQUEST_BYTES)")


def readable(size: int) -> str:
    """`size` bytes, for messages: "1572864 bytes (1.50 MiB)"."""
    if size >= 2**20:
        return f"{size} bytes ({size / 2**20:.2f} MiB)"
    return f"{size} bytes ({size / 2**10:.1f} KiB)" if size >= 2**10 else f"{size} bytes"


def op_parts(op) -> list[bytes]:
    """The keys, values and range ends an operation or a compare of `pyetcd.transactions`
    carries (a compare of a version or a revision carries a number: its few bytes are in
    the allowance)."""
    parts = [getattr(op, "key", None), getattr(op, "range_end", None)]
    value = getattr(op, "value", None)
    if isinstance(value, (bytes, str)):
        parts.append(value)
    return [part.encode() if isinstance(part, str) else part for part in parts if part is not None]
