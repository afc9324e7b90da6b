"""A node's relay (elastic/node_relay.py) against a real etcd, with eight workers' stores
(elastic/node_relay_store.py) on real sockets: what etcd serves for the node is one
request where eight workers each made one (the record, the follows, the statuses), and
every worker still sees what it saw over etcd (values, waits woken by changes, errors)."""
from __future__ import annotations

import threading
import time
import urllib.request
from datetime import timedelta

import pytest
import torch.distributed as dist

from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.elastic.etcd_kv import EtcdKeyValue
from planaria.elastic.etcd_limits import EtcdLimitExceeded
from planaria.elastic.etcd_server import EmbeddedEtcdCluster
from planaria.elastic.node_relay import NodeRelay
from planaria.elastic.node_relay_protocol import relay_url
from planaria.elastic.node_relay_store import NodeRelayStore
from planaria.runtime.contract import keys
from planaria.runtime.worker.coordination import connect_store

pytestmark = pytest.mark.timeout(120)
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
WORKERS = 8


@pytest.fixture(scope="module")
def etcd():
    with EmbeddedEtcdCluster(1) as cluster:
        yield cluster.endpoint


@pytest.fixture
def node(etcd, request):
    """A relay over a fresh job prefix, the agent's store, and eight workers' stores."""
    client = EtcdClient(EtcdSettings(endpoint=etcd))
    store = EtcdKeyValue(client, f"/planaria/{request.node.name}/")
    relay = NodeRelay(store, unfollow_linger_s=0.5, **getattr(request, "param", {})).start()
    workers = [connect_store(relay.url) for _ in range(WORKERS)]
    yield store, relay, workers
    for worker in workers:
        worker.close()
    relay.close()
    client.close()


def requests(endpoint: str) -> float:
    """Every gRPC message etcd has received (unary requests, and each message of a stream)."""
    with _DIRECT.open(f"http://{endpoint}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("grpc_server_msg_received_total{"))


def at_once(calls) -> list:
    """Run every call on a thread of its own, all started together; their results."""
    results: list = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i, call):
        start.wait()
        results[i] = call()
    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_a_record_is_read_once_for_the_node(node, etcd):
    store, relay, workers = node
    record = b"{" + b"x" * 100_000 + b"}"
    store.set(keys.epoch_record(1), record)
    before = requests(etcd)
    found = at_once([lambda w=w: w.get(keys.epoch_record(1)) for w in workers])
    assert found == [record] * WORKERS
    assert workers[0].get(keys.epoch_record(1)) == record  # later: from what the relay kept
    assert requests(etcd) - before == 1
    # A key the contract does not write once is read from etcd each time: never stale.
    store.set(keys.PROGRESS, b"1")
    assert workers[1].get_if_present(keys.PROGRESS) == b"1"
    store.set(keys.PROGRESS, b"2")
    assert workers[2].get_if_present(keys.PROGRESS) == b"2"


def test_the_workers_statuses_go_in_one_transaction(node, etcd):
    store, relay, workers = node
    status = b'{"loss": 4.352497431985631}' * 20
    before = requests(etcd)
    at_once([lambda i=i, w=w: w.set(keys.epoch_status(3, ("node0", i)), status) for i, w in enumerate(workers)])
    assert requests(etcd) - before <= 2  # one group commit, or two when one write came late
    assert store.items_under(keys.epoch_statuses(3)) == {keys.epoch_status(3, ("node0", i)): status
                                                          for i in range(WORKERS)}


def _in_epoch(workers, epoch: int) -> None:
    """Each worker runs `epoch`: it follows the epoch's end, as its epoch watcher does."""
    for w in workers:
        w.follow(keys.epoch_reconfigure(epoch))


def _report(worker, i: int, epoch: int = 4) -> float:
    """Worker i's status of `epoch`, written; when its write returned (monotonic)."""
    worker.set(keys.epoch_status(epoch, ("node0", i)), b'{"loss": 4.352497431985631}')
    return time.monotonic()


def test_a_late_workers_status_is_waited_for_one_transaction_a_node(node, etcd):
    store, relay, workers = node
    _in_epoch(workers, 4)
    before, started = requests(etcd), time.monotonic()
    late = threading.Timer(1.0, _report, args=(workers[-1], WORKERS - 1))
    late.start()
    returned = at_once([lambda i=i, w=w: _report(w, i) for i, w in enumerate(workers[:-1])])
    late.join()
    assert requests(etcd) - before == 1  # one transaction for the node, not one per late worker
    assert min(returned) - started >= 0.9  # held for the late one
    assert len(store.items_under(keys.epoch_statuses(4))) == WORKERS
    # A write that is not a report of an epoch the worker is in is not held.
    started = time.monotonic()
    workers[0].set(keys.epoch_status(9, ("node0", 0)), b"{}")
    assert time.monotonic() - started < 1.0


def test_a_gone_worker_is_not_waited_for(node, etcd):
    store, relay, workers = node
    _in_epoch(workers, 4)
    workers[-1].close()  # as its process's exit closes its connection
    started = time.monotonic()
    at_once([lambda i=i, w=w: _report(w, i) for i, w in enumerate(workers[:-1])])
    assert time.monotonic() - started < 2.0
    assert len(store.items_under(keys.epoch_statuses(4))) == WORKERS - 1


@pytest.mark.parametrize("node", [{"report_linger_s": 0.5}], indirect=True)
def test_a_worker_that_never_reports_holds_the_others_no_longer_than_the_linger(node, etcd):
    store, relay, workers = node
    _in_epoch(workers, 4)
    started = time.monotonic()
    at_once([lambda i=i, w=w: _report(w, i) for i, w in enumerate(workers[:-1])])
    assert 0.4 <= time.monotonic() - started < 3.0
    assert len(store.items_under(keys.epoch_statuses(4))) == WORKERS - 1
    started = time.monotonic()
    _report(workers[-1], WORKERS - 1)  # late, after the linger: at once
    assert time.monotonic() - started < 0.4


def test_a_key_followed_by_every_worker_is_watched_once(node, etcd):
    store, relay, workers = node
    key = keys.epoch_reconfigure(5)
    before = requests(etcd)
    at_once([lambda w=w: w.follow(key) for w in workers])
    # The mirror's first read and its watch (whose create message etcd may count a moment
    # after the follow returned: the mirror watches from the read's revision on).
    deadline = time.monotonic() + 5
    while requests(etcd) - before < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    assert requests(etcd) - before == 2
    since = [w.generation() for w in workers]
    woken = at_once([lambda w=w, s=s: w.wait_changed(s, 10.0) for w, s in zip(workers, since)]
                    + [lambda: time.sleep(0.3) or store.set(key, keys.FAILURE)])
    assert woken[:WORKERS] == [True] * WORKERS
    quiet = requests(etcd)
    assert [w.get_if_present(key) for w in workers] == [keys.FAILURE.encode()] * WORKERS
    assert requests(etcd) == quiet  # answered by the node's mirror
    # Seven drop it: still followed for the eighth. The last drop ends the watch (after the linger).
    for w in workers[1:]:
        w.unfollow(key)
    assert store.followed_key(key)
    workers[0].unfollow(key)
    deadline = time.monotonic() + 5
    while store.following(key) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not store.following(key)


def test_a_worker_that_dies_takes_its_follows_with_it(node):
    store, relay, workers = node
    workers[0].follow(keys.EPOCH)
    assert store.following(keys.EPOCH)
    workers[0].close()  # as its process's exit closes its connections
    deadline = time.monotonic() + 5
    while store.following(keys.EPOCH) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not store.following(keys.EPOCH)


def test_the_agents_own_follows_are_left_alone(node):
    store, relay, workers = node
    store.follow(keys.DONE)
    workers[0].follow(keys.DONE)
    workers[0].unfollow(keys.DONE)
    time.sleep(1.0)  # past the linger
    assert store.following(keys.DONE)


def test_errors_are_the_stores_own(node):
    store, relay, workers = node
    workers[0].set_timeout(timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        workers[0].get("never-written")
    with pytest.raises(EtcdLimitExceeded, match="max-request-bytes"):
        workers[1].set("huge", b"x" * (2 * 2**20))
    assert workers[1].compare_set("cas", "", "first") == b"first"
    assert workers[2].compare_set("cas", "", "second") == b"first"
    assert workers[3].add("count", 2) == 2 and workers[4].add("count", 3) == 5
    assert workers[5].check(["cas", "count"]) and not workers[5].check(["cas", "absent"])


def test_a_wrong_token_is_refused_and_a_gone_relay_is_said(node):
    store, relay, workers = node
    with pytest.raises(Exception, match="wrong or missing token"):
        NodeRelayStore(relay_url(relay.host, relay.port, "not-the-token"))
    relay.close()
    with pytest.raises(ConnectionError, match="is this node's agent alive"):
        workers[0].get_if_present(keys.EPOCH)
