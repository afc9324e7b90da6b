"""The scale harness's account of its CPU by kind of thread (`chaos.scale.thread_cpu`)."""
from __future__ import annotations

import threading
import time

from planaria.chaos.scale.thread_cpu import ThreadCpu, difference, kind_of, name_threads


def test_a_threads_kind_is_its_name_without_node_worker_or_epoch():
    assert kind_of("worker-node5.2") == "worker"
    assert kind_of("epoch-watcher-12") == "epoch-watcher"
    assert kind_of("lease-node3") == "lease"
    assert kind_of("ThreadPoolExecutor-0_3") == "ThreadPoolExecu"  # Linux keeps 15 characters
    assert kind_of("Thread-9 (channel_spin)") == "channel_spin"


def test_cpu_is_counted_for_the_kind_that_spent_it():
    name_threads()
    try:
        stop = threading.Event()

        def spin() -> None:
            while not stop.is_set():
                sum(range(1000))

        account = ThreadCpu(period_s=3600)  # sampled only when asked
        before = account.totals()
        spinner = threading.Thread(target=spin, name="epoch-watcher-7")
        idle = [threading.Thread(target=stop.wait, name=f"worker-node{i}.0") for i in range(20)]
        for thread in [spinner, *idle]:
            thread.start()
        time.sleep(1.0)
        spent = difference(account.totals(), before)
        stop.set()
        for thread in [spinner, *idle]:
            thread.join(10)
    finally:
        threading.setprofile(None)
    assert spent.get("epoch-watcher", 0.0) > 0.3, spent
    assert spent.get("worker", 0.0) < 0.1, spent
