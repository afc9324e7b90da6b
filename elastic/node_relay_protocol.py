"""How a worker and its node's relay talk: frames, messages, and the relay's address.

A frame is a 4-byte big-endian length, then that many bytes of JSON: one request from
the worker, one answer from the relay, in turn on each connection (a worker opens a
connection per thread that talks at once, `planaria.elastic.node_relay_store`). Keys
are text; values are bytes, carried in base64 (a store's values are arbitrary bytes:
c10d's compare_set, a counter's decimal text, JSON records).

An answer is {"ok": result} or {"error": kind, "message": text}; `kind` names what the
worker raises: "timeout" (a wait ran out: the store's timeout error), "limit" (etcd
would refuse the write: `EtcdLimitExceeded`, with the relay's message naming the
limit), "refused" (a wrong token), "failed" (anything else, said as the relay met it).

The relay's address is a store URL, `node://host:port/token`: the scheme the worker's
`connect_store` resolves through the `planaria.stores` entry points, and a token that
only the agent and the workers it starts know (a process of another user on the node
cannot talk to the relay).

Torch-free: the agent uses it.
"""
from __future__ import annotations

import base64
import json
import struct

SCHEME = "node"
HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 * 2**20
"""A frame larger than this is refused as corrupt: the largest value a worker writes or
reads is an epoch record, which etcd limits to 1.5 MiB by default (and which a job
configured for a larger etcd limit still keeps far under this)."""


class RelayError(RuntimeError):
    """The relay answered with an error it has no more precise class for."""


def encode(message: dict) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise RelayError(f"a frame of {length} bytes from the node relay's peer is over {MAX_FRAME_BYTES}: "
                         "not a Planaria relay connection, or a corrupt one")
    return length


def decode(body: bytes) -> dict:
    return json.loads(body)


def pack(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode("ascii")


def unpack(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def relay_url(host: str, port: int, token: str) -> str:
    return f"{SCHEME}://{host}:{port}/{token}"


def parse_relay_url(url: str) -> tuple[str, int, str]:
    """(host, port, token) of `node://host:port/token`."""
    rest = url.removeprefix(f"{SCHEME}://")
    address, _, token = rest.partition("/")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not token:
        raise ValueError(f"a node relay's URL is node://host:port/token, got {url!r}")
    return host, int(port), token
