"""Each agent's probe of the other nodes over the network its workers use: which nodes
this one cannot reach now (docs/recovery.md, "Partitions").

A partition that leaves both sides reaching etcd shows nowhere in etcd: every lease
is kept alive, every worker is alive, and the workers' collectives across the cut just
stop answering. The agent therefore listens on its node's address (the one its
workers' process groups use: `node_address`) and, every `period_s`, opens a TCP
connection to every other node's listener (`probe/<node>` in the job's store, which the
agent reads and hands over). A node reached before, none of whose connections
succeeded since for `unreachable_after_s` (1.5 s), over at least three tries, is
unreachable; one success makes it reachable again. The agent publishes the
set under its lease (`unreachable/<node>`) and the leader plans over nodes that all
reach each other (`planaria.elastic.reachability`).

Why a connection and not a packet: it crosses the same routes and filters as the
workers' own TCP connections, and a cut that drops packets silently (no reset, no
refusal) shows as a connection that times out. Why overlapping probes and a window:
a slow or congested link (a straggler) delays a SYN in its queue, or drops it and sends
it again a second later, and must not be taken for a cut. Its probes still get
through, later: each waits up to 2 s for its answer while the next ones start every
0.25 s, so that one success in 1.5 s keeps the peer reachable, and a cut, where none
succeeds, is seen in about 1.5 to 2 s (the partition figures in docs/benchmarks.md).

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
socket listener and non-blocking connects on one thread.
"""
from __future__ import annotations

import collections
import errno
import fcntl
import selectors
import socket
import struct
import threading
import time

PERIOD_S = 0.25
"""A probe of every peer starts this often, whether or not the last ones were answered."""
CONNECT_TIMEOUT_S = 2.0
"""A probe not answered within this is a miss (a slow link's SYN may wait in its queue,
or be dropped and sent again a second later: it must still count as an answer)."""
UNREACHABLE_AFTER_S = 1.5
"""A peer none of whose probes succeeded for this long, over at least MIN_MISSES of
them, is unreachable: a cut is acted on in about 2 s. A slow link answers later, but
keeps answering: its probes overlap, and one of every few gets through."""
MIN_MISSES = 3
MAX_WAITING = 4
"""Probes of one peer left waiting for an answer at a time (each holds a socket): enough
to count MIN_MISSES within the window, without a socket per round for every peer across
a cut."""
ANSWER_S = 0.5
"""A probe unanswered this long counts as a miss while it waits (a peer on the same
network answers in a millisecond)."""
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
    agent says so, `never_reached`).

    The probes are non-blocking connects on one thread (a selector): a new one to every
    peer each `period_s`, each answered or given up after `timeout_s`, so that probes
    of a peer overlap and a peer that does not answer holds up nobody's probes. Written
    here because no library probes TCP reachability for a peer set."""

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
        """Probes of each peer that failed, or went unanswered for the window, since its
        last success."""
        self._last_answer: dict[str, str] = {}
        self._addresses: dict[str, str] = {}
        self._pending: dict[socket.socket, tuple[str, float, float]] = {}
        """Probes under way: socket -> (peer, started, deadline)."""
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._stop = threading.Event()
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

    # -- probing --------------------------------------------------------------------------
    def _probe_loop(self) -> None:
        next_round = time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_round:
                    next_round = now + self.period_s
                    peers = self._addresses
                    self._forget_all_but(peers)
                    waiting = collections.Counter(peer for peer, _, _ in self._pending.values())
                    for peer, address in peers.items():
                        if waiting[peer] < MAX_WAITING:
                            self._start(peer, address)
                    self._judge(peers)
                self._serve(min(next_round, *(d for _, _, d in self._pending.values()), next_round) - now)
                self._judge(self._addresses)
        finally:
            for sock in list(self._pending):
                self._end(sock)
            self._selector.close()

    def probe_once(self, peers: dict[str, str]) -> list[str]:
        """Probe every peer once and wait for the answers (or their timeout); update and
        return `unreachable`. (For tests and callers without the loop: `start()` runs
        probes on its own thread.)"""
        self._forget_all_but(peers)
        for peer, address in peers.items():
            self._start(peer, address)
        while self._pending:
            self._serve(min(d for _, _, d in self._pending.values()) - time.monotonic())
        return self._judge(peers)

    def _forget_all_but(self, peers: dict[str, str]) -> None:
        for gone in set(self._first_tried) - set(peers):
            for known in (self._first_tried, self._last_ok, self._misses, self._last_answer):
                known.pop(gone, None)

    def _start(self, peer: str, address: str) -> None:
        """A non-blocking connect to `address`, answered in `_serve`."""
        host, _, port = address.rpartition(":")
        now = time.monotonic()
        self._first_tried.setdefault(peer, now)
        try:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            self._answer(peer, "failed")
            return
        sock.setblocking(False)
        code = sock.connect_ex((host.strip("[]"), int(port)))
        if code == 0:
            sock.close()
            self._answer(peer, "ok")
        elif code in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY):
            self._pending[sock] = (peer, now, now + self.timeout_s)
            self._selector.register(sock, selectors.EVENT_WRITE)
        else:
            sock.close()
            self._answer(peer, "refused" if code == errno.ECONNREFUSED else "failed")

    def _serve(self, wait_s: float) -> None:
        """Answers that came within `wait_s` (connected, refused, failed), and probes past
        their timeout."""
        if self._pending:
            for key, _ in self._selector.select(max(0.0, wait_s)):
                sock = key.fileobj
                peer = self._pending[sock][0]
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                self._end(sock)
                self._answer(peer, "ok" if code == 0 else "refused" if code == errno.ECONNREFUSED else "failed")
        else:
            self._stop.wait(max(0.0, wait_s))
        now = time.monotonic()
        for sock, (peer, _, deadline) in list(self._pending.items()):
            if now >= deadline:
                self._end(sock)
                self._answer(peer, "failed")

    def _end(self, sock: socket.socket) -> None:
        self._pending.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def _answer(self, peer: str, answer: str) -> None:
        if peer not in self._first_tried:
            return  # forgotten meanwhile
        self._last_answer[peer] = answer
        if answer == "ok":
            self._last_ok[peer], self._misses[peer] = time.monotonic(), 0
        else:
            self._misses[peer] = self._misses.get(peer, 0) + 1

    def _judge(self, peers: dict[str, str]) -> list[str]:
        """`unreachable`, `gone` and `never_reached` from the answers so far: a probe
        unanswered for the whole window counts as a miss already."""
        now = time.monotonic()
        waiting = {}
        for peer, started, _ in self._pending.values():
            if now - started >= ANSWER_S and started > self._last_ok.get(peer, -1.0):
                waiting[peer] = waiting.get(peer, 0) + 1
        misses = {p: self._misses.get(p, 0) + waiting.get(p, 0) for p in peers}
        self.gone = sorted(p for p in peers if self._last_answer.get(p) == "refused" and p in self._last_ok)
        self.unreachable = sorted(p for p in peers if p in self._last_ok and misses[p] >= MIN_MISSES
                                  and now - self._last_ok[p] >= self.unreachable_after_s)
        self.never_reached = sorted(p for p in peers if p not in self._last_ok and p in self._first_tried
                                    and now - self._first_tried[p] >= self.unreachable_after_s)
        return self.unreachable
