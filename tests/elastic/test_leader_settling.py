"""The leader's wait after etcd comes back (`Membership.settled`): after an outage that
could have cost an agent its lease renewal (a third of the TTL or more), decisions wait a
lease period; after a blip shorter than that (etcd frozen for a moment, a request
retried), none do. Against a real etcd, frozen with SIGSTOP."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.elastic.node_membership import Membership

pytestmark = pytest.mark.timeout(60)
FROZEN_S = 1.0


def freeze(etcd, seconds: float) -> threading.Thread:
    os.kill(etcd.process.pid, signal.SIGSTOP)
    thaw = threading.Timer(seconds, os.kill, args=(etcd.process.pid, signal.SIGCONT))
    thaw.start()
    return thaw


def membership(client: EtcdClient, ttl_s: int, said: list[str]) -> Membership:
    return Membership(client, "/settling/", node="node0", nproc=1, run_id="job", ttl_s=ttl_s, log=said.append)


def test_a_blip_holds_no_decision_and_a_longer_outage_holds_them_a_lease_period(etcd):
    client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint, timeout_s=0.2), on_outage=lambda line: None)
    try:
        client.put("/settling/k", b"1")
        thaw = freeze(etcd, FROZEN_S)
        began = time.monotonic()
        assert client.get("/settling/k")[0] == b"1"  # retried until etcd answers again
        thaw.join()
        assert time.monotonic() - began >= FROZEN_S * 0.9
        assert client.back_at is not None and FROZEN_S * 0.5 <= client.away_s < 5 * FROZEN_S
        said: list[str] = []
        # A 30 s lease is renewed every 10 s: a second's freeze cannot have cost a renewal.
        assert membership(client, 30, said).settled() and said == []
        # A 2 s lease is renewed every 0.67 s: the same freeze could have; the leader waits.
        short = membership(client, 2, said)
        assert not short.settled()
        assert said and "the leader waits" in said[-1]
        time.sleep(client.back_at + 2 + 2 - time.monotonic())
        assert short.settled()
    finally:
        os.kill(etcd.process.pid, signal.SIGCONT)
        client.close()
