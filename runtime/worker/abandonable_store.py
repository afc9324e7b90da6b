"""A store whose blocking reads give up when told to: an epoch's process-group rendezvous
that the control plane can abandon (`planaria.runtime.worker.coordination`)."""
from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist


class AbandonableStore(dist.Store):
    """`base`, whose blocking reads (`get`, `wait`) give up with a DistStoreError when
    `abandoned()` turns true. Written here because c10d's stores only give up on their
    timeout, and a rendezvous cannot be interrupted from outside."""

    def __init__(self, base: dist.Store, abandoned, message: str, poll_s: float = 0.01):
        super().__init__()
        self.base, self.abandoned, self.message, self.poll_s = base, abandoned, message, poll_s

    def _wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self.base.timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self.base.check(keys):
            if self.abandoned():
                raise dist.DistStoreError(f"{self.message} (waiting for {keys})")
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"wait timeout after {limit * 1000:.0f}ms, keys: {keys}")
            time.sleep(self.poll_s)

    def set(self, key, value) -> None:
        self.base.set(key, value)

    def get(self, key) -> bytes:
        self._wait([key])
        return self.base.get(key)

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        self._wait(list(keys), timeout)

    def check(self, keys) -> bool:
        return self.base.check(keys)

    def add(self, key, amount: int) -> int:
        return self.base.add(key, amount)

    def compare_set(self, key, expected, desired) -> bytes:
        return self.base.compare_set(key, expected, desired)

    def delete_key(self, key) -> bool:
        return self.base.delete_key(key)

    def num_keys(self) -> int:
        return self.base.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.base.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self.base.timeout
