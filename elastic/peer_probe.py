"""Each agent's probe of the other nodes over the network its workers use: which nodes
this one cannot reach now (docs/recovery.md, "Partitions").

A partition that leaves both sides reaching etcd shows nowhere in etcd: every lease
is kept alive, every worker is alive, and the workers' collectives across the cut just
stop answering. The agent therefore listens on its node's address (the one its
workers' process groups use: `node_address`) and, every `period_s`, opens a TCP
connection to every other node's listener (`probe/<node>` in the job's store, which the
agent reads and hands over). A node reached before, none of whose connections
succeeded since for `unreachable_after_s`, over at least three tries, is unreachable;
one success makes it reachable again. The agent publishes the
set under its lease (`unreachable/<node>`) and the leader plans over nodes that all
reach each other (`planaria.elastic.reachability`).

Why a connection and not a packet: it crosses the same routes and filters as the
workers' own TCP connections, and a cut that drops packets silently (no reset, no
refusal) shows as a connection that times out. Why a window of seconds and several
tries: a slow or congested link (a straggler) loses a SYN now and then, and must not
be taken for a cut; a probe that fails three times over 6 s is not congestion.

A refused connection is another answer: the peer's host is up and nothing listens on
its agent's port any more. Its agent is gone, and its workers with it (they die with
their agent: PR_SET_PDEATHSIG), so a node reached before whose latest probe was refused
is `gone`, and the leader counts its workers dead at once, a second after the node
died, rather than when its etcd lease expires (5 s). This is as safe as that expiry:
the leader still waits for every other worker's status, each published after that
worker left the failed epoch, so a node counted dead by mistake (a firewall that
answers with resets) cannot commit a step alone; it is planned without, and joins
again once it is reached.

Written here because no library probes TCP reachability for a peer set; it is a
socket listener and a thread pool of connects.
"""
from __future__ import annotations

import fcntl
import socket
import struct
import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor

PERIOD_S = 1.0
CONNECT_TIMEOUT_S = 2.0
UNREACHABLE_AFTER_S = 6.0
MIN_MISSES = 3
_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` (Linux), such as GLOO_SOCKET_IFNAME's."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError as err:
            raise ValueError(f"network interface {name!r} has no IPv4 address ({err}); check "
                             "GLOO_SOCKET_IFNAME, or give the node's address with --local-addr") from None
    return socket.inet_ntoa(packed[20:24])


def node_address(etcd_endpoint: str, environ: dict[str, str], given: str | None = None) -> str:
    """The address the other nodes reach this one at: `given` (--local-addr), else that
    of gloo's interface (GLOO_SOCKET_IFNAME, else NCCL_SOCKET_IFNAME; the first one if
    several), else the address
    this host uses to reach etcd (a multi-homed host's route to the cluster)."""
    if given:
        return given
    interfaces = environ.get("GLOO_SOCKET_IFNAME") or environ.get("NCCL_SOCKET_IFNAME") or ""
    if interfaces:
        return interface_address(interfaces.split(",")[0])
    host, _, port = etcd_endpoint.split(",")[0].rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))  # UDP: chooses the route, sends nothing
        return s.getsockname()[0]


class PeerProbe:
    """A node's listener and its probes of the others (module docstring).

    `set_peers({node: "host:port"})` tells it the other nodes' listeners (the agent's
    loop does, from the store: the probe itself never waits on etcd); `unreachable` is
    the current answer, a sorted list. A peer that was never reached is not reported
    (an address that no node can reach is a configuration error, not a partition: the
    agent says so, `never_reached`)."""

    def __init__(self, node: str, host: str, *, period_s: float = PERIOD_S, timeout_s: float = CONNECT_TIMEOUT_S,
                 unreachable_after_s: float = UNREACHABLE_AFTER_S):
        self.node = node
        self.period_s, self.timeout_s, self.unreachable_after_s = period_s, timeout_s, unreachable_after_s
        try:
            self._listener = socket.create_server((host, 0), backlog=128)
        except OSError as err:
            raise ValueError(f"cannot listen for the other nodes' probes on {host} ({err.strerror or err}); "
                             "give an address of this machine with --local-addr, or the interface of the "
                             "network the nodes share with GLOO_SOCKET_IFNAME") from None
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self.unreachable: list[str] = []
        self.never_reached: list[str] = []
        """Peers tried for longer than the window without a single success."""
        self.gone: list[str] = []
        """Peers reached before whose latest probe was refused: their agent is gone."""
        self._first_tried: dict[str, float] = {}
        self._last_ok: dict[str, float] = {}
        self._misses: dict[str, int] = {}
        self._addresses: dict[str, str] = {}
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="probe")
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="probe-listener"),
                         threading.Thread(target=self._probe_loop, daemon=True, name="probe")]

    def start(self) -> "PeerProbe":
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        try:
            self._listener.close()
        except OSError:
            pass
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            conn.close()  # a connection that was made is the whole answer

    def set_peers(self, peers: dict[str, str]) -> None:
        """The other nodes' listeners now; a node no longer among them is forgotten."""
        self._addresses = {n: a for n, a in peers.items() if n != self.node}

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.period_s):
            peers = self._addresses
            for gone in set(self._first_tried) - set(peers):
                for known in (self._first_tried, self._last_ok, self._misses):
                    known.pop(gone, None)
            try:
                self.probe_once(peers)
            except (RuntimeError, CancelledError):  # the pool was shut down: stop() was called
                return

    def probe_once(self, peers: dict[str, str]) -> list[str]:
        """Probe every peer once (concurrently) and update `unreachable`."""
        now = time.monotonic()
        results = dict(zip(peers, self._pool.map(self._connects, peers.values())))
        for peer, answer in results.items():
            self._first_tried.setdefault(peer, now)
            if answer == "ok":
                self._last_ok[peer], self._misses[peer] = time.monotonic(), 0
            else:
                self._misses[peer] = self._misses.get(peer, 0) + 1
        self.gone = sorted(p for p, answer in results.items() if answer == "refused" and p in self._last_ok)
        now = time.monotonic()
        self.unreachable = sorted(p for p in peers if p in self._last_ok and self._misses.get(p, 0) >= MIN_MISSES
                                  and now - self._last_ok[p] >= self.unreachable_after_s)
        self.never_reached = sorted(p for p in peers if p not in self._last_ok
                                    and now - self._first_tried[p] >= self.unreachable_after_s)
        return self.unreachable

    def _connects(self, address: str) -> str:
        """"ok", "refused" (the host answered: nothing listens there) or "failed"."""
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=self.timeout_s):
                return "ok"
        except ConnectionRefusedError:
            return "refused"
        except OSError:
            return "failed"
