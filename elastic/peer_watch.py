"""Peers' liveness under etcd leases, for scripts that are not Planaria's under `planaria-run`.

torchrun notices a dead worker on its own node at once, but a peer node that dies
without closing its sockets (a machine that freezes or drops off the network) is only
noticed when a collective times out: 30 minutes by default for gloo and NCCL. Under
`planaria-run --rdzv-backend etcd3`, each node also registers
`<key_prefix>/<run-id>/peers/<node>` under a lease it keeps alive, and watches the
others' keys. When a peer's key goes (its lease expired: nothing refreshed it for
`lease_ttl` seconds) without the peer having said it finished, this node SIGKILLs its
own workers; torchrun's agent sees them fail and restarts the world
(`--max-restarts`), as it would have after the collective timeout, only within seconds.

Written here because torchrun's agent has no hook for outside liveness signals: its
dynamic rendezvous keeps heartbeats, but only looks at them when a node (re)joins.
"""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Callable

from planaria.elastic.etcd_client import EtcdClient, EtcdUnavailable


def local_workers(parent: int) -> list[int]:
    """The pids of `parent`'s children that are torchrun workers (LOCAL_RANK set)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == parent and b"\0LOCAL_RANK=" in b"\0" + (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return found


class PeerWatch(threading.Thread):
    """This node's lease and key under `prefix`/peers/, and a watch on the others'."""

    def __init__(self, client: EtcdClient, prefix: str, node: str, ttl_s: int = 5,
                 log: Callable[[str], None] = print, period_s: float = 0.5):
        super().__init__(daemon=True, name="peer-watch")
        self.client, self.prefix, self.node = client, prefix.rstrip("/") + "/", node
        self.ttl_s, self.log, self.period_s = ttl_s, log, period_s
        self.restarts_asked = 0
        self._done = threading.Event()
        self._register()

    def _register(self) -> None:
        self.lease = self.client.lease(self.ttl_s)
        self.client.put(self.prefix + f"peers/{self.node}", b"running", lease=self.lease)

    def run(self) -> None:
        seen = set(self._peers())
        refresh_every = max(1, int(self.ttl_s / 3 / self.period_s))
        tick = 0
        while not self._done.wait(self.period_s):
            tick += 1
            try:
                if tick % refresh_every == 0 and not self.client.refresh(self.lease):
                    # Expired (etcd was away, or this machine froze, longer than the TTL):
                    # the peers took this node for dead; it must be watchable again.
                    self.log("planaria-run: peer watch: this node's lease expired; registering again")
                    self._register()
                now = set(self._peers())
                gone = seen - now - set(self.client.keys_with_prefix(self.prefix + "finished/"))
            except EtcdUnavailable as err:  # the rendezvous itself will say more
                self.log(f"planaria-run: peer watch: {err}")
                continue
            if gone:
                self._restart_world(sorted(gone))
            seen = now

    def _peers(self) -> list[str]:
        return [p for p in self.client.keys_with_prefix(self.prefix + "peers/") if p != self.node]

    def _restart_world(self, gone: list[str]) -> None:
        workers = local_workers(os.getpid())
        self.log(f"planaria-run: peer(s) {', '.join(gone)} gone (lease expired); stopping this "
                 f"node's {len(workers)} worker(s) so that torchrun restarts the world now")
        self.restarts_asked += 1
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def finish(self, ok: bool) -> None:
        """Stop watching; with `ok`, tell the peers this node finished (not died)."""
        self._done.set()
        try:
            if ok:
                self.client.put(self.prefix + f"finished/{self.node}", b"1")
            self.client.delete(self.prefix + f"peers/{self.node}")
        except EtcdUnavailable:
            pass  # the key goes with the lease
