"""The etcd-backed Store against a real etcd on loopback: its semantics, and process
groups (gloo) that rendezvous through it."""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from planaria.elastic.etcd_client import EtcdClient, EtcdSettings, EtcdUnavailable
from planaria.elastic.etcd_store import EtcdStore


@pytest.fixture
def store(etcd, request):
    client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint))
    return EtcdStore(client, f"/planaria/test/{request.node.name}", timeout=timedelta(seconds=2))


def test_set_get_check_delete(store):
    assert not store.check(["a"])
    store.set("a", b"1")
    store.set("b", "two")
    assert store.get("a") == b"1" and store.get("b") == b"two"
    assert store.check(["a", "b"]) and store.num_keys() == 2
    assert store.delete_key("a") and not store.check(["a"])


def test_get_waits_then_times_out_naming_the_key(store):
    with pytest.raises(dist.DistStoreError, match="missing|wait timeout"):
        store.get("never")


def test_add_is_atomic_across_clients(store, etcd):
    other = EtcdStore(EtcdClient(EtcdSettings(endpoint=etcd.endpoint)), store.prefix)
    assert store.add("n", 3) == 3
    assert other.add("n", 4) == 7
    assert store.add("n", 0) == 7


def test_compare_set(store):
    assert store.compare_set("k", b"", b"first") == b"first"  # absent: set
    assert store.compare_set("k", b"wrong", b"second") == b"first"  # not expected: unchanged
    assert store.compare_set("k", b"first", b"third") == b"third"


def test_one_read_of_a_key_or_of_every_key_under_a_prefix(store):
    """What the control plane polls with (`store_reads`), over etcd and over a TCPStore:
    present keys read, absent ones left out, a key outside the prefix refused."""
    from planaria.runtime.contract.store_reads import read_if_present, read_present

    tcp = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=2))
    for s in (store, tcp):
        s.set("epoch/3/status/a.0", b"A")
        s.set("epoch/3/status/b.0", b"B")
        s.set("epoch/30/status/c.0", b"C")  # a neighbouring prefix is not read
        assert read_if_present(s, "epoch/3/status/a.0") == b"A"
        assert read_if_present(s, "epoch/3/status/z.0") is None
        wanted = {w: f"epoch/3/status/{w}" for w in ("a.0", "b.0", "c.0")}
        assert read_present(s, "epoch/3/status/", wanted) == {"a.0": b"A", "b.0": b"B"}
        with pytest.raises(ValueError, match="not under"):
            read_present(s, "epoch/3/status/", {"x": "epoch/4/status/x"})
    assert store.items_under("epoch/3/status/") == {"epoch/3/status/a.0": b"A", "epoch/3/status/b.0": b"B"}


WORKER = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.elastic.etcd_store import EtcdStore
rank, endpoint = int(sys.argv[1]), sys.argv[2]
store = EtcdStore(EtcdClient(EtcdSettings(endpoint=endpoint)), "/planaria/test/pg")
dist.init_process_group("gloo", store=dist.PrefixStore("epoch/0/", store), rank=rank, world_size=2,
                        timeout=timedelta(seconds=30))
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print(float(t))
dist.destroy_process_group()
"""


def test_a_read_under_a_prefix_may_answer_more_than_grpcs_default_4_mib(store):
    """The controller reads every status of an epoch at once: 8.3 MiB of them at 4,096
    nodes of 8 workers (`tests/elastic/test_etcd_limits.py`). gRPC refuses answers over
    4 MiB unless told otherwise."""
    for i in range(5):
        store.set(f"status/{i}", bytes([i]) * 2**20)
    found = store.items_under("status/")
    assert sorted(found) == [f"status/{i}" for i in range(5)] and sum(map(len, found.values())) == 5 * 2**20


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_gloo_process_group_rendezvous_through_etcd(etcd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), etcd.endpoint], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=90) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == "3.0"


def test_unreachable_etcd_is_named_after_retries():
    client = EtcdClient(EtcdSettings(endpoint="127.0.0.1:1", timeout_s=0.2, retry_s=1.0))
    with pytest.raises(EtcdUnavailable, match="127.0.0.1:1"):
        client.get("/x")


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="host:port"):
        EtcdSettings(endpoint="localhost")
    with pytest.raises(ValueError, match="does not exist"):
        EtcdSettings(ca_cert=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="both user and password"):
        EtcdSettings(user="me")
    with pytest.raises(ValueError, match="keepalive_s must be at least 5 s"):
        EtcdSettings(keepalive_s=1.0)  # etcd would close the connection for pinging too often


def test_an_etcd_on_a_port_in_use_is_refused(etcd):
    """The etcd already there answered the health check, and the new one (which exits at
    once) looked started: `planaria etcd` said it served, then that it exited."""
    from planaria.elastic.etcd_server import EmbeddedEtcd

    with pytest.raises(RuntimeError, match=f"port {etcd.port} on 127.0.0.1 is in use"):
        EmbeddedEtcd(port=etcd.port).start(timeout_s=5)


def _coordinators(etcd, prefix: str, ranks: int = 2):
    from planaria.runtime.worker.coordination import StoreCoordinator

    return [StoreCoordinator(EtcdStore(EtcdClient(EtcdSettings(endpoint=etcd.endpoint)), prefix,
                                       timeout=timedelta(seconds=30)),
                             (f"node{r}", 0), node_address="127.0.0.1", connect_timeout_s=5) for r in range(ranks)]


@pytest.mark.timeout(120)
def test_an_epochs_groups_rendezvous_on_the_store_its_rank_0_hosts_not_in_etcd(etcd):
    """Over etcd, the plan's rank 0 hosts the epoch's bootstrap store and publishes where
    (`epoch/<e>/pg_store`); the other ranks find it there (waiting for it, if they come
    first) and a gloo group of them rendezvous on it: etcd holds the address, nothing else."""
    import threading
    import time

    import torch

    prefix = "/planaria/test/pg-store"
    coordinators = _coordinators(etcd, prefix)
    results = {}

    def rank(r: int) -> None:
        store = coordinators[r].rendezvous_store(3, host=r == 0)
        group = dist.ProcessGroupGloo(dist.PrefixStore("world/", store), r, 2, timedelta(seconds=20))
        tensor = torch.tensor([r + 1.0])
        group.allreduce([tensor]).wait()
        results[r] = tensor.item()

    other = threading.Thread(target=rank, args=(1,))
    other.start()  # first: it waits for the address
    time.sleep(0.3)
    rank(0)
    other.join(30)
    assert results == {0: 3.0, 1: 3.0}
    keys_in_etcd = EtcdClient(EtcdSettings(endpoint=etcd.endpoint)).items_with_prefix(prefix + "/")
    assert list(keys_in_etcd) == ["epoch/3/pg_store"]
    assert keys_in_etcd["epoch/3/pg_store"].decode().startswith("127.0.0.1:")


@pytest.mark.timeout(60)
def test_a_rank_waiting_for_its_epochs_store_gives_up_when_the_epoch_is_abandoned(etcd):
    """Its rank 0 died before it published the store: the control plane's end of the epoch
    ends the wait (a watch on the key, and on the epoch's end), not the store's timeout."""
    import threading
    import time

    prefix = "/planaria/test/pg-store-abandoned"
    (coordinator,) = _coordinators(etcd, prefix, ranks=1)
    store = coordinator.rendezvous_store(4)
    threading.Timer(0.3, coordinator.store.set, args=("epoch/4/reconfigure", "failure")).start()
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="epoch 4 was abandoned"):
        store.get("rank/0")
    assert time.monotonic() - start < 5


@pytest.mark.timeout(60)
def test_a_hosted_store_serves_until_its_host_enters_a_later_epoch(etcd):
    """Kept while the epoch's other ranks may still use it (a handoff, a peer snapshots'
    group connecting), closed once its host is in a later epoch."""
    import socket
    import time

    from planaria.runtime.worker.epoch_store import split_address

    prefix = "/planaria/test/pg-store-closed"
    host, other = _coordinators(etcd, prefix)
    host.rendezvous_store(5, host=True).set("k", b"1")
    address = split_address(host.store.get("epoch/5/pg_store").decode())
    assert other.rendezvous_store(5).get("k") == b"1"
    host.rendezvous_store(6, host=True)
    deadline = time.monotonic() + 5
    while True:
        try:
            socket.create_connection(address, timeout=1).close()
        except ConnectionRefusedError:
            break
        assert time.monotonic() < deadline, "epoch 5's store still serves"
        time.sleep(0.05)
    with pytest.raises(RuntimeError):  # its connection closed (or refused)
        other.rendezvous_store(5).get("never")
