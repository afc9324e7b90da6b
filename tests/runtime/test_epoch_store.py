"""An epoch's own bootstrap store (`planaria.runtime.worker.epoch_store`) under the
rendezvous's abandonment (`AbandonableStore`): waits answered by its server, ended at
once when the epoch is abandoned or its host dies, a connection to a dead host refused
at once, and threads that never hold each other's operations."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from planaria.runtime.worker.abandonable_store import AbandonableStore
from planaria.runtime.worker.epoch_store import EpochStoreClient, EpochStoreHost

LONG = timedelta(seconds=60)


def client(address: str, connect_timeout_s: float = 10.0) -> EpochStoreClient:
    return EpochStoreClient(address, connect_timeout_s=connect_timeout_s, timeout=LONG)


def later(seconds: float, action) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


def test_a_wait_is_answered_when_the_key_is_set():
    host = EpochStoreHost("127.0.0.1", connect_timeout_s=5)
    first, second = client(host.address), client(host.address)
    later(0.2, lambda: first.set("rank/1", b"there"))
    start = time.monotonic()
    assert second.get("rank/1") == b"there"
    assert 0.15 < time.monotonic() - start < 5
    assert second.check(["rank/1"]) and second.add("count", 2) == 2 and first.add("count", 3) == 5


def test_gloo_groups_rendezvous_on_it():
    """What c10d asks of a store, through `AbandonableStore` as the worker makes it: two
    ranks of a gloo group, each on a thread of its own, and an all-reduce over them."""
    import torch

    host = EpochStoreHost("127.0.0.1", connect_timeout_s=5)
    results = {}

    def rank(r: int) -> None:
        store = AbandonableStore(client(host.address), lambda: False, "abandoned")
        group = dist.ProcessGroupGloo(dist.PrefixStore("g/", store), r, 2, timedelta(seconds=20))
        tensor = torch.tensor([r + 1.0])
        group.allreduce([tensor]).wait()
        results[r] = tensor.item()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {0: 3.0, 1: 3.0}


def test_a_blocked_wait_ends_when_the_epoch_is_abandoned():
    host = EpochStoreHost("127.0.0.1", connect_timeout_s=5)
    abandoned = threading.Event()
    store = AbandonableStore(client(host.address), abandoned.is_set, "epoch 7 was abandoned")
    store.set("present", b"1")
    later(0.3, abandoned.set)
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="epoch 7 was abandoned"):
        store.get("rank-of-a-dead-peer")
    assert time.monotonic() - start < 2
    with pytest.raises(dist.DistStoreError, match="epoch 7 was abandoned"):
        store.set("after", b"1")  # the epoch's store is closed for this worker from now on
    assert client(host.address).get("present") == b"1", "the host serves on: others may still read"


class _Word:
    """The control plane's word on an epoch as a followed store gives it: a flag, and a
    generation that a change moves and whose waiters it wakes (`wait_changed`)."""

    def __init__(self):
        self.cond, self.count, self.looks, self.given = threading.Condition(), 0, 0, False

    def abandoned(self) -> bool:
        self.looks += 1
        return self.given

    def give(self) -> None:
        with self.cond:
            self.given, self.count = True, self.count + 1
            self.cond.notify_all()

    def generation(self) -> int:
        return self.count

    def wait_changed(self, since: int, timeout_s: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.count != since, timeout_s)


def test_a_followed_word_is_waited_for_not_polled():
    """Over a store that follows the epoch's end, a rank waiting for a late peer looks at
    the word when it changes (and once a second), not a hundred times a second; the word
    still ends the wait at once."""
    host = EpochStoreHost("127.0.0.1", connect_timeout_s=5)
    word = _Word()
    store = AbandonableStore(client(host.address), word.abandoned, "epoch 8 was abandoned",
                             changes=(word.generation, word.wait_changed))
    later(2.5, word.give)
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="epoch 8 was abandoned"):
        store.get("rank-of-a-late-peer")
    assert 2.4 < time.monotonic() - start < 3.5
    assert word.looks <= 5, f"{word.looks} looks in 2.5 s of waiting"


def test_threads_have_connections_of_their_own():
    """A thread waiting for a late key never holds another thread's operations (on one
    TCPStore connection it would: c10d runs one operation at a time on it)."""
    host = EpochStoreHost("127.0.0.1", connect_timeout_s=5)
    store = client(host.address)
    waiting = threading.Thread(target=store.get, args=("late",), daemon=True)
    waiting.start()
    time.sleep(0.2)
    start = time.monotonic()
    store.set("other", b"1")
    assert store.get("other") == b"1"
    assert time.monotonic() - start < 1
    store.set("late", b"1")
    waiting.join(5)
    assert not waiting.is_alive()


def test_the_hosts_death_fails_a_wait_and_later_connections_at_once():
    host = EpochStoreHost("127.0.0.1", connect_timeout_s=5)
    address = host.address
    store = AbandonableStore(client(address), lambda: False, "abandoned")
    store.set("mine", b"1")
    later(0.3, host.close)
    start = time.monotonic()
    with pytest.raises(RuntimeError):  # connection closed: a DistNetworkError
        store.get("never")
    assert time.monotonic() - start < 5
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="refused the connection"):
        client(address, connect_timeout_s=30).set("k", b"1")
    assert time.monotonic() - start < 5, "refused at once, not retried until the connect timeout"


@pytest.fixture
def silent_address():
    """host:port of a listener whose queue of connections is full: a new connection is
    never answered there (its SYN dropped), as at a host cut off the network."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = []
    for _ in range(3):
        pending = socket.socket()
        pending.setblocking(False)
        try:
            pending.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        queued.append(pending)
    time.sleep(0.1)
    yield f"127.0.0.1:{port}"
    for s in [listener, *queued]:
        s.close()


def test_an_unreachable_host_is_given_up_at_the_connect_timeout_or_when_abandoned(silent_address):
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="did not answer within 2 s"):
        client(silent_address, connect_timeout_s=2).set("k", b"1")
    assert time.monotonic() - start < 5
    abandoned = threading.Event()
    store = AbandonableStore(client(silent_address, connect_timeout_s=30), abandoned.is_set, "epoch 3 was abandoned")
    later(0.3, abandoned.set)
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="epoch 3 was abandoned"):
        store.set("k", b"1")
    assert time.monotonic() - start < 5
