"""A job's keys in etcd, with the interface of a `torch.distributed.Store`.

Every key lives in etcd under a prefix (`/planaria/<run>/`), so any surviving member of
the etcd cluster serves it: the job's coordination keys (`planaria.runtime.worker.coordination`),
which the controller and workers read and write over etcd exactly as over a TCPStore,
and, through `planaria.elastic.etcd_store.EtcdStore`, the process groups' rendezvous.

What each operation maps to:
- `set`, `get` (waits until the key exists, up to the store's timeout), `check`,
  `wait`, `delete_key`, `num_keys` (keys under the prefix): plain etcd reads and writes;
- beyond a Store's methods, `get_if_present` and `items_under` (a prefix): one read
  where a Store needs a `check` and a `get` per key (each an etcd round trip), for the
  control plane's polls, which a reconfiguration waits on; `derived`: what a caller
  computes from a followed prefix, computed again only when it changed;
- `add`: a compare-and-swap loop on the key's version (etcd has no atomic increment);
- `compare_set`: one transaction comparing the value.
Every write is checked against etcd's request limits before it is sent (`limits`;
`EtcdLimitExceeded` over them): `compare_set_bytes` tells a writer the size of a
`compare_set` beforehand, for a check where it knows what makes the value big.
Waiting is polling, every 2 ms for a wait's first 0.1 s (a rendezvous's keys come within
milliseconds of each other), then every 10 ms: a rendezvous touches few keys, and
polling needs no watch stream to keep alive.

Keys that the control plane asks about again and again (the job's epoch, an epoch's
end, the leader, the statuses while they come in) are `follow`ed instead: a watch keeps
a mirror of them (`planaria.elastic.etcd_watch.Mirror`), every read of them is answered
from it without a request, and `wait_changed` wakes as soon as one changes. A poll of
them costs etcd nothing while nothing changes (docs/control_plane.md, "At scale").

`EtcdKeyValue` is torch-free: a node's agent runs the control plane over it and never
imports torch (seconds at start-up, and a few hundred MB that an agent has no use for).
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta

from planaria.elastic.etcd_client import EtcdClient
from planaria.elastic.etcd_watch import Mirror
from planaria.elastic.etcd_limits import EtcdLimits
from planaria.runtime.contract.store_reads import poll_pause

_POLL_S = 0.01
_FAST_FOR_S = 0.1


class EtcdKeyValue:
    """Keys under `prefix` in the etcd of `client`, with the methods of a
    `torch.distributed.Store` (see the module docstring). Torch-free, for the control
    plane; `EtcdStore` is the same as a real Store, for process groups."""

    timeout_error: type[Exception] = TimeoutError
    """What a read that waited out the store's timeout raises."""

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta = timedelta(seconds=300)):
        self.client = client
        self.prefix = prefix.rstrip("/") + "/"
        self._timeout = timeout
        self._mirrors: dict[str, tuple[Mirror, bool]] = {}
        """{followed key or prefix: (its mirror, whether it is a prefix)}."""
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._generation = 0
        """Changes the mirrors applied so far (`wait_changed`)."""
        self._listeners: list = []
        self._derived: dict = {}
        """{(prefix, derive): (the mirror, its revision, the value)} (`derived`)."""

    # -- followed keys ----------------------------------------------------------------
    def follow(self, key: str, prefix: bool = False) -> None:
        """Mirror `key` (or every key under it, with `prefix`) from now on: one read and a
        watch, then reads of it make no request (module docstring). Again: nothing."""
        with self._lock:
            if key in self._mirrors:
                return
            self._mirrors[key] = (Mirror(self.client, self._key(key), prefix=prefix,
                                         on_change=lambda changes: self._on_change(key, changes)), prefix)

    def following(self, key: str) -> bool:
        """Whether `key` itself is followed (as a key or as a prefix). Without the lock,
        as reads are: `follow` holds it through its mirror's first read."""
        return key in self._mirrors

    def followed_key(self, key: str) -> bool:
        """Whether a read of `key` is answered by a mirror (it, or a prefix above it, is followed)."""
        return self._mirror_of(key) is not None

    def on_any_change(self, listener) -> None:
        """Call `listener(key)` after every change a mirror of this store applies, with the
        key (or prefix) it follows (on the mirror's thread: keep it short), as
        `wait_changed` is woken."""
        self._listeners.append(listener)

    def unfollow(self, key: str) -> None:
        """Stop mirroring `key` (its reads go to etcd again)."""
        with self._lock:
            found = self._mirrors.pop(key, None)
        if found is not None:
            found[0].close()

    def close(self) -> None:
        """Stop every mirror (the store still reads and writes, through etcd)."""
        with self._lock:
            mirrors, self._mirrors = list(self._mirrors.values()), {}
        for mirror, _ in mirrors:
            mirror.close()

    def derived(self, prefix: str, derive):
        """`derive(self.items_under(prefix))`, computed again only when the keys under
        `prefix` changed (its mirror's revision moved): a leader that looks at thousands
        of workers' keys ten times a second parses them once per change, not per look.
        Without a mirror of `prefix`, computed at every call (and the read is etcd's).
        `derive` must not keep or change what it is given; its result is shared."""
        found = self._mirror_of(prefix)
        if found is None or found[1]:
            return derive(self.items_under(prefix))
        mirror = found[0]
        key = (prefix, derive)
        cached = self._derived.get(key)
        revision = mirror.revision
        if cached is not None and cached[0] is mirror and cached[1] == revision:
            return cached[2]
        value = derive(self.items_under(prefix))
        self._derived[key] = (mirror, revision, value)
        return value

    def generation(self) -> int:
        """How many changes the mirrors have applied: give it to `wait_changed`."""
        with self._changed:
            return self._generation

    def wait_changed(self, since: int, timeout_s: float) -> bool:
        """Wait until a followed key changed after `generation()` was `since`, for up to
        `timeout_s`; True if one did. Without followed keys it only sleeps."""
        with self._changed:
            return self._changed.wait_for(lambda: self._generation != since, timeout_s)

    def _on_change(self, key: str, changes) -> None:
        with self._changed:
            self._generation += 1
            self._changed.notify_all()
        for listener in list(self._listeners):
            listener(key)

    def _mirror_of(self, key: str) -> tuple[Mirror, str] | None:
        """The mirror that holds `key`, and its name there; None when it is not followed."""
        found = self._mirrors.get(key)
        if found is not None and not found[1]:
            return found[0], ""
        for followed, (mirror, prefix) in list(self._mirrors.items()):
            if prefix and key.startswith(followed):
                return mirror, key[len(followed):]
        return None

    # -- helpers --------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return self.prefix + key

    def _wait_for(self, keys: list[str], timeout: timedelta | None) -> dict[str, bytes]:
        """The values of `keys`, once each exists (one read per key when it does)."""
        limit = (timeout or self._timeout).total_seconds()
        started = time.monotonic()
        deadline = started + limit
        found: dict[str, bytes] = {}
        while True:
            for k in keys:
                if k not in found and (value := self.client.get(self._key(k))[0]) is not None:
                    found[k] = value
            if len(found) == len(keys):
                return found
            if time.monotonic() > deadline:
                missing = [self._key(k) for k in keys if k not in found]
                raise self.timeout_error(f"wait timeout after {limit * 1000:.0f}ms, keys: "
                                          f"{missing} in etcd {self.client.endpoint}")
            time.sleep(poll_pause(started, _FAST_FOR_S, _POLL_S))

    # -- the Store interface --------------------------------------------------------
    def set(self, key: str, value) -> None:
        self.client.put(self._key(key), store_bytes(value))

    def set_many(self, items: list[tuple[str, bytes]]) -> int:
        """`set` of each (key, value), in as few requests as etcd's limits allow (one
        transaction of puts, up to `limits.max_txn_ops`); how many it took."""
        return self.client.put_many([(self._key(key), store_bytes(value)) for key, value in items])

    def get(self, key: str) -> bytes:
        return self._wait_for([key], None)[key]

    def get_if_present(self, key: str) -> bytes | None:
        """The value of `key`, or None: one read (a Store's `check` then `get` takes two),
        none when it is followed."""
        mirrored = self._mirror_of(key)
        if mirrored is not None:
            return mirrored[0].value(mirrored[1])
        return self.client.get(self._key(key))[0]

    def items_under(self, prefix: str) -> dict[str, bytes]:
        """{key: value} of every key under `prefix` (keys as given to `set`), in one read
        (none when followed): the controller reads all the statuses of an epoch at once."""
        mirrored = self._mirror_of(prefix)
        if mirrored is not None:
            mirror, name = mirrored
            return {prefix + rest[len(name):]: value for rest, value in mirror.items().items()
                    if rest.startswith(name)}
        return {prefix + rest: value for rest, value in self.client.items_with_prefix(self._key(prefix)).items()}

    def check(self, keys: list[str]) -> bool:
        return all(self.get_if_present(k) is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_for(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        return self.client.atomic_add(self._key(key), int(amount))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.client.compare_and_set(self._key(key), store_bytes(expected), store_bytes(desired))

    def compare_set_bytes(self, key: str, expected, desired) -> int:
        """The size of `compare_set(key, expected, desired)`'s request, as checked against
        `limits.max_request_bytes` when it is sent."""
        return self.client.compare_and_set_bytes(self._key(key), store_bytes(expected), store_bytes(desired))

    @property
    def limits(self) -> EtcdLimits:
        """etcd's request limits, which every write is checked against before it is sent."""
        return self.client.limits

    def delete_key(self, key: str) -> bool:
        return self.client.delete(self._key(key))

    def num_keys(self) -> int:
        return self.client.count_prefix(self.prefix)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return self._timeout


def store_bytes(value) -> bytes:
    """A Store's value as bytes: c10d gives bytes, a str, or a list of ints."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # c10d passes a list of ints
