"""What etcd served, from its own counters: requests by method, and bytes, summed over
the cluster's members (each member's `/metrics`, Prometheus' text format).

Requests are counted as the gRPC messages etcd received (`grpc_server_msg_received_total`):
one per unary call (Range, Put, Txn, LeaseGrant...), one per message on a stream (a
watch's creation, a lease keep-alive). A scrape is plain HTTP, not gRPC: it is not
among what it counts.
"""
from __future__ import annotations

import urllib.request
from collections import Counter
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class EtcdCounts:
    """etcd's counters at one moment, summed over the members."""

    requests: Counter = field(default_factory=Counter)
    """{gRPC method: messages received}."""
    received_bytes: float = 0.0
    sent_bytes: float = 0.0

    @property
    def total(self) -> int:
        return int(sum(self.requests.values()))

    def __sub__(self, earlier: "EtcdCounts") -> "EtcdCounts":
        requests = Counter({m: n - earlier.requests.get(m, 0) for m, n in self.requests.items()})
        return EtcdCounts(+requests, self.received_bytes - earlier.received_bytes,
                          self.sent_bytes - earlier.sent_bytes)


def scrape(endpoints: list[str], retry_s: float = 300.0) -> EtcdCounts:
    """The counters of every member at `endpoints` ("host:port", their client URLs). A
    member that does not answer is asked again for `retry_s`: at 1,024 simulated nodes
    the machine ran at a load average of 750 and a 10 s scrape timed out, which ended
    the harness's run before its last fault."""
    requests: Counter = Counter()
    received = sent = 0.0
    for endpoint in endpoints:
        text = _metrics_text(endpoint, retry_s)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "grpc_server_msg_received_total":
                    requests[sample.labels.get("grpc_method", "?")] += sample.value
                elif sample.name == "etcd_network_client_grpc_received_bytes_total":
                    received += sample.value
                elif sample.name == "etcd_network_client_grpc_sent_bytes_total":
                    sent += sample.value
    return EtcdCounts(requests, received, sent)


def _metrics_text(endpoint: str, retry_s: float) -> str:
    for attempt in Retrying(retry=retry_if_exception_type(OSError), stop=stop_after_delay(retry_s),
                            wait=wait_exponential(max=10), reraise=True):
        with attempt, _DIRECT.open(f"http://{endpoint}/metrics", timeout=30) as reply:
            return reply.read().decode()
    raise AssertionError("unreachable: tenacity reraises")
