"""An epoch record against etcd's request limit, checked where the record is made.

The record of an epoch (`EpochRecord`: the plan, and the transfers after a loss) is one
etcd key, written in one request, and grows with the job: 475 KiB at 4,096 nodes of 8
GPUs of LLaMA 3 70B, 486 KiB after a node is lost, 601 KiB at 1,024 nodes, whose re-plan
re-cuts the pipelines (docs/control_plane.md, "etcd's
limits"). etcd refuses a request over `--max-request-bytes` (1.5 MiB by default). The
client would refuse it too, before sending (`planaria.elastic.etcd_limits`), but only
with the key's name; here the controller learns it first, with what makes the record
big:

- over half the limit, once per controller: a warning naming the size, the limit, the
  nodes and the transfers, so that an operator hears of the limit long before a larger
  job reaches it;
- over the limit: `JobFailed`, with the same figures and the flag to raise, before the
  record's compare-and-set: nothing of the publication is written.

Only a store in etcd has the limit (`EtcdKeyValue.limits`); over any other store (the
local launcher's TCPStore, a test's HashStore) nothing is checked.
"""
from __future__ import annotations

from typing import Callable

from planaria.elastic.controller_errors import JobFailed
from planaria.elastic.etcd_limits import EtcdLimits, readable
from planaria.runtime.contract.epochs import EpochRecord


class RecordLimit:
    """The controller's check of each epoch record it publishes (module docstring)."""

    def __init__(self, store, log: Callable[[str], None] = print):
        self.store = store
        self.log = log
        self._warned = False

    @property
    def limits(self) -> EtcdLimits | None:
        """etcd's limits when the store is in etcd (its client's, as they are now); None:
        a store without them."""
        return getattr(self.store, "limits", None)

    def check(self, key: str, record: EpochRecord, text: str) -> int | None:
        """The size of the request that writes `text` (`record`'s JSON) under `key` with
        the controller's compare-and-set (None: not a store in etcd). `JobFailed` when it
        is over etcd's limit; a warning, once, when it is over half of it."""
        limits = self.limits
        if limits is None:
            return None
        size = self.store.compare_set_bytes(key, "", text)
        limit = limits.max_request_bytes
        if size > limit:
            raise JobFailed(f"the record of epoch {record.plan.epoch} takes {readable(size)} in etcd's request, "
                            f"over etcd's request limit of {readable(limit)}: {contents(record)}. "
                            "Start etcd with a larger --max-request-bytes and give Planaria the same "
                            "(PLANARIA_ETCD_MAX_REQUEST_BYTES, EtcdSettings.max_request_bytes), or run fewer nodes")
        if limits.near(size) and not self._warned:
            self._warned = True
            self.log(f"controller: warning: the record of epoch {record.plan.epoch} takes {readable(size)} in etcd's "
                     f"request, {size / limit:.0%} of etcd's request limit of {readable(limit)} (--max-request-bytes): "
                     f"{contents(record)}; a larger job may pass it (the job would then fail), so raise "
                     "etcd's --max-request-bytes and PLANARIA_ETCD_MAX_REQUEST_BYTES before it does")
        return size


def contents(record: EpochRecord) -> str:
    """What makes an epoch record big: its nodes, workers and pipelines, and its transfers."""
    plan = record.plan
    return (f"a plan of {len(plan.nodes())} nodes ({plan.world_size} workers) in {len(plan.pipelines)} pipelines, "
            f"and {len(record.transfers)} layer transfers")
