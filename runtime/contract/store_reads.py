"""Reads of the job's store in as few round trips as the store allows.

Both sides of the contract poll the store while a reconfiguration waits on them: the
controller for the statuses of an epoch's workers, each worker for the next epoch. Over
a `torch.distributed.Store` a key that may be absent takes a `check` and a `get`; over
etcd each is a network round trip, and a poll of every status of an epoch took tens of
milliseconds of the pause at a reconfiguration. The job's etcd store
(`planaria.elastic.etcd_kv.EtcdKeyValue`) reads a key, or every key under a prefix, in
one; any other store (a test's or the local launcher's TCPStore, which answers in
microseconds) is read key by key.

Keys polled again and again can be followed (`follow`): the etcd store then mirrors them
through a watch and answers their reads without a request, and `wait_for_change` wakes a
poll as soon as one changes. Over a store that cannot follow (a TCPStore), following is
nothing, and a wait for a change is a sleep: the same code polls as it always did."""
from __future__ import annotations

import time
from collections.abc import Mapping

FAST_POLL_S = 0.002
"""How often a wait polls while what it waits for is due any moment."""


def poll_pause(started: float, fast_for_s: float, slow_s: float) -> float:
    """How long a wait that began at `started` (`time.monotonic()`) sleeps before its next
    poll: FAST_POLL_S during its first `fast_for_s`, when a reconfiguration's next key
    is due within milliseconds (a record after a stop, a rendezvous's peers), then
    `slow_s`. A burst of reads at the one moment they pay, instead of fast polling
    throughout (etcd reads cost CPU on every side)."""
    return FAST_POLL_S if time.monotonic() - started < fast_for_s else slow_s


def read_if_present(store, key: str) -> bytes | None:
    """The value of `key`, or None when it is absent."""
    fast = getattr(store, "get_if_present", None)
    if fast is not None:
        return fast(key)
    return store.get(key) if store.check([key]) else None


def read_present(store, prefix: str, wanted: Mapping[object, str]) -> dict[object, bytes]:
    """{name: value} for the keys of `wanted` ({name: key}, every key under `prefix`)
    that are present."""
    outside = [key for key in wanted.values() if not key.startswith(prefix)]
    if outside:
        raise ValueError(f"keys {outside} are not under {prefix!r}")
    under = getattr(store, "items_under", None)
    if under is not None:
        found = under(prefix)
        return {name: found[key] for name, key in wanted.items() if key in found}
    return {name: store.get(key) for name, key in wanted.items() if store.check([key])}


def derived(store, prefix: str, derive):
    """`derive({key: value})` of the keys under `prefix`, which a store that mirrors them
    computes again only when they changed (`EtcdKeyValue.derived`); None for a store
    that cannot list a prefix (the caller reads key by key)."""
    method = getattr(store, "derived", None)
    if method is not None:
        return method(prefix, derive)
    under = getattr(store, "items_under", None)
    return derive(under(prefix)) if under is not None else None


def follow(store, key: str, prefix: bool = False) -> bool:
    """Have `store` mirror `key` (or the keys under it), if it can; True if it does. A
    store that cannot be reached now is polled instead (False)."""
    method = getattr(store, "follow", None)
    if method is None:
        return False
    try:
        method(key, prefix)
    except Exception:  # noqa: BLE001 - etcd away: the reads go to the store, as without a mirror
        return False
    return True


def unfollow(store, key: str) -> None:
    method = getattr(store, "unfollow", None)
    if method is not None:
        method(key)


def generation(store) -> int:
    """The store's count of changes to followed keys (0 for a store that follows none)."""
    method = getattr(store, "generation", None)
    return method() if method is not None else 0


def wait_for_change(store, since: int, timeout_s: float) -> bool:
    """Until a followed key of `store` changed since `generation` was `since`, or
    `timeout_s`; a plain sleep for a store that follows nothing. True if one changed."""
    method = getattr(store, "wait_changed", None)
    if method is None:
        time.sleep(timeout_s)
        return False
    return method(since, timeout_s)
