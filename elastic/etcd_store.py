"""A `torch.distributed.Store` kept in etcd: rendezvous without a single host's TCP store.

Process groups (gloo and NCCL alike) exchange their addresses through a Store; torchrun's
is a TCPStore on one host, which dies with that host. `EtcdStore` keeps every key in
etcd under a prefix (a job's epoch, say `/planaria/<run>/epoch/<e>/pg/`), so any
surviving member of the etcd cluster serves it. It also carries the job's coordination
keys (`planaria.runtime.coordination`), so the controller and workers can run over etcd
exactly as they run over a TCPStore.

What each operation maps to:
- `set`, `get` (waits until the key exists, up to the store's timeout), `check`,
  `wait`, `delete_key`, `num_keys` (keys under the prefix): plain etcd reads and writes;
- `add`: a compare-and-swap loop on the key's version (etcd has no atomic increment);
- `compare_set`: one transaction comparing the value.
Waiting is polling every 10 ms: a rendezvous touches few keys, and polling needs no
watch stream to keep alive.
"""
from __future__ import annotations

import math
import time
from datetime import timedelta

import torch.distributed as dist

from planaria.elastic.etcd_client import EtcdClient, EtcdSettings

_POLL_S = 0.01


class EtcdStore(dist.Store):
    """Keys under `prefix` in the etcd of `client`."""

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta = timedelta(seconds=300)):
        super().__init__()
        self.client = client
        self.prefix = prefix.rstrip("/") + "/"
        self._timeout = timeout

    # -- helpers --------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return self.prefix + key

    def _wait_for(self, keys: list[str], timeout: timedelta | None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        missing = list(keys)
        while missing:
            missing = [k for k in missing if self.client.get(self._key(k))[0] is None]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"wait timeout after {limit * 1000:.0f}ms, keys: "
                                          f"{[self._key(k) for k in missing]} in etcd {self.client.endpoint}")
            time.sleep(_POLL_S)

    # -- the Store interface --------------------------------------------------------
    def set(self, key: str, value) -> None:
        self.client.put(self._key(key), _bytes(value))

    def get(self, key: str) -> bytes:
        self._wait_for([key], None)
        return self.client.get(self._key(key))[0]

    def check(self, keys: list[str]) -> bool:
        return all(self.client.get(self._key(k))[0] is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_for(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        return self.client.atomic_add(self._key(key), int(amount))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.client.compare_and_set(self._key(key), _bytes(expected), _bytes(desired))

    def delete_key(self, key: str) -> bool:
        return self.client.delete(self._key(key))

    def num_keys(self) -> int:
        return self.client.count_prefix(self.prefix)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return self._timeout


def _bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # c10d passes a list of ints


def store_from_url(url: str, timeout_s: float = 300.0) -> EtcdStore:
    """`etcd://host:port/prefix` (the `planaria.stores` entry point for etcd), with the TLS
    and credentials of `EtcdSettings.from_env`. A worker's store waits out an etcd outage
    however long it lasts: the worker lives as long as its agent, which decides when to
    give up on etcd."""
    rest = url.removeprefix("etcd://")
    endpoint, _, prefix = rest.partition("/")
    if not prefix:
        raise ValueError(f"etcd store URL needs a key prefix: etcd://host:port/planaria/<run-id>, got {url!r}")
    return EtcdStore(EtcdClient(EtcdSettings.from_env(endpoint, retry_s=math.inf)), "/" + prefix,
                     timeout=timedelta(seconds=timeout_s))
