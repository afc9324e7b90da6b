"""A local cluster of simulated nodes: an etcd (one member or three) and one agent per
node, each agent with its workers, all real processes on this machine.

A node is an agent process started in a session of its own, so that killing the node
(`os.killpg`) takes the agent and its workers at once, as a machine that vanishes does.
Nodes are named `node<i>` by their index as launched; an added node takes the next
index. The cluster knows a worker's pid from the job's store (`members/<worker>`, the
worker's own announcement), and which nodes are live from its processes. Without
simulated hosts, each agent watches a local cloud's metadata for preemption notices
(`planaria.chaos.cloud`), which `preempt` schedules.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

from planaria.chaos.cloud import LocalCloud
from planaria.chaos.hosts import IFNAME, HostNetwork
from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.elastic.etcd_server import EmbeddedEtcd, EmbeddedEtcdCluster
from planaria.runtime.contract import keys
from planaria.runtime.contract.membership import Announcement
from planaria.runtime.contract.record import JsonRecord

R = TypeVar("R", bound=JsonRecord)
ETCD_HOST = 200
"""With simulated hosts, etcd member i runs on host ETCD_HOST + i (10.N.200+i.2)."""


class LocalCluster:
    """`nodes` agents of `nproc` workers each, training CONFIG with `overrides`."""

    def __init__(self, config: str | Path, overrides: list[str], *, nodes: int, nproc: int,
                 out_dir: Path, run_id: str, etcd_members: int = 1, lease_ttl_s: int = 3,
                 env: dict[str, str] | None = None, hosts: bool = False, metrics_port: int = 0,
                 min_nodes: int | None = None, max_nodes: int | None = None,
                 preemption_grace_s: float | None = None):
        """`hosts`: each node and each etcd member a host of its own, in a network namespace
        with its own address (`planaria.chaos.hosts`); everything then talks over those
        addresses, never loopback. Off: every process on this machine's loopback.
        `metrics_port`: node i's agent serves Prometheus metrics on port `metrics_port` + i
        (`metrics_endpoint`); 0: none. `min_nodes`, `max_nodes`: the agents' `--nnodes MIN:MAX`
        (epoch 0 waits for MIN, default all `nodes`; a plan uses at most MAX, the nodes
        beyond wait as spares; default: no maximum). `preemption_grace_s`: with `hosts`,
        the agents' --preemption-grace (`preempt` sends the notice as a signal)."""
        self.config, self.overrides = str(config), list(overrides)
        self.nproc, self.run_id, self.lease_ttl_s = nproc, run_id, lease_ttl_s
        self.min_nodes = min_nodes or nodes
        self.max_nodes = max_nodes
        self.metrics_port = metrics_port
        self.preemption_grace_s = preemption_grace_s
        self.out_dir = Path(out_dir)
        self.log_dir = self.out_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        self.network = HostNetwork(0).create() if hosts else None
        try:
            self.etcd = self._start_etcd(etcd_members)
        except BaseException:
            if self.network is not None:
                self.network.close()
            raise
        self.client = EtcdClient(EtcdSettings(endpoint=self.etcd.endpoint))
        self.prefix = keys.run_prefix(run_id)
        self.cloud = None if hosts else LocalCloud()
        """The nodes' metadata service (on loopback: the simulated hosts cannot reach it)."""
        self.agents: dict[int, subprocess.Popen] = {}
        self.frozen: set[int] = set()
        """Nodes frozen by `freeze_node`: running, but neither live nor killable."""
        for _ in range(nodes):
            self.add_node()

    def _start_etcd(self, members: int):
        if self.network is None:
            return (EmbeddedEtcdCluster(members, log_dir=self.log_dir) if members > 1
                    else EmbeddedEtcd(log=self.log_dir / "etcd.log")).start()
        # etcd's hosts are numbered from ETCD_HOST, the nodes' from 0.
        hosts = [(self.network.address(h), self.network.run_in(h, [])) for h in
                 (self.network.ensure_host(ETCD_HOST + i) for i in range(members))]
        if members > 1:
            return EmbeddedEtcdCluster(members, log_dir=self.log_dir, hosts=hosts).start()
        return EmbeddedEtcd(log=self.log_dir / "etcd.log", host=hosts[0][0], launch=hosts[0][1]).start()

    # ------------------------------------------------------------ nodes
    def add_node(self) -> int:
        index = len(self.agents)
        log = open(self.log_dir / f"agent-node{index}.log", "w", encoding="utf-8")
        launch, env, notices = [], self.env, []
        if self.cloud is not None:
            notices = ["--preemption-notice", "aws", "--preemption-endpoint", self.cloud.endpoint(f"node{index}")]
        elif self.preemption_grace_s is not None:
            notices = ["--preemption-grace", f"{self.preemption_grace_s:g}"]
        if self.network is not None:
            # The node's workers reach their peers through its own interface, as on a host.
            launch = self.network.run_in(self.network.ensure_host(index), [])
            env = dict(self.env, GLOO_SOCKET_IFNAME=IFNAME)
        self.agents[index] = subprocess.Popen(
            [*launch, sys.executable, "-m", "planaria.elastic.agent", "--node", f"node{index}",
             "--nproc-per-node", str(self.nproc), "--etcd", self.etcd.endpoint, "--run-id", self.run_id,
             "--nnodes", f"{self.min_nodes}:{self.max_nodes}" if self.max_nodes else str(self.min_nodes),
             "--lease-ttl", str(self.lease_ttl_s),
             "--log-dir", str(self.log_dir), *notices, *self._metrics_flags(index), self.config, *self.overrides],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return index

    def _metrics_flags(self, index: int) -> list[str]:
        return ["--metrics-port", str(self.metrics_port + index)] if self.metrics_port else []

    def metrics_endpoint(self, index: int) -> str | None:
        """Where node `index`'s agent serves its metrics (None: no --metrics-port): its
        node's address, which is its host's, or loopback's (the route to a loopback etcd)."""
        if not self.metrics_port:
            return None
        host = self.network.address(index) if self.network is not None else "127.0.0.1"
        return f"http://{host}:{self.metrics_port + index}/metrics"

    def live_nodes(self) -> list[int]:
        """Nodes whose agent runs and is not frozen."""
        return [i for i, agent in self.agents.items() if agent.poll() is None and i not in self.frozen]

    def kill_node(self, index: int) -> None:
        """SIGKILL the node's agent and workers together."""
        try:
            os.killpg(self.agents[index].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def isolate_node(self, index: int) -> Callable[[], None]:
        """Cut node `index`'s host off every other host, etcd's included: its packets
        vanish both ways, nothing is closed. Returns what heals it."""
        me = self.network.address(index)
        others = [a for a in self.network.addresses() if a != me]
        for other in others:
            self.network.cut(me, other)

        def heal() -> None:
            for other in others:
                self.network.heal(me, other)
        return heal

    def partition(self, group: list[int]) -> Callable[[], None]:
        """Cut the nodes of `group` off the other nodes (both ways, packets vanish); every
        node still reaches etcd. Returns what heals it."""
        side = {self.network.address(i) for i in group}
        others = {self.network.address(i) for i in self.agents if i not in group}
        pairs = [(a, b) for a in sorted(side) for b in sorted(others)]
        for a, b in pairs:
            self.network.cut(a, b)
        return lambda: [self.network.heal(a, b) for a, b in pairs] and None

    def isolate_etcd_member(self, member: int) -> Callable[[], None]:
        """Cut etcd member `member` off the other members: it still answers the nodes'
        connections, but as a minority without a leader it can serve nothing."""
        me = self.network.address(ETCD_HOST + member)
        others = [self.network.address(ETCD_HOST + m) for m in range(len(self.etcd.members)) if m != member]
        for other in others:
            self.network.cut(me, other)
        return lambda: [self.network.heal(me, other) for other in others] and None

    def slow_link(self, index: int, rate: str = "1mbit") -> Callable[[], None]:
        """Limit node `index`'s link to `rate` both ways; returns what lifts the limit."""
        self.network.slow(index, rate)
        return lambda: self.network.slow(index, None)

    def preempt(self, index: int, notice_s: float) -> float:
        """Announce node `index`'s preemption `notice_s` from now, through its metadata
        (with `hosts`, which cannot reach it: its agent's SIGTERM, the scheduler's notice,
        with the agents' --preemption-grace); returns the deadline, at which the caller
        kills the node if it is still there."""
        if self.cloud is None:
            self.agents[index].send_signal(signal.SIGTERM)
            return time.time() + notice_s
        node = f"node{index}"
        self.cloud.preempt(node, time.time() + notice_s)
        return self.cloud.deadline(node)

    def freeze_node(self, index: int) -> None:
        """SIGSTOP the node's agent and workers together: nothing of it closes or answers,
        and its lease lapses, which is what the rest of the job sees of a node cut off
        the network. It stays frozen until the cluster is closed (SIGKILL ends it then)."""
        self.frozen.add(index)
        try:
            os.killpg(self.agents[index].pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass

    def kill_agent(self, index: int) -> None:
        """SIGKILL the agent alone (its workers die with it: PR_SET_PDEATHSIG)."""
        self.agents[index].send_signal(signal.SIGKILL)

    def worker_pid(self, index: int, local: int) -> int | None:
        value, _ = self.client.get(self.prefix + keys.member((f"node{index}", local)))
        return Announcement.from_json(value).pid if value else None

    def signal_worker(self, index: int, local: int, signum: int) -> bool:
        pid = self.worker_pid(index, local)
        if pid is None:
            return False
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return False
        return True

    def kill_etcd_member(self, member: int) -> None:
        self.etcd.members[member].kill()

    def restart_etcd_member(self, member: int) -> None:
        """Start a killed member again on its data directory; it catches up from the quorum."""
        self.etcd.members[member].start(wait=False)

    def live_etcd_members(self) -> list[int]:
        members = getattr(self.etcd, "members", [self.etcd])
        return [i for i, m in enumerate(members) if m.process is not None and m.process.poll() is None]

    # -------------------------------------------------------------- job
    def outcome(self) -> str | None:
        """The job's end as the leader recorded it ("ok" or "failed: ..."), or None."""
        value, _ = self.client.get(self.prefix + keys.DONE)
        return value.decode() if value else None

    def store_value(self, key: str) -> bytes | None:
        value, _ = self.client.get(self.prefix + key)
        return value

    def store_record(self, key: str, record: type[R]) -> R | None:
        value = self.store_value(key)
        return record.from_json(value) if value else None

    def store_keys(self, prefix: str) -> list[str]:
        return self.client.keys_with_prefix(self.prefix + prefix)

    def close(self) -> None:
        for index in list(self.agents):
            self.kill_node(index)
        for agent in self.agents.values():
            agent.wait()
        self.etcd.stop()
        if self.cloud is not None:
            self.cloud.close()
        if self.network is not None:
            self.network.close()
