"""Simulated hosts: each node in a Linux network namespace of its own, with its own address,
and the faults a network makes on the links between them.

Topology, for one owner process (its pid in hex, `T`, names everything):

    pl<T>r        the router: one veth to each host, forwarding between them only
                  (ip_forward on in this namespace alone), no uplink
    pl<T>h<i>     host i: `lo` and `eth0` (its veth to the router), address 10.N.i.2/24,
                  one route, 10.N.0.0/16 via the router: no default route anywhere
    pl<T>x        the harness's own link (in the namespace it runs in), 10.N.254.2, routed
                  to 10.N.0.0/16 only, so that it can reach etcd and the hosts

Nothing leaves the machine: the router has no other interface, no NAT, and the root
namespace's forwarding is not touched. Packets between hosts are routed, not bridged,
so that faults are routing rules in the router, applied to forwarded packets:

- `cut(a, b)`: `ip rule ... blackhole` both ways between two addresses. The router drops
  their packets silently: open connections see no reply and no reset, a new connection
  waits for its timeout (a real cut, not a refusal); removing the rules heals it, and
  TCP's retransmissions deliver what was sent meanwhile.
- `slow(i, rate)`: a token bucket (`tbf`) on both ends of host i's link.

This kernel has no `netem` and no tc actions (no drop filters), and the machine has no
iptables or nftables: blackhole rules on a router are what drops packets silently here.

`close()` removes every namespace and link it made (the links go with their namespaces),
and `remove_stale()` those of owners that died without closing (by the pid in the names).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

PREFIX = "pl"
IFNAME = "eth0"
"""Every host's interface: what gloo is told to use (GLOO_SOCKET_IFNAME)."""


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why in one line."""


def unavailable() -> str | None:
    """Why simulated hosts cannot run here (not root, no `ip`), or None when they can."""
    if shutil.which("ip") is None:
        return "simulated hosts need iproute2's `ip` command, which is not installed"
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces and veth links)"
    return None


def _ip(*args: str, namespace: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = ["ip", *(["-n", namespace] if namespace else []), *args]
    proc = subprocess.run(command, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise HostsUnavailable(f"`{' '.join(command)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _owner(name: str) -> int | None:
    """The pid that made namespace `name` (pl<hex pid>r / h<i>), or None when not ours."""
    if not name.startswith(PREFIX):
        return None
    body = name[len(PREFIX):]
    for i, ch in enumerate(body):
        if ch in "rh":
            try:
                return int(body[:i], 16)
            except ValueError:
                return None
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete the namespaces and harness links of owners that are gone (a crashed run's);
    their names."""
    stale = [n for n in _namespaces() if (pid := _owner(n)) is not None and not _alive(pid)]
    for name in stale:
        _ip("netns", "del", name, check=False)
    links = [line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link", "show", check=False).stdout.splitlines()
             if line.count(":") >= 2]
    for link in links:
        if link.startswith(PREFIX) and link.endswith("x") and (pid := _owner(link[:-1] + "r")) is not None \
                and not _alive(pid):
            _ip("link", "del", link, check=False)
            stale.append(link)
    return stale


def _free_net(skip: int = 0) -> int:
    """A second octet N such that 10.N.0.0/16 is routed nowhere in this namespace (the
    `skip`-th such, counting from one that depends on this process)."""
    routes = _ip("route", "show", check=False).stdout + _ip("addr", "show", check=False).stdout
    used = {int(w.split(".")[1]) for w in routes.split() if w.startswith("10.") and w.count(".") >= 3
            and w.split(".")[1].isdigit()}
    free = [net for net in range(100 + os.getpid() % 100, 256) if net not in used]
    if len(free) > skip:
        return free[skip]
    raise HostsUnavailable("no free 10.N.0.0/16 for simulated hosts: every one from 10.100 up is routed here")


@dataclass
class HostNetwork:
    """Hosts 0..count-1 on a private routed subnet (module docstring)."""

    count: int
    net: int = 0
    tag: str = field(default_factory=lambda: f"{os.getpid():x}")
    _made: list[str] = field(default_factory=list, repr=False)
    _hosts: set[int] = field(default_factory=set, repr=False)
    _rules: Counter = field(default_factory=Counter, repr=False)
    """(src, dst) -> how many faults hold that cut: overlapping faults heal one by one."""
    _slowed: Counter = field(default_factory=Counter, repr=False)

    # ------------------------------------------------------------ names and addresses
    @property
    def router(self) -> str:
        return f"{PREFIX}{self.tag}r"

    def namespace(self, host: int) -> str:
        return f"{PREFIX}{self.tag}h{host}"

    def address(self, host: int) -> str:
        return f"10.{self.net}.{host}.2"

    @property
    def harness_address(self) -> str:
        return f"10.{self.net}.254.2"

    @property
    def subnet(self) -> str:
        return f"10.{self.net}.0.0/16"

    def run_in(self, host: int, argv: Iterable[str]) -> list[str]:
        """`argv` as a command run on host `host` (ip netns exec: the same pid runs it)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    # ------------------------------------------------------------------- set-up
    def create(self) -> "HostNetwork":
        reason = unavailable()
        if reason:
            raise HostsUnavailable(reason)
        remove_stale()
        chosen, attempts = self.net, 5
        for attempt in range(attempts):
            # Another run may take the same free /16 between the look and the use: try another.
            self.net = chosen or _free_net(skip=attempt)
            try:
                self._make_namespace(self.router)
                _ip("netns", "exec", self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
                for host in range(self.count):
                    self.add_host(host)
                self._link_harness()
                return self
            except HostsUnavailable:
                self.close()
                if chosen or attempt == attempts - 1:
                    raise
            except BaseException:
                self.close()
                raise
        return self

    def _make_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("link", "set", "lo", "up", namespace=name)

    def ensure_host(self, host: int) -> int:
        """Host `host`, made now if it was not (0 <= host < 254); its number."""
        if host not in self._hosts:
            self.add_host(host)
        return host

    def add_host(self, host: int) -> str:
        """Make host `host`'s namespace and link; its namespace name."""
        if not 0 <= host < 254 or host in self._hosts:
            raise ValueError(f"host {host} exists already or is not in 0..253")
        name, outer = self.namespace(host), f"{PREFIX}{self.tag}r{host}"
        self._make_namespace(name)
        self._hosts.add(host)
        _ip("link", "add", IFNAME, "netns", name, "type", "veth", "peer", "name", outer, "netns", self.router)
        _ip("addr", "add", f"{self.address(host)}/24", "dev", IFNAME, namespace=name)
        _ip("addr", "add", f"10.{self.net}.{host}.1/24", "dev", outer, namespace=self.router)
        _ip("link", "set", IFNAME, "up", namespace=name)
        _ip("link", "set", outer, "up", namespace=self.router)
        _ip("route", "add", self.subnet, "via", f"10.{self.net}.{host}.1", namespace=name)
        return name

    def _link_harness(self) -> None:
        """One veth from the harness's namespace to the router, routed to the subnet only."""
        inner, outer = f"{PREFIX}{self.tag}x", f"{PREFIX}{self.tag}rx"
        _ip("link", "add", inner, "type", "veth", "peer", "name", outer, "netns", self.router)
        _ip("addr", "add", f"{self.harness_address}/24", "dev", inner)
        _ip("addr", "add", f"10.{self.net}.254.1/24", "dev", outer, namespace=self.router)
        _ip("link", "set", inner, "up")
        _ip("link", "set", outer, "up", namespace=self.router)
        _ip("route", "add", self.subnet, "via", f"10.{self.net}.254.1")

    def close(self) -> None:
        """Remove the harness's link (its route goes with it) and every namespace made
        (their links go with them)."""
        _ip("link", "del", f"{PREFIX}{self.tag}x", check=False)
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()
        self._hosts.clear()
        self._rules.clear()
        self._slowed.clear()

    def __enter__(self) -> "HostNetwork":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------- faults
    def cut(self, a: str, b: str) -> None:
        """Drop every packet between addresses `a` and `b`, silently, both ways (until as
        many `heal`s as `cut`s: two faults that overlap each hold the cut)."""
        for src, dst in ((a, b), (b, a)):
            if not self._rules[(src, dst)]:
                _ip("rule", "add", "from", src, "to", dst, "blackhole", namespace=self.router)
            self._rules[(src, dst)] += 1

    def heal(self, a: str, b: str) -> None:
        for src, dst in ((a, b), (b, a)):
            if self._rules[(src, dst)] == 1:
                _ip("rule", "del", "from", src, "to", dst, "blackhole", namespace=self.router, check=False)
            self._rules[(src, dst)] = max(0, self._rules[(src, dst)] - 1)

    def heal_all(self) -> None:
        """Lift every cut, however many faults hold it."""
        for (src, dst), held in list(self._rules.items()):
            if held:
                _ip("rule", "del", "from", src, "to", dst, "blackhole", namespace=self.router, check=False)
        self._rules.clear()

    def slow(self, host: int, rate: str | None) -> None:
        """Limit host `host`'s link to `rate` ("10mbit") both ways; None lifts the limit
        (once every fault that slowed it has lifted it)."""
        self._slowed[host] += 1 if rate is not None else -1
        if rate is None and self._slowed[host] > 0:
            return
        for namespace, device in ((self.namespace(host), IFNAME), (self.router, f"{PREFIX}{self.tag}r{host}")):
            if rate is None:
                _ip_tc(namespace, "qdisc", "del", "dev", device, "root", check=False)
            else:
                _ip_tc(namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
                       "burst", "32kbit", "latency", "400ms")

    def addresses(self) -> list[str]:
        """Every host's address, in host order."""
        return [self.address(h) for h in sorted(self._hosts)]


def _ip_tc(namespace: str, *args: str, check: bool = True) -> None:
    proc = subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise HostsUnavailable(f"tc {' '.join(args)} in {namespace} failed: {proc.stderr.strip()}")

