"""`--rdzv-backend etcd3`: the backend's get_state/set_state contract against a real etcd,
and stock torchrun with two agents ("nodes" on loopback) rendezvousing through it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError

from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.elastic.rendezvous import Etcd3RendezvousBackend


@pytest.fixture
def backend(etcd, request):
    return Etcd3RendezvousBackend(EtcdClient(EtcdSettings(endpoint=etcd.endpoint)), request.node.name)


def test_state_absent(backend):
    assert backend.name == "etcd3"
    assert backend.get_state() is None
    assert backend.set_state(b"x", token=12345) is None  # a token, but nothing to match


def test_set_when_absent_then_not_again(backend):
    state, token, ok = backend.set_state(b"first")
    assert (state, ok) == (b"first", True) and token > 0
    assert backend.get_state() == (b"first", token)
    state, token2, ok = backend.set_state(b"second")  # no token: only when absent
    assert (state, token2, ok) == (b"first", token, False)


def test_set_with_current_token_then_stale(backend):
    _, token, _ = backend.set_state(b"one")
    state, newer, ok = backend.set_state(b"two", token)
    assert (state, ok) == (b"two", True) and newer > token
    state, still, ok = backend.set_state(b"three", token)  # stale token
    assert (state, still, ok) == (b"two", newer, False)


def test_invalid_token(backend):
    backend.set_state(b"one")
    for token in ("not-a-revision", -3, 0, 2.5):
        state, _, ok = backend.set_state(b"two", token)
        assert (state, ok) == (b"one", False)


def test_corrupt_state(backend, etcd):
    EtcdClient(EtcdSettings(endpoint=etcd.endpoint)).put(backend.key, b"%%% not base64 %%%")
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.get_state()


def test_state_expires_its_ttl_after_the_last_write(etcd, request):
    """A finished rendezvous is closed in its state; without a TTL, its run id stayed
    closed forever (RendezvousClosedError on every later run). torch's etcd backends
    keep the state two hours after its last write; so does this one (`ttl`)."""
    import time

    client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint))
    backend = Etcd3RendezvousBackend(client, request.node.name, ttl_s=2)
    _, token, _ = backend.set_state(b"open")
    time.sleep(1.5)
    backend.set_state(b"closed", token)  # a write renews it
    time.sleep(1.5)
    assert backend.get_state() is not None
    time.sleep(2.5)
    assert backend.get_state() is None  # the run id is free again


def test_a_new_rendezvous_clears_the_store_an_earlier_run_left(backend, etcd):
    """Rounds count from 0 again in a new rendezvous under a run id: an earlier run's
    store keys (its master address, its barrier counters) would be read as this one's."""
    client = backend.client
    client.put(backend.store_prefix + "torch.rendezvous.x.0/MASTER_ADDR", b"old-host")
    client.put(backend.key.removesuffix("state") + "storex", b"not the store")  # a neighbour
    backend.set_state(b"new")
    assert client.keys_with_prefix(backend.store_prefix) == []
    assert client.get(backend.key.removesuffix("state") + "storex")[0] == b"not the store"
    _, token, _ = backend.set_state(b"new")  # not created again: nothing more is cleared
    client.put(backend.store_prefix + "live", b"1")
    backend.set_state(b"newer", token)
    assert client.keys_with_prefix(backend.store_prefix) == ["live"]


def test_unreachable_etcd_is_a_connection_error():
    client = EtcdClient(EtcdSettings(endpoint="127.0.0.1:1", timeout_s=0.2, retry_s=0.5))
    with pytest.raises(RendezvousConnectionError, match="127.0.0.1:1"):
        Etcd3RendezvousBackend(client, "job").get_state()


SCRIPT = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("RESULT", os.environ["GROUP_RANK"], os.environ["RANK"], os.environ["WORLD_SIZE"], float(t))
dist.destroy_process_group()
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_stock_torchrun_two_agents_through_etcd3(etcd, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
           "--rdzv-backend=etcd3", f"--rdzv-endpoint={etcd.endpoint}", "--rdzv-id=two-agents",
           "--monitor-interval=0.1", str(script)]
    agents = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    outs = [a.communicate(timeout=150) for a in agents]
    results = []
    for agent, (out, err) in zip(agents, outs):
        assert agent.returncode == 0, err[-3000:]
        results += [line.split()[1:] for line in out.splitlines() if line.startswith("RESULT")]
    assert sorted(results) == [["0", "0", "2", "3.0"], ["1", "1", "2", "3.0"]]
