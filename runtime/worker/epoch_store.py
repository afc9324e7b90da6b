"""Each epoch's bootstrap store: the TCPStore its process groups rendezvous on when the
job's store is etcd.

Owns `EpochStoreHost` (the server, on the plan's rank 0), `EpochStoreClient` (every
rank's connections to it) and `advertised_host` (the address the host serves at).

Why a store of the epoch's own. The process groups of an epoch bootstrap through a
store: gloo's full mesh sets one key per rank that every rank reads (N^2 reads at N
ranks), NCCL one unique id per communicator that its other ranks read, and every wait
polls. Over etcd that was the largest share of etcd's load at a reconfiguration (the
scale harness, `planaria.chaos.scale`); etcd is the job's memory, replicated on every
write, and has no use for keys that live for a second. torch's TCPStore with its libuv
backend answers a wait when the key is set (no polling) and brings up 96,000 ranks in
about 100 s. Its weakness, one host whose death takes the store along, costs nothing
here: the host is a rank of the epoch, whose death fails the epoch anyway, and the next
epoch has a store of its own. So:

1. the plan's rank 0 hosts a TCPStore for the epoch (`EpochStoreHost`: port 0, libuv,
   no wait for workers) on its node's address, and publishes "host:port" under
   `keys.epoch_pg_store(e)` in the job's store (`StoreCoordinator.rendezvous_store`);
2. every rank, rank 0 included, connects to it as a client (`EpochStoreClient`): rank 0
   with the address in hand, the others once they read the key, over etcd by following
   it (one read and a watch, not a poll), given up when the control plane ends the
   epoch. A leaving worker that hands its layers over (`transfer.Handoff`) is not in the
   plan, and finds the store the same way;
3. a blocked read is the server's own wait, one request; `AbandonableStore` has it
   interrupted (`EpochStoreClient.interrupt`) when the control plane ends the epoch.
   Not polled (a `check` every 10 ms from thousands of ranks is hundreds of thousands of
   requests a second to one host), nor cut into short waits with a look at the epoch
   between two: c10d logs two warnings at every wait that times out, which would fill
   the log of a rank waiting for a late peer.

Fencing: the key is the epoch's, and so is the store: a late worker of an older epoch
never meets a newer epoch's groups. The host keeps its store until it begins another
epoch (or exits), not only until its own groups are gone: the epoch's other ranks may
still be on it then (a peer snapshots' group connecting, a handoff), and nothing of the
epoch needs it once a later one began.

Failures. The host gone before a rank connects: the connection is refused, at once (a
plain connect is tried first: TCPStore's own retries a refused connection until its
timeout). Gone during the rendezvous: the connections reset, and every wait fails with
a `DistNetworkError` (a RuntimeError: the epoch fails on the worker like any other
failure), and the control plane plans the next epoch. Unreachable (cut off): a connect
gives up at the connect timeout (`comm.connect_timeout_s`), or as soon as the epoch is
abandoned; a wait on a silent connection ends when the epoch is abandoned. Nothing waits
for a store's 300 s default.

Why a connection per thread: a TCPStore client runs one operation at a time, and a wait
holds it until its key is set. Threads of a worker share the epoch's store (the peer
snapshots' group connects on a thread of its own while the main thread's first steps
make NCCL's communicators): on one connection, one thread's wait for a late peer would
hold the other's `set` that the peer waits for, a deadlock until the timeout. Over etcd
each request stood alone; so here every thread gets its own connection (two or three
per worker; the host raises its process's open files limit for them).

Over a job's store that is a TCPStore already (the local launcher, tests), none of
this: the rendezvous stays under a prefix of the job's store, which is a TCPStore on
one host anyway (`StoreCoordinator`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from planaria.runtime.contract import env
from planaria.runtime.parallel.release import plain_ip, shut_down_sockets

log = logging.getLogger(__name__)

CONNECT_TRY_S = 1.0
"""A connection to the epoch's store is tried for this long at a time, so that an
interrupt (the epoch abandoned) ends the attempts within it."""


def advertised_host(environ=os.environ) -> str:
    """The address the other nodes reach this worker's node at: its agent's (`env.NODE_ADDRESS`,
    the agent's `--local-addr`, its gloo interface's address, or its route to etcd). Without
    it (a launcher other than Planaria's agent): the hostname's address, else loopback,
    said in a warning, since only the agent knows which network the nodes share."""
    given = environ.get(env.NODE_ADDRESS)
    if given:
        return given
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = "127.0.0.1"
    log.warning("%s is not set: this worker hosts its epochs' bootstrap store at %s (its hostname's address, "
                "else loopback); if the other nodes cannot reach it there, set %s to this node's address",
                env.NODE_ADDRESS, address, env.NODE_ADDRESS)
    return address


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" (an IPv6 host may be bracketed or not)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"an epoch store's address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


class EpochStoreHost:
    """The TCPStore of one epoch, served from this process (module docstring, 1). Serves
    until `close()` (or until this process ends)."""

    def __init__(self, host: str, connect_timeout_s: float):
        _allow_many_connections()
        try:
            self._server: dist.TCPStore | None = dist.TCPStore(
                host, 0, is_master=True, use_libuv=True, wait_for_workers=False,
                timeout=timedelta(seconds=connect_timeout_s))
        except RuntimeError as err:  # its own client could not reach it there
            raise RuntimeError(f"could not host the epoch's bootstrap store at {host} ({err}); is {host} "
                               f"this node's address? The agent passes it in {env.NODE_ADDRESS}") from err
        self.address = f"{host}:{self._server.port}"

    def close(self) -> None:
        """Stop serving: the server goes with its last reference (c10d has no close), and
        every connection to it is closed."""
        self._server = None


class EpochStoreClient(dist.Store):
    """A rank's connections to an epoch's store (module docstring, 2 and 3): one per
    thread, made at the thread's first operation, to the address `address` gives (a
    string, or a function that waits for it: called once, at the first operation).

    `interrupt(why)` ends what its operations are blocked in, on every thread (shutting
    this process's connections to the store down, as a release does: c10d has no other
    way into a blocked wait; a worker has no others), and every later operation raises a
    DistStoreError saying `why`."""

    def __init__(self, address: str | Callable[[], str], *, connect_timeout_s: float, timeout: timedelta):
        super().__init__()
        self._address = address
        self._resolved: tuple[str, int] | None = None
        self.connect_timeout_s, self._timeout = connect_timeout_s, timeout
        self._lock = threading.Lock()
        self._resolving = threading.Lock()
        """Held while the address is waited for (apart from `_lock`, which an interrupt takes)."""
        self._connections: dict[int, dist.TCPStore] = {}
        self._closed: str | None = None
        self._busy = 0
        """Operations under way: a close while one is needs an interrupt to end it."""

    # -- connections ----------------------------------------------------------------------
    def _store(self) -> dist.TCPStore:
        """This thread's connection (made now if it has none)."""
        thread = threading.get_ident()
        connection = self._connections.get(thread)
        if connection is None:
            self._check_open()
            connection = self._connect(*self._where())
            with self._lock:
                self._check_open()  # (interrupted while it connected: not kept)
                self._connections[thread] = connection
        return connection

    def _where(self) -> tuple[str, int]:
        with self._resolving:
            if self._resolved is None:
                address = self._address if isinstance(self._address, str) else self._address()
                with self._lock:
                    self._resolved = split_address(address)
            return self._resolved

    def _connect(self, host: str, port: int) -> dist.TCPStore:
        """A connection to the store, refused at once when nothing listens there (its host
        died), given up at the connect timeout or an interrupt when nothing answers."""
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            self._check_open()
            try:
                socket.create_connection((host, port), timeout=min(CONNECT_TRY_S, self.connect_timeout_s)).close()
                break
            except ConnectionRefusedError:
                raise dist.DistStoreError(f"the epoch's bootstrap store at {host}:{port} refused the connection: "
                                          "its host, the plan's rank 0, is gone") from None
            except OSError as err:  # no answer yet (a timeout), or no route to it now
                if time.monotonic() > deadline:
                    raise dist.DistStoreError(
                        f"the epoch's bootstrap store at {host}:{port} did not answer within "
                        f"{self.connect_timeout_s:.0f} s (comm.connect_timeout_s): {err}") from None
                if not isinstance(err, TimeoutError):
                    time.sleep(0.1)  # (refusals of the route come at once: not a busy loop)
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=self.connect_timeout_s))
        store.set_timeout(self._timeout)
        return store

    def _check_open(self) -> None:
        if self._closed is not None:
            raise dist.DistStoreError(self._closed)

    def interrupt(self, why: str) -> None:
        """End every operation blocked on this store, and refuse later ones (class docstring)."""
        with self._lock:
            if self._closed is None:
                self._closed = why
            connections, self._connections = list(self._connections.values()), {}
            where = self._resolved
        if where is not None and connections:
            host, port = where
            shut_down_sockets(lambda inode: True, only_to=(_addresses_of(host, port), port))
        del connections  # each closes its socket as it goes

    def close(self) -> None:
        """Done with the epoch: its connections closed. When no operation is under way,
        dropping them closes them (c10d closes a client's socket with it); only one under
        way needs `interrupt`, which looks through every socket of the process for those
        to the store (cheap in a worker, but a scale harness of thousands of workers in
        one process would look through thousands of sockets a worker)."""
        why = "the worker has left this epoch: its bootstrap store is closed"
        with self._lock:
            if self._closed is None:
                self._closed = why
            busy = self._busy
            dropped = [] if busy else list(self._connections.values())
            if not busy:
                self._connections = {}
        if busy:
            self.interrupt(why)
        dropped.clear()  # each closes its socket as it goes

    @contextlib.contextmanager
    def _operation(self):
        """This thread's connection, for one operation, counted while it lasts."""
        with self._lock:
            self._check_open()
            self._busy += 1
        try:
            yield self._store()
        finally:
            with self._lock:
                self._busy -= 1

    # -- the Store interface ----------------------------------------------------------------
    def set(self, key, value) -> None:
        with self._operation() as store:
            store.set(key, value)

    def get(self, key) -> bytes:
        with self._operation() as store:
            return store.get(key)

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        with self._operation() as store:
            store.wait(list(keys), timeout or self._timeout)

    def check(self, keys) -> bool:
        with self._operation() as store:
            return store.check(list(keys))

    def add(self, key, amount: int) -> int:
        with self._operation() as store:
            return store.add(key, amount)

    def compare_set(self, key, expected, desired) -> bytes:
        with self._operation() as store:
            return store.compare_set(key, expected, desired)

    def delete_key(self, key) -> bool:
        with self._operation() as store:
            return store.delete_key(key)

    def num_keys(self) -> int:
        with self._operation() as store:
            return store.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        with self._lock:
            self._timeout = timeout
            connections = list(self._connections.values())
        for connection in connections:
            connection.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._timeout


def _addresses_of(host: str, port: int) -> set[str]:
    """The IP addresses `host` stands for (as peers of a socket show them)."""
    try:
        return {plain_ip(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError:
        return {plain_ip(host)}


def _allow_many_connections() -> None:
    """Each rank of the epoch holds a connection or two to the host (one per thread that
    uses the store), each an open file of the host's process: at thousands of ranks more
    than a soft limit of 1,024 allows. Raised to the hard limit, as far as it goes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # not allowed here: the soft limit stays
            pass
