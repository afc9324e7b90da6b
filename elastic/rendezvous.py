"""`etcd3`: a torchrun rendezvous backend on the etcd v3 API.

torch's own `etcd` and `etcd-v2` rendezvous backends speak etcd's v2 API, which etcd 3.4
turned off by default and 3.6 removed. This backend keeps torchrun's dynamic rendezvous
state in one etcd v3 key, `/planaria/torchrun/<run-id>/state`, and fences every write on
the key's mod revision (a compare-and-set in one transaction), which is the fencing
token torch's `RendezvousBackend` contract asks for. Registered through torch's
`torchrun.handlers` entry point, so stock torchrun finds it:

    torchrun --rdzv-backend etcd3 --rdzv-endpoint HOST:2379 --rdzv-id JOB --nnodes 2 ...

`--rdzv-conf` keys: `key_prefix` (default /planaria/torchrun/), `read_timeout` (s, per
request, default 5), `retry_s` (how long to retry an unreachable etcd, default 30),
`ttl` (s, default 7200: how long the state outlives its last write, as torch's etcd
backends keep theirs; a run id can be used again once it expired),
`ca_cert`, `cert_cert`, `cert_key`, `user`, `password`. The state is stored base64
encoded, so a value that is not (a corrupt state) is reported as such.
"""
from __future__ import annotations

import binascii
from base64 import b64decode, b64encode

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    create_handler,
)

from planaria.elastic.etcd_client import EtcdClient, EtcdSettings, EtcdUnavailable


class Etcd3RendezvousBackend(RendezvousBackend):
    """The rendezvous state in one etcd v3 key, fenced on its mod revision."""

    DEFAULT_TTL_S = 7200
    """torch's etcd backends' default: the state outlives its last write by two hours."""

    def __init__(self, client: EtcdClient, run_id: str, key_prefix: str = "/planaria/torchrun/",
                 ttl_s: int = DEFAULT_TTL_S):
        if not run_id:
            raise ValueError("the run id must not be empty; pass --rdzv-id")
        if ttl_s <= 0:
            raise ValueError(f"the rendezvous TTL must be positive, got {ttl_s} s (--rdzv-conf ttl=)")
        self.client = client
        self.key = f"{key_prefix.rstrip('/')}/{run_id}/state"
        self.store_prefix = f"{key_prefix.rstrip('/')}/{run_id}/store/"
        self.ttl_s = ttl_s
        self._lease = None

    @property
    def name(self) -> str:
        return "etcd3"

    def get_state(self) -> tuple[bytes, Token] | None:
        value, revision = self._call(self.client.get_with_revision, self.key)
        return None if value is None else (self._decode(value), revision)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token is not None and not (isinstance(token, int) and token > 0):
            # Not a token of ours: nothing can match it. Report what is there.
            current = self.get_state()
            return None if current is None else (*current, False)
        # The state is bound to a lease of `ttl_s`, renewed at each write (as torch's etcd
        # backends write it with a TTL): a finished (closed) rendezvous does not keep its run
        # id closed forever. Creating it clears the run's store of an earlier run's keys:
        # its rounds count from 0 again, and would read that run's addresses and counters.
        ok, value, revision = self._call(self._set, token, b64encode(state))
        if value is None:
            return None
        return self._decode(value), revision, ok

    def _set(self, token: Token | None, encoded: bytes) -> tuple[bool, bytes | None, int]:
        if self._lease is None or not self.client.refresh(self._lease):
            self._lease = self.client.lease(self.ttl_s)
        return self.client.set_if_revision(self.key, token, encoded, lease=self._lease,
                                           clear_prefix=self.store_prefix,
                                           why="torchrun's rendezvous state, which grows with the nodes that join")

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except EtcdUnavailable as err:
            raise RendezvousConnectionError(str(err)) from err

    def _decode(self, value: bytes) -> bytes:
        try:
            return b64decode(value, validate=True)
        except binascii.Error as err:
            raise RendezvousStateError(f"the rendezvous state in etcd key {self.key} is corrupt "
                                       "(not base64); delete the key to start over") from err


def settings_from_parameters(params: RendezvousParameters) -> EtcdSettings:
    endpoint = params.endpoint or "127.0.0.1:2379"
    if ":" not in endpoint:
        endpoint += ":2379"
    return EtcdSettings(
        endpoint=endpoint, ca_cert=params.get("ca_cert"), cert_cert=params.get("cert_cert"),
        cert_key=params.get("cert_key"), user=params.get("user"), password=params.get("password"),
        timeout_s=float(params.get("read_timeout", 5)), retry_s=float(params.get("retry_s", 30)))


def create_etcd3_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's handler for `--rdzv-backend etcd3`: the dynamic rendezvous on this backend,
    with its store (the workers' and agents' TCP rendezvous store) in etcd too."""
    from datetime import timedelta

    from planaria.elastic.etcd_store import EtcdStore

    client = EtcdClient(settings_from_parameters(params))
    prefix = params.get("key_prefix", "/planaria/torchrun/")
    backend = Etcd3RendezvousBackend(client, params.run_id, prefix,
                                     ttl_s=int(params.get("ttl", Etcd3RendezvousBackend.DEFAULT_TTL_S)))
    store = EtcdStore(client, backend.store_prefix.rstrip("/"),
                      timeout=timedelta(seconds=float(params.get("store_timeout", 300))))
    return create_handler(store, backend, params)


def handler():
    """The `torchrun.handlers` entry point: torch calls this and registers what it returns."""
    return create_etcd3_handler
