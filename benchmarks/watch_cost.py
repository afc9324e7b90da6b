"""What waiting for a key costs etcd: polls against watches (`elastic/etcd_watch.Mirror`).

    python benchmarks/watch_cost.py [--keys 64] [--seconds 5] [--poll-s 0.2] [--changes 50]

An embedded etcd, `--keys` keys that nobody writes (a worker's epoch `reconfigure` key
each, as they wait for one). Two ways of waiting, one after the other, for `--seconds`:
  poll    every key read every `--poll-s` (the workers' poll: 0.2 s)
  watch   one Mirror per key
Reported: the Range calls etcd handled per second and the messages its Watch streams
received (from etcd's own /metrics), the mirrors' own counts, and the delay from a put to
the waiter seeing it (median over `--changes` puts on one key), for each way.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine_load import busy_seconds  # noqa: E402

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def server_counts(endpoint: str) -> tuple[float, float]:
    """(Range calls handled, messages received on Watch streams) since etcd started."""
    with _DIRECT.open(f"http://{endpoint}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    count = lambda metric, method: sum(float(ln.rsplit(" ", 1)[1]) for ln in lines  # noqa: E731
                                       if ln.startswith(metric + "{") and f'grpc_method="{method}"' in ln)
    return count("grpc_server_handled_total", "Range"), count("grpc_server_msg_received_total", "Watch")


def poll_quietly(client, keys: list[str], seconds: float, poll_s: float) -> None:
    """Every key read every poll_s, as that many workers would."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        for key in keys:
            client.get(key)
        time.sleep(max(0.0, poll_s - (time.monotonic() - started)))


def poll_delay(client, key: str, changes: int, poll_s: float) -> float:
    """Median delay from a put to a poller seeing it."""
    delays = []
    for i in range(changes):
        value, seen = str(i).encode(), threading.Event()

        def poller():
            while client.get(key)[0] != value:
                time.sleep(poll_s)
            seen.set()
        thread = threading.Thread(target=poller)
        thread.start()
        time.sleep(poll_s * (i % 7) / 7)  # the put falls anywhere in the poll's period
        put_at = time.monotonic()
        client.put(key, value)
        seen.wait()
        delays.append(time.monotonic() - put_at)
        thread.join()
    return statistics.median(delays)


def watch_delay(client, mirror, key: str, changes: int) -> float:
    """Median delay from a put to the mirror's view holding it."""
    delays = []
    for i in range(changes):
        value = f"w{i}".encode()
        started = time.monotonic()
        client.put(key, value)
        assert mirror.wait_until(lambda view: view.get("") == value, 10)
        delays.append(time.monotonic() - started)
    return statistics.median(delays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--poll-s", type=float, default=0.2)
    parser.add_argument("--changes", type=int, default=50)
    args = parser.parse_args()

    from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
    from planaria.elastic.etcd_server import EmbeddedEtcd
    from planaria.elastic.etcd_watch import Mirror

    keys = [f"/bench/epoch/{i}/reconfigure" for i in range(args.keys)]
    with EmbeddedEtcd() as etcd:
        client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint))
        busy0, wall0 = busy_seconds(), time.monotonic()
        rows = []

        before = server_counts(etcd.endpoint)
        poll_quietly(client, keys, args.seconds, args.poll_s)
        after = server_counts(etcd.endpoint)
        delay = poll_delay(client, "/bench/changing", args.changes, args.poll_s)
        rows.append(("poll", (after[0] - before[0]) / args.seconds, after[1] - before[1], "-", delay))

        mirrors = [Mirror(client, key) for key in keys]
        for mirror in mirrors:
            assert mirror.wait_watching(10), "a watch did not start"
        before = server_counts(etcd.endpoint)
        time.sleep(args.seconds)
        after = server_counts(etcd.endpoint)
        own = f"{sum(m.ranges for m in mirrors)} / {sum(m.watch_creates for m in mirrors)}"
        with Mirror(client, "/bench/changing") as changing:
            delay = watch_delay(client, changing, "/bench/changing", args.changes)
        rows.append(("watch", (after[0] - before[0]) / args.seconds, after[1] - before[1], own, delay))
        for mirror in mirrors:
            mirror.close()
        busy = (busy_seconds() - busy0) / (time.monotonic() - wall0)

    print(f"{args.keys} keys, quiet for {args.seconds:g} s each way; machine busy {busy:.2f} CPUs on average")
    print(f"{'way':<6} {'Range calls/s':>14} {'Watch msgs':>11} {'mirrors ranges / watches':>25} "
          f"{'put seen after (median)':>24}")
    for way, ranges, messages, own, delay_s in rows:
        print(f"{way:<6} {ranges:>14.1f} {messages:>11.0f} {own:>25} {delay_s * 1000:>21.1f} ms")


if __name__ == "__main__":
    main()
