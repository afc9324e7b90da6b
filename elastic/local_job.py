"""A job on this machine: worker processes, a store, and the controller, in one object.

`LocalJob` owns what a real deployment spreads over nodes: the job's coordination store
(a `TCPStore` in this process, or, with `store="etcd"`, an embedded etcd server and an
`EtcdStore` under /planaria/<run-id>/), one process per worker running
`python -m planaria.train CONFIG ...` with the elastic environment, and the
`Controller`, which it polls with the set of live processes. Tests and benchmarks use
it to run real failures (processes SIGKILLed, by `kill` or by the workers' own fault
injection), joins (`add_node`) and leaves with notice (`notify`: a node's preemption
announced, as its agent would post it). Each worker's output goes to
OUTPUT_DIR/logs/<node>.<local>.log.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from planaria.elastic.controller import Controller
from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.elastic.etcd_server import EmbeddedEtcd, EmbeddedEtcdCluster
from planaria.elastic.etcd_store import EtcdStore
from planaria.elastic.job_checkpoints import CheckpointPolicy
from planaria.runtime.config.loading import load_config
from planaria.runtime.config.sections import status_timeout_s as default_status_timeout
from planaria.runtime.contract import env as worker_env
from planaria.runtime.contract.keys import run_prefix, worker_key
from planaria.runtime.contract.membership import LeaveNotice
from planaria.runtime.planning.job_plans import build_planner, cost_model
from planaria.templates.plan import Worker


@dataclass(frozen=True)
class JobResult:
    outcome: str
    """"ok", or "failed: <reason>"."""
    seconds: float
    controller: Controller


class LocalJob:
    """A job of `nodes` nodes of `gpus_per_node` workers each (module docstring)."""

    def __init__(self, config: str | Path, overrides: list[str], *, nodes: int, out_dir: Path,
                 gpus_per_node: int = 1, hardware: str = "h100", faults: str = "", corrupt: str = "",
                 status_timeout_s: float | None = None, log=None, store: str = "tcp",
                 run_id: str = "local", etcd_members: int = 1, spread_gpus: int = 0):
        """`spread_gpus`: this machine's GPUs to spread the nodes over, as if each node were
        a host of its own (its workers see GPUs of their own through
        CUDA_VISIBLE_DEVICES; NCCL refuses two ranks of a group on one GPU); 0: every
        worker sees every GPU."""
        self.config = str(config)
        self.spread_gpus = spread_gpus
        self.overrides = list(overrides) + [f"output.dir={out_dir}"]
        self.cfg = load_config(self.config, self.overrides)
        self.out_dir = Path(out_dir)
        self.gpus_per_node = gpus_per_node
        self.faults = faults
        self.corrupt = corrupt
        self.log = log or (lambda message: print(message, flush=True))
        (self.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.etcd = None
        if store == "etcd":
            self.etcd = (EmbeddedEtcd(log=self.out_dir / "logs" / "etcd.log") if etcd_members == 1
                         else EmbeddedEtcdCluster(etcd_members, log_dir=self.out_dir / "logs")).start()
            prefix = run_prefix(run_id).rstrip("/")
            self.store = EtcdStore(EtcdClient(EtcdSettings(endpoint=self.etcd.endpoint)), prefix)
            self.store_url = f"etcd://{self.etcd.endpoint}{prefix}"
        elif store == "tcp":
            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=60))
            self.store_url = f"127.0.0.1:{self.store.port}"
        else:
            raise ValueError(f"store must be 'tcp' or 'etcd', got {store!r}")
        costs = cost_model(self.cfg, hardware_name=hardware, gpus_per_node=gpus_per_node)
        self.controller = Controller(
            self.store, build_planner(self.cfg, costs), total_steps=self.cfg.train.steps,
            gpus_per_node=gpus_per_node,
            status_timeout_s=(status_timeout_s if status_timeout_s is not None
                              else default_status_timeout(self.cfg.comm)),
            log=self.log, checkpoints=CheckpointPolicy(self.cfg.checkpoint_dir, self.cfg.checkpoint.every,
                                                      self.cfg.checkpoint.keep),
            # One host, its workers its own children: a worker not alive has exited, and
            # nothing is ever cut off (`cut_wait`).
            notices=self._live_notices, cut_wait_s=0)
        self._notices: dict[str, LeaveNotice] = {}
        self.processes: dict[Worker, subprocess.Popen] = {}
        self.nodes = [f"node{i}" for i in range(nodes)]
        self._log_files = []

    def initial_plan(self):
        """The plan epoch 0 will run (the planner's, for the job's nodes)."""
        return self.controller.planner.instantiate(len(self.nodes), node_ids=sorted(self.nodes)).plan

    # --------------------------------------------------------------- nodes
    def add_node(self) -> str:
        """Start a new node's workers; the running job absorbs them at its next iteration
        boundary."""
        node = f"node{len(self.nodes)}"
        self.nodes.append(node)
        for local in range(self.gpus_per_node):
            self._spawn((node, local), faults="")
        return node

    def kill(self, worker: Worker, sig: int = signal.SIGKILL) -> None:
        proc = self.processes.get(worker)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            if sig == signal.SIGKILL:
                proc.wait()  # reaped: it must not look alive at the next poll

    def notify(self, node: str, notice_s: float, source: str = "test") -> None:
        """Announce that `node` will be gone in `notice_s` seconds: the controller plans it
        out at the next step boundary; if its workers are still there at the deadline,
        they are SIGKILLed, as the cloud would."""
        now = time.time()
        self._notices[node] = LeaveNotice(source=source, deadline=now + notice_s, posted=now)

    def _live_notices(self) -> dict[str, LeaveNotice]:
        """The notices of nodes with a live worker (a notice goes with its node, as an
        agent's lease takes its keys)."""
        live = {node for node, _ in self.alive()}
        self._notices = {n: notice for n, notice in self._notices.items() if n in live}
        return dict(self._notices)

    def _enforce_deadlines(self) -> None:
        for node, notice in list(self._notices.items()):
            if time.time() >= notice.deadline:
                for worker in [w for w in self.processes if w[0] == node]:
                    self.kill(worker)

    def alive(self) -> set[Worker]:
        return {w for w, p in self.processes.items() if p.poll() is None}

    def _spawn(self, worker: Worker, faults: str) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   **worker_env.for_worker(self.store_url, worker, **{worker_env.FAULTS: faults,
                                                                       worker_env.CORRUPT: self.corrupt}))
        if self.spread_gpus:
            first = self.nodes.index(worker[0]) * self.gpus_per_node
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                str((first + local) % self.spread_gpus) for local in range(self.gpus_per_node))
        log = open(self.out_dir / "logs" / f"{worker_key(worker)}.log", "a", encoding="utf-8")
        self._log_files.append(log)
        self.processes[worker] = subprocess.Popen(
            [sys.executable, "-m", "planaria.train", self.config, *self.overrides],
            stdout=log, stderr=subprocess.STDOUT, env=env)

    # ----------------------------------------------------------------- run
    def run(self, timeout_s: float, *, actions=None) -> JobResult:
        """Publish epoch 0 and drive the controller until the job ends or `timeout_s`
        passes (then every worker is killed and the result says so). `actions`: a
        callable given (job, elapsed seconds) at every poll, to kill or add nodes."""
        started = time.monotonic()
        try:
            for node in self.nodes:
                for local in range(self.gpus_per_node):
                    self._spawn((node, local), faults=self.faults)
            self.controller.start(sorted(self.processes), self.initial_plan())
            while True:
                self._enforce_deadlines()
                state = self.controller.poll(self.alive, self.kill)
                if state != "running":
                    break
                elapsed = time.monotonic() - started
                if elapsed > timeout_s:
                    self.controller._end(f"failed: timed out after {timeout_s:.0f} s")
                    break
                if actions is not None:
                    actions(self, elapsed)
                time.sleep(0.02)
            self._wait_for_exit(timeout_s=30)
        finally:
            self.close()
        return JobResult(self.controller.outcome, time.monotonic() - started, self.controller)

    def _wait_for_exit(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.processes.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()

    def close(self) -> None:
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in self._log_files:
            log.close()
        if self.etcd is not None:
            self.etcd.stop()

    def logs(self) -> str:
        """Every worker's log, for a failing test's message."""
        return "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}"
                         for path in sorted((self.out_dir / "logs").glob("*.log")))
