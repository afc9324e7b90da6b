"""A `torch.distributed.Store` kept in etcd: rendezvous without a single host's TCP store.

Process groups (gloo and NCCL alike) exchange their addresses through a Store; torchrun's
is a TCPStore on one host, which dies with that host. `EtcdStore` keeps every key in
etcd under a prefix (a job's epoch, say `/planaria/<run>/epoch/<e>/pg/`), so any
surviving member of the etcd cluster serves it. The keys and how each operation maps to
etcd are `planaria.elastic.etcd_kv`'s; this is that, as a Store c10d can use.
"""
from __future__ import annotations

import math
from datetime import timedelta

import torch.distributed as dist

from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.elastic.etcd_kv import EtcdKeyValue


class EtcdStore(EtcdKeyValue, dist.Store):
    """Keys under `prefix` in the etcd of `client`, as a `torch.distributed.Store`."""

    timeout_error = dist.DistStoreError

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta = timedelta(seconds=300)):
        dist.Store.__init__(self)  # c10d's half first: pybind requires it
        EtcdKeyValue.__init__(self, client, prefix, timeout)


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
