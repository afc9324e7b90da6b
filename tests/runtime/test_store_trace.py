"""A worker's store trace (`PLANARIA_STORE_TRACE`): one line per request, with the keys
c10d's PrefixStore gives it, made the way the worker would make it untraced."""
from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from planaria.runtime.contract import env
from planaria.runtime.contract.store_reads import read_if_present
from planaria.runtime.worker.coordination import StoreCoordinator, connect_store
from planaria.runtime.worker.store_trace import TracingStore, trace_path, traced


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class OneRead(dist.Store):
    """A store that reads a key that may be absent in one request (as the etcd store does)."""

    def __init__(self):
        super().__init__()
        self.base = dist.HashStore()

    def set(self, key, value) -> None:
        self.base.set(key, value)

    def get_if_present(self, key: str) -> bytes | None:
        return self.base.get(key) if self.base.check([key]) else None


def test_a_groups_rendezvous_through_prefix_stores_is_traced_with_its_full_keys(tmp_path):
    store = TracingStore(dist.HashStore(), tmp_path / "node0.0.jsonl")
    rendezvous = StoreCoordinator(store, ("node0", 0)).rendezvous_store(3)

    def rank(r: int) -> None:
        dist.ProcessGroupGloo(dist.PrefixStore("peer-snapshots/", rendezvous), r, 2, timedelta(seconds=30))
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ops = lines(tmp_path / "node0.0.jsonl")
    sets = sorted((op["key"], op["bytes"]) for op in ops if op["op"] == "set")
    assert sets == [("epoch/3/pg//peer-snapshots//0/0", 170), ("epoch/3/pg//peer-snapshots//0/1", 170)]
    assert {op["key"] for op in ops if op["op"] == "get"} == {k for k, _ in sets}
    assert all(op["s"] >= 0 and op["t"] > 0 for op in ops)


def test_a_read_of_a_key_that_may_be_absent_is_one_request_where_the_store_makes_it_one(tmp_path):
    fast = TracingStore(OneRead(), tmp_path / "fast.jsonl")
    slow = TracingStore(dist.HashStore(), tmp_path / "slow.jsonl")
    for store in (fast, slow):
        store.set("epoch", "2")
        assert read_if_present(store, "epoch") == b"2" and read_if_present(store, "done") is None
    assert [(op["op"], op.get("key") or op.get("keys")) for op in lines(tmp_path / "fast.jsonl")] == [
        ("set", "epoch"), ("get_if_present", "epoch"), ("get_if_present", "done")]
    assert [(op["op"], op.get("key") or op.get("keys")) for op in lines(tmp_path / "slow.jsonl")] == [
        ("set", "epoch"), ("check", ["epoch"]), ("get", "epoch"), ("check", ["done"])]


def test_a_failed_request_is_traced_with_its_error(tmp_path):
    store = TracingStore(dist.HashStore(), tmp_path / "t.jsonl")
    store.set_timeout(timedelta(milliseconds=50))
    with pytest.raises(dist.DistStoreError):
        store.get("never")
    (line,) = lines(tmp_path / "t.jsonl")
    assert line["op"] == "get" and line["key"] == "never" and line["error"] == "DistStoreError"


def test_the_environment_names_the_directory_and_the_worker(tmp_path):
    environ = {env.STORE_TRACE: str(tmp_path), env.NODE: "node2", env.LOCAL_RANK: "1"}
    store = traced(dist.HashStore(), environ)
    assert isinstance(store, TracingStore) and store.path == trace_path(tmp_path, ("node2", 1))
    assert store.path.name == "node2.1.jsonl"
    plain = dist.HashStore()
    assert traced(plain, {}) is plain
    with pytest.raises(RuntimeError, match="PLANARIA_NODE"):
        traced(plain, {env.STORE_TRACE: str(tmp_path)})


def test_connect_store_traces_the_workers_store_when_asked(tmp_path):
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    environ = {env.STORE_TRACE: str(tmp_path), env.NODE: "node0", env.LOCAL_RANK: "0"}
    store = connect_store(f"127.0.0.1:{master.port}", timeout_s=10, environ=environ)
    StoreCoordinator(store, ("node0", 0)).mark_ready(4)
    assert lines(tmp_path / "node0.0.jsonl")[0] | {"t": 0, "s": 0} == {
        "op": "set", "key": "ready/node0.0", "bytes": 1, "t": 0, "s": 0}
    assert not isinstance(connect_store(f"127.0.0.1:{master.port}", timeout_s=10, environ={}), TracingStore)
