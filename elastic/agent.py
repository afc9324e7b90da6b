"""One agent per node: membership under an etcd lease, the node's workers, and, on the
agent that holds the leadership, the controller (docs/control_plane.md).

    python -m planaria.elastic.agent --node NAME --nproc-per-node G --etcd HOST:PORT \\
        --run-id JOB --nnodes MIN [--lease-ttl S] -- CONFIG.yaml [section.key=value ...]

Keys, under /planaria/<run-id>/ (the job's `EtcdKeyValue` prefix):

    nodes/<node>            the node, bound to its agent's lease
    alive/<node>.<local>    a live worker, bound to the lease, deleted when it exits
    leader                  the leading agent's node, bound to its lease
    kill/<node>.<local>     the leader asks the worker's agent to SIGKILL it

A node that dies takes its lease with it: its keys vanish after the lease's TTL, and the
leader's next look at `alive/` sees its workers gone (a worker's own exit is seen at
once, by its agent). Every agent campaigns for `leader` (a create-if-absent bound to its
lease); the winner runs a `Controller` over the job's store, polling it with the
workers under `alive/`. When the leader's node dies its lease expires, another agent
wins, and its controller resumes from the newest published epoch in the store, so the
epoch sequence goes on. The first leader publishes epoch 0 once `--nnodes` nodes have
all their workers alive.

A node whose worker dies leaves the job: its agent stops the node's other workers and
exits, or, with `--max-restarts N`, starts them again (up to N times) as new capacity
under a new name, `<node>~<restart>`: the leader sees a node join, and a worker is never
mistaken for its predecessor (whose kill requests, statuses and commit log stay its
own). Workers get torchrun's TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT,
TORCHELASTIC_MAX_RESTARTS and TORCHELASTIC_ERROR_FILE; a worker that dies of an uncaught
exception writes it there (torch's `record`), and its agent reports it. The signals of
`--signals-to-handle` (torchrun's default: SIGTERM, SIGINT, SIGHUP, SIGQUIT) stop the
node's workers (the same signal, then SIGKILL after `--shutdown-timeout`, 30 s), take
the node out (the leader recovers in place without it), and exit 128 + the signal's
number. Workers die with their agent (PR_SET_PDEATHSIG): a killed agent takes its node
out, as a dead machine would. Workers run `python -m planaria.train CONFIG ...` with
PLANARIA_STORE pointing at the store in etcd (and etcd's TLS and credentials in
PLANARIA_ETCD_*).

etcd going away entirely does not stop the job. Etcd is retried for `--etcd-retry`
seconds while the agent starts (an endpoint that never answers is a configuration
error); once the node is registered, every agent and worker waits out an outage (for
as long as `--etcd-outage-limit`, default: as long as it takes), saying so once when it
starts and once when it ends. Workers train on meanwhile: their collectives do not
touch etcd. A failure during the outage waits for etcd: the survivors' statuses and
the dead node's exit reach the leader when it is back, and the exactly-once rule loses
no step. When etcd returns, its leases are still there (etcd extends every lease when
it elects a leader); an agent whose lease expired anyway registers its node and live
workers again, and a leader acts on membership only once every agent has had a lease
period to renew (`_settled`), so that a returning etcd causes no reconfiguration.

With `--metrics-port PORT` (PLANARIA_METRICS_PORT) the agent serves the job's and its
node's metrics to Prometheus on its node's address (`planaria.elastic.metrics`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
import time
from collections import Counter
from pathlib import Path

from planaria.elastic.controller import Controller
from planaria.elastic.controller_errors import StepDown
from planaria.elastic.etcd_client import EtcdClient, EtcdSettings, EtcdUnavailable, LeaseExpired
from planaria.elastic.etcd_kv import EtcdKeyValue
from planaria.elastic.job_checkpoints import CheckpointPolicy
from planaria.elastic.metrics import PORT_ENV, MetricsServer, port_number, serve as serve_metrics
from planaria.elastic.peer_probe import PeerProbe, node_address
from planaria.elastic.preemption import SOURCES, Notice, make_watcher, signal_notice
from planaria.elastic.worker_output import (OutputSpec, Tail, WorkerStreams, close_files, open_streams, ranks_filter,
                                            start_tails, std_of)
from planaria.runtime.config.loading import load_config
from planaria.runtime.config.sections import ConfigError, status_timeout_s
from planaria.runtime.contract import env as worker_env, keys
from planaria.runtime.contract.exits import EXIT_STUCK_AFTER_RELEASE
from planaria.runtime.contract.heartbeat import silent_for
from planaria.runtime.contract.keys import parse_worker_key, worker_key
from planaria.runtime.contract.membership import JobSpec, LeaveNotice, NodeRegistration
from planaria.templates.plan import Worker
from planaria.runtime.planning.job_plans import build_planner, cost_model

POLL_S = 0.1
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""torchrun's --signals-to-handle."""
MAX_RESETS = 5
"""Workers started again because they asked (`_reset_asked`), at most, on top of --max-restarts."""
NOTICE_POLL_S = 2.0
"""How often a cloud's metadata is asked for a notice (AWS advises every 5 s; GCP's
answer waits for a change itself)."""




class NodeNameTaken(RuntimeError):
    """Another live agent of the run registered under this agent's node name."""


class Agent:
    def __init__(self, *, node: str, nproc: int, settings: EtcdSettings, run_id: str, min_nodes: int,
                 config: str, overrides: list[str], lease_ttl_s: int = 5, hardware: str = "h100",
                 log_dir: Path | None = None, outage_limit_s: float = math.inf, max_restarts: int = 0,
                 signals: str = DEFAULT_SIGNALS, shutdown_timeout_s: float = 30.0, metrics_port: int = 0,
                 local_addr: str | None = None, preemption: str = "signal", preemption_grace_s: float = 30.0,
                 preemption_endpoint: str | None = None, notice_signals: str = "SIGTERM",
                 max_nodes: int | None = None, join_timeout_s: float = 600.0, last_call_s: float = 0.0,
                 monitor_interval_s: float = POLL_S, output: OutputSpec | None = None):
        self.node, self.nproc, self.min_nodes = node, nproc, min_nodes
        self.max_nodes = max_nodes
        """The most nodes a plan uses; the others wait as spares (`Controller.max_nodes`)."""
        self.join_timeout_s, self.last_call_s = join_timeout_s, last_call_s
        """torchrun's rendezvous timeouts: epoch 0 is given up (the job fails) when fewer than
        `min_nodes` nodes came within `join_timeout_s`; once `min_nodes` are there, it waits
        `last_call_s` more for nodes up to `max_nodes` (0: it starts at once, and later nodes
        join at a step boundary)."""
        self.monitor_interval_s = monitor_interval_s
        """How often the agent looks at its workers and the job (torchrun's --monitor-interval)."""
        self._started_at = time.monotonic()
        self._min_reached_at: float | None = None
        self.run_id, self.max_restarts, self.restarts, self.resets = run_id, max_restarts, 0, 0
        self.signals = parse_signals(signals)
        self.shutdown_timeout_s = shutdown_timeout_s
        self.watcher = make_watcher(preemption, preemption_endpoint, log=self.log)
        """The cloud's notice watcher (None for `signal`: `_on_signal` is it)."""
        self.grace_s = preemption_grace_s
        self.notice_signals = parse_signals(notice_signals) if preemption == "signal" and preemption_grace_s > 0 else []
        """Signals that mean "gone in `grace_s`" (a planned leave) rather than "stop now"."""
        self._notice: Notice | None = None
        self._notice_signal: int | None = None
        self._notice_posted = False
        self._withdrawn = False
        self._notices_read: tuple[float, dict[str, LeaveNotice]] = (-1.0, {})
        # A request that hangs (an etcd member cut off from the others still accepts
        # connections, but serves nothing) must give up, and fail over to another member,
        # well within the lease's TTL: a third of it, as often as the lease is renewed.
        settings = dataclasses.replace(settings, timeout_s=min(settings.timeout_s, max(1.0, lease_ttl_s / 3)))
        self.settings = settings
        self.client = EtcdClient(settings, on_outage=self.log)
        self.outage_limit_s = outage_limit_s
        self.prefix = keys.run_prefix(run_id)
        self.store = EtcdKeyValue(self.client, self.prefix)
        self.store_url = f"etcd://{settings.endpoint}{self.prefix.rstrip('/')}"
        self.config, self.overrides = config, overrides
        self.cfg = load_config(config, overrides)
        self.lease_ttl_s = lease_ttl_s
        self.hardware = hardware
        self.log_dir = Path(log_dir) if log_dir else None
        """Worker output goes here, a file per worker; None: to this agent's own output."""
        self.output = output
        """torchrun's --log-dir, -r, -t and --local-ranks-filter (`worker_output`); None: as
        `log_dir` says."""
        self._streams: dict[Worker, WorkerStreams] = {}
        self._tails: list[Tail] = []
        self.workers: dict[Worker, subprocess.Popen] = {}
        self.controller: Controller | None = None
        self.lease = None
        self._stop = threading.Event()
        self._lease_lost = threading.Event()
        self._lease_swap = threading.Lock()
        """Held while a lease is declared lost or replaced: a refresh of the old lease that
        fails as `_register` puts the new one in place must not mark the new one lost."""
        self._exited: set[Worker] = set()
        self._said_settling: float | None = None
        self._signal: int | None = None
        self.error_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"planaria-{node}-")) / "errors"
        self.agent_id = uuid.uuid4().hex
        """Tells this agent's claim on its node name from another's (`_register`)."""
        self.local_addr = local_addr
        self.probe: PeerProbe | None = None
        """This node's reachability probe of the others (made in `run`)."""
        self.metrics_port = metrics_port
        self.metrics: MetricsServer | None = None
        """The Prometheus endpoint (`--metrics-port`, `planaria.elastic.metrics`); None: off."""
        self._published_view: list[str] | None = None
        self._views: tuple[float, dict[str, list[str]]] = (-1.0, {})
        self._peers_read = -1.0
        self._said_never: list[str] = []

    def log(self, message: str) -> None:
        print(f"[agent {self.node}] {message}", flush=True)

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        address = node_address(self.settings.endpoint, os.environ, self.local_addr)
        self.metrics = self._serve_metrics(address)  # first: a port in use is refused before anything starts
        refused = self._check_job_config() or self._check_not_ended()
        if refused:
            self.log(refused)
            return 2
        self.probe = PeerProbe(self.node, address).start()
        try:
            self._register()
        except NodeNameTaken as err:
            self.log(str(err))
            return 2
        threading.Thread(target=self._keep_alive, daemon=True, name="lease").start()
        if self.watcher is not None:
            threading.Thread(target=self._watch_notices, daemon=True, name="preemption").start()
        for signum in {*self.signals, *self.notice_signals}:
            signal.signal(signum, self._on_signal)
        self._start_workers()
        self.client.retry_s = self.outage_limit_s  # from now on, etcd outages are waited out
        try:
            while True:
                if self._signal is not None:
                    return self._stop_on_signal(self._signal)
                try:
                    outcome = self._tick()
                except EtcdUnavailable:
                    if self._signal is None:
                        raise
                    continue  # a signal cut short a wait for etcd
                except LeaseExpired:  # seen by a write before the keep-alive thread saw it
                    self._lost(self.lease)
                    continue
                if outcome is not None:
                    return outcome
                time.sleep(self.monitor_interval_s)
        finally:
            self._stop.set()
            self.probe.stop()
            if self.metrics is not None:
                self.metrics.stop()
            self._finish_tails()

    def _finish_tails(self, limit_s: float = 5.0) -> None:
        """Let the tee'd output of workers that have exited reach the console (their last
        lines, written as they exit, come after the agent saw them go)."""
        deadline = time.monotonic() + limit_s
        for tail in self._tails:
            tail.join(max(0.0, deadline - time.monotonic()))

    def _serve_metrics(self, address: str) -> MetricsServer | None:
        """The Prometheus endpoint on this node's address (where the other nodes reach it,
        so a scraper on their network does too); None without --metrics-port."""
        if not self.metrics_port:
            return None
        server = serve_metrics(self.settings, self.run_id, address, self.metrics_port,
                               node=lambda: (self.node, self.member), live_workers=self._live_workers,
                               log=self.log)
        self.log(f"metrics on {server.endpoint}")
        return server

    def _tick(self) -> int | None:
        """One look at the node and the job; the agent's exit code once it is over."""
        if self._lease_lost.is_set():
            self.log("this node's lease expired while etcd was away; registering again")
            try:
                self._register()
            except NodeNameTaken as err:  # another agent took the name meanwhile
                self.log(f"{err}; this node's workers stop and the node leaves the job")
                self._stop_workers(signal.SIGKILL)
                return 1
        self._kill_frozen_workers()
        self._publish_reachability()
        if self._notice is not None:
            code = self._serve_notice()
            if code is not None:
                return code
        if self._reap() and self._notice is None:  # a leaving node's exits: `_serve_notice`
            # A reset first: it is not one of the user's --max-restarts, even while some are left.
            reset = self._signal is None and self._reset_asked()
            if reset or (self._signal is None and self.restarts < self.max_restarts):
                self._restart(reset)
                return None
            self.log("a worker of this node exited; the node leaves the job")
            return self._leave()
        self._serve_kill_requests()
        self._lead()
        if self.store.check([keys.DONE]) and not self._running():
            outcome = self.store.get(keys.DONE).decode()
            self.log(f"job ended: {outcome}")
            return 0 if outcome == "ok" else 1
        return None

    def _reset_asked(self) -> bool:
        """A worker exited asking to be started again (`EXIT_STUCK_AFTER_RELEASE`: its
        collectives stayed blocked after their release): not a failure of the node, so
        not counted against --max-restarts, up to `MAX_RESETS` times."""
        asked = any(p.returncode == EXIT_STUCK_AFTER_RELEASE for p in self.workers.values())
        if asked and self.resets < MAX_RESETS:
            self.resets += 1
            self.max_restarts += 1  # this restart is not one of the user's
            return True
        return False

    def _on_signal(self, signum, frame) -> None:
        if signum in self.notice_signals and self._notice is None:
            # A notice, not a stop: the node leaves at a step boundary within the grace
            # period (`_serve_notice`). The same signal again stops it at once.
            self._notice = signal_notice(signal.Signals(signum).name, self.grace_s)
            self._notice_signal = signum
            return
        self._signal = signum  # acted on by the main loop, between two looks at etcd
        self.client.abort.set()  # a look that waits for an absent etcd gives up

    # ------------------------------------------------------------ notices
    def _watch_notices(self) -> None:
        """The cloud's word, asked every `NOTICE_POLL_S` (a watcher never raises): a notice
        becomes this node's; one that goes away again before the node left is withdrawn."""
        while not self._stop.wait(NOTICE_POLL_S):
            notice = self.watcher.poll()
            if notice is not None and self._notice is None:
                self._withdrawn = False
                self._notice = notice
            elif (notice is None and self.watcher.answered and self._notice is not None
                  and self._notice_signal is None):  # (not when the metadata could not say)
                self._withdrawn = True

    def _serve_notice(self) -> int | None:
        """This node has a notice: post it for the leader (under the lease: it goes with
        the node), then exit once the workers have left (they hand their layers over
        first: `ElasticWorker._leave`), or stop them at the deadline if they are still
        there. A withdrawn notice is taken back while the workers still train."""
        notice = self._notice
        key = self.prefix + keys.notice(self.member)
        if self._withdrawn:
            self.log(f"the preemption notice ({notice.source}) was withdrawn; this node stays in the job")
            self.client.delete(key)
            self._notice, self._notice_posted, self._withdrawn = None, False, False
            return None
        if not self._notice_posted:
            self.log(f"preemption notice ({notice.detail or notice.source}): the node leaves the job at a "
                     f"step boundary within {notice.left_s():.0f} s")
            record = LeaveNotice(source=notice.source, deadline=notice.deadline, posted=time.time())
            self.client.put(key, record.to_json().encode(), lease=self.lease)
            self._notice_posted = True
        code = 128 + self._notice_signal if self._notice_signal is not None else 0
        if not self._running():
            self.log("this node's workers have left; the node leaves the job")
        elif notice.left_s() <= 1.0:
            self.log("the notice's deadline is here and this node's workers still run; stopping them")
            code = code or 1
        else:
            return None
        self._leave(signal.SIGKILL)
        if self.watcher is not None:
            self.watcher.acknowledge(notice)  # Azure need not wait for NotBefore
        return code

    def _posted_notices(self) -> dict[str, LeaveNotice]:
        """{node: its notice}, for the controller (read at most four times a second)."""
        read_at, notices = self._notices_read
        if time.monotonic() - read_at >= 0.25:
            notices = {node: LeaveNotice.from_json(value) for node, value in
                       self.client.items_with_prefix(self.prefix + keys.NOTICE).items()}
            self._notices_read = (time.monotonic(), notices)
        return notices

    def _stop_on_signal(self, signum: int) -> int:
        """Stop the workers with the signal, take the node out, exit 128 + its number."""
        self.log(f"{signal.Signals(signum).name}: stopping this node's workers; the node leaves the job")
        self._stop_workers(signum)
        self.client.abort.clear()
        self.client.retry_s = 5.0
        try:
            self._leave(signal.SIGKILL)
        except EtcdUnavailable:
            self.log("etcd did not answer; this node's keys go when its lease expires")
        return 128 + signum

    def _check_job_config(self) -> str | None:
        """One run id, one job: the first agent records its config; a later agent with a
        different one is refused (naming both), so two jobs never mix their workers."""
        mine = JobSpec(self.config, tuple(self.overrides)).to_json()
        key = self.prefix + keys.JOB
        if self.client.put_if_absent(key, mine.encode()):
            return None
        theirs = (self.client.get(key)[0] or b"").decode()
        if theirs == mine:
            return None
        return (f"refused: run id {self.prefix.split('/')[2]!r} already runs {theirs}, and this "
                f"agent was given {mine}; use another --run-id, or the same config")

    def _check_not_ended(self) -> str | None:
        """A run id whose job has ended is not run again: its agents would see the old
        outcome and exit at once, as if this job had run."""
        outcome = self.client.get(self.prefix + keys.DONE)[0]
        if outcome is None:
            return None
        return (f"refused: run id {self.run_id!r} already ran and ended ({outcome.decode()}); use another "
                f"--run-id, or delete its keys first (etcdctl del --prefix {self.prefix})")

    def _register(self) -> None:
        """A lease, and under it the node and its live workers (again, after a lease expired).

        The node's key is created, never overwritten: two agents under one name (two
        machines given the same --node-rank, say) would each count the other's workers
        as their own. A name held by a live agent is waited for one lease TTL and a half
        (an agent that died and is started again finds its old lease still running),
        then refused (`NodeNameTaken`)."""
        lease = self.client.lease(self.lease_ttl_s)
        key = self.prefix + keys.node_registration(self.node)
        mine = NodeRegistration(self.nproc, self.agent_id).to_json().encode()
        deadline = time.monotonic() + 1.5 * self.lease_ttl_s + 1
        while not self.client.put_if_absent(key, mine, lease=lease):
            if self.client.get(key)[0] == mine:
                break  # ours: the create's reply was lost and it was retried
            if time.monotonic() > deadline:
                raise NodeNameTaken(f"refused: another live agent of run {self.run_id!r} is node "
                                    f"{self.node!r}; give each machine its own --node-rank (or --node)")
            time.sleep(0.5)
            if not self.client.refresh(lease):  # kept alive while waiting: nobody else does yet
                lease = self.client.lease(self.lease_ttl_s)
        # The flag is cleared only once the new lease is in place: cleared first, a refresh
        # of the old lease failing meanwhile (the keep-alive thread, the controller's
        # `_still_leading`) set it again, and the node registered twice.
        with self._lease_swap:
            self.lease = lease
            self._lease_lost.clear()
        for worker in self._running():
            self.client.put(self.prefix + keys.alive(worker), b"1", lease=self.lease)
        self._notice_posted = False  # a notice goes with its lease: posted again under the new one
        if self.probe is not None:
            self.client.put(self.prefix + keys.PROBE + self.node, self.probe.address.encode(), lease=self.lease)
            self._published_view = None  # written again under the new lease

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.lease_ttl_s / 3):
            if self._lease_lost.is_set():
                continue  # the main loop registers again
            lease = self.lease
            try:
                if not self.client.refresh(lease):
                    self._lost(lease)
            except EtcdUnavailable as err:  # past --etcd-outage-limit: the main loop ends it
                if self._signal is None:
                    self.log(str(err))
            except Exception as err:  # noqa: BLE001 - a dead keep-alive thread would let the
                # lease expire and take a healthy node out of the job: say it, try again
                self.log(f"keeping the lease alive failed ({type(err).__name__}: {err}); trying again")

    def _lost(self, lease) -> None:
        """`lease` expired: the main loop registers again, unless `_register` has replaced
        it already (a refresh of the old lease that fails late says nothing of the new one)."""
        with self._lease_swap:
            if lease is self.lease:
                self._lease_lost.set()

    # --------------------------------------------------------- reachability
    def _probe_addresses(self) -> dict[str, str]:
        return {node: value.decode() for node, value in
                self.client.items_with_prefix(self.prefix + keys.PROBE).items()}

    def _publish_reachability(self) -> None:
        """Hand the probe the other nodes' listeners (every 2 s), and publish the nodes
        this one cannot reach, under its lease, when that changed."""
        if time.monotonic() - self._peers_read >= 2.0:
            self._peers_read = time.monotonic()
            self.probe.set_peers(self._probe_addresses())
        never = list(self.probe.never_reached)
        if never and never != self._said_never:
            self.log(f"never reached {never} at their addresses (this node's is {self.probe.address}); "
                     "if no node can, the nodes' --local-addr or GLOO_SOCKET_IFNAME names a network "
                     "they do not share")
        self._said_never = never
        view = list(self.probe.unreachable)
        if view == self._published_view:
            return
        self.client.put(self.prefix + keys.UNREACHABLE + self.node, json.dumps(view).encode(), lease=self.lease)
        if view or self._published_view:
            self.log(f"cannot reach {view}" if view else "reaches every node again")
        self._published_view = view

    def _unreachable_views(self) -> dict[str, list[str]]:
        """{node: the nodes it cannot reach}, as the nodes published them (read at most
        twice a second: the leader asks at every poll), this node's own as its probe
        sees it now (the leader's agent publishes nothing while its controller waits)."""
        read_at, views = self._views
        if time.monotonic() - read_at >= 0.5:
            views = {node: json.loads(value) for node, value in
                     self.client.items_with_prefix(self.prefix + keys.UNREACHABLE).items()}
            self._views = (time.monotonic(), views)
        return {**views, self.node: list(self.probe.unreachable)}

    # -------------------------------------------------------------- workers
    @property
    def member(self) -> str:
        """The name this node's workers have in the job: the node's, then `<node>~<restart>`."""
        return self.node if self.restarts == 0 else f"{self.node}~{self.restarts}"

    def _start_workers(self) -> None:
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        for local in range(self.nproc):
            self._spawn((self.member, local))

    def _restart(self, reset: bool = False) -> None:
        """Stop what is left of this node's workers, then start them again as new capacity
        (`reset`: a worker asked to be, `_reset_asked`)."""
        self._stop_workers(signal.SIGKILL)
        self._reap()
        self.restarts += 1
        self.workers.clear()
        why = (f"a worker's collectives stayed blocked after their release: reset {self.resets} of {MAX_RESETS}, "
               "not counted against --max-restarts" if reset else
               f"restart {self.restarts - self.resets} of {self.max_restarts - self.resets}")
        self.log(f"restarting this node's workers ({why}); they join the job as {self.member}")
        self._start_workers()

    def _error_file(self, worker: Worker) -> Path:
        if worker in self._streams:
            return self._streams[worker].error_file
        return self.error_dir / worker_key(worker) / "error.json"

    def _spawn(self, worker: Worker) -> None:
        streams = None
        if self.output is not None:
            streams = self._streams[worker] = open_streams(self.output, worker[1], self.restarts)
        error_file = self._error_file(worker)
        error_file.parent.mkdir(parents=True, exist_ok=True)
        self._heartbeat_file(worker).parent.mkdir(parents=True, exist_ok=True)  # (apart with --run-log-dir)
        error_file.unlink(missing_ok=True)
        self._heartbeat_file(worker).unlink(missing_ok=True)
        env = dict(os.environ, **worker_env.for_worker(self.store_url, worker), PYTHONUNBUFFERED="1",
                   **{worker_env.DIE_WITH_AGENT: "1"}, TORCHELASTIC_RUN_ID=self.run_id,
                   TORCHELASTIC_RESTART_COUNT=str(self.restarts),
                   TORCHELASTIC_MAX_RESTARTS=str(self.max_restarts),
                   TORCHELASTIC_ERROR_FILE=str(error_file), **self.settings.to_env(),
                   **{worker_env.HEARTBEAT_FILE: str(self._heartbeat_file(worker))})
        if self.restarts:  # an injected fault fires in the first incarnation only
            env.pop(worker_env.FAULTS, None)
        env.setdefault("OMP_NUM_THREADS", "1")
        # NCCL's own error handling must never end a survivor; warned about once, by the worker.
        worker_env.nccl_recovery(env, self.cfg.comm.timeout_s)
        out = err = None  # inherit: the worker's lines (prefixed with its name) in the agent's output
        if streams is not None:
            out, err = streams.stdout, streams.stderr
        elif self.log_dir is not None:
            out, err = open(self.log_dir / f"{worker_key(worker)}.log", "a", encoding="utf-8"), subprocess.STDOUT
        self.workers[worker] = process = subprocess.Popen(
            [sys.executable, "-m", "planaria.train", self.config, *self.overrides], stdout=out, stderr=err, env=env)
        if streams is not None:
            close_files(streams)
            self._tails += start_tails(streams, self.output.rank_offset + worker[1], process)
        self.client.put(self.prefix + keys.alive(worker), b"1", lease=self.lease)

    def _running(self) -> list[Worker]:
        return [w for w, p in self.workers.items() if p.poll() is None]

    def _live_workers(self) -> int:
        """Running workers, for a scrape's thread: a copy of the processes (the loop may be
        changing the dict), their state as the loop last polled it (a tick ago)."""
        return sum(p.returncode is None for p in list(self.workers.values()))

    def _heartbeat_file(self, worker: Worker) -> Path:
        return self.error_dir / worker_key(worker) / "heartbeat"

    def _kill_frozen_workers(self) -> None:
        """SIGKILL a worker whose heartbeat stopped (runtime/heartbeat.py): frozen, it
        would hold the job up until the leader's status timeout; dead, it is a failure
        like any other, seen at once."""
        limit = self.cfg.comm.heartbeat_timeout_s or self.cfg.comm.timeout_s
        now = time.time()
        for worker, proc in self.workers.items():
            silent = silent_for(self._heartbeat_file(worker), now)
            if proc.poll() is None and silent is not None and silent > limit:
                self.log(f"worker {worker_key(worker)} froze (no heartbeat for {silent:.0f} s); killing it")
                proc.kill()
                proc.wait()

    def _reap(self) -> bool:
        """Delete the alive keys of exited workers; True if one exited before the job ended."""
        exited = False
        for worker, proc in self.workers.items():
            if proc.poll() is None:
                continue
            if worker not in self._exited:
                # Counted from the process, not from its key: a key that went with an
                # expired lease (etcd away) would hide the exit, and the node would
                # neither leave nor restart.
                ended = self.store.check([keys.DONE])  # etcd away: asked again next tick
                self._exited.add(worker)
                if not ended:
                    self.log(f"worker {worker_key(worker)} exited with code {proc.returncode}"
                             f"{self._reported_error(worker)}")
                    exited = True
            key = self.prefix + keys.alive(worker)
            if self.client.get(key)[0] is not None:
                self.client.delete(key)
        return exited

    def _serve_kill_requests(self) -> None:
        for worker in self._running():
            if self.store.check([f"kill/{worker_key(worker)}"]):
                self.workers[worker].send_signal(signal.SIGKILL)

    def _reported_error(self, worker: Worker) -> str:
        """': <the exception>' from the worker's error file, or '' if it wrote none."""
        try:
            data = json.loads(self._error_file(worker).read_text())
            return ": " + str(data["message"]["message"]).splitlines()[0][:300]
        except (OSError, ValueError, KeyError, TypeError):
            return ""

    def _stop_workers(self, signum: int) -> None:
        """`signum` to the running workers, then SIGKILL to those still there after the
        shutdown timeout (at once when `signum` is SIGKILL)."""
        for worker in self._running():
            self.workers[worker].send_signal(signum)
        deadline = time.monotonic() + (0 if signum == signal.SIGKILL else self.shutdown_timeout_s)
        for proc in self.workers.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _leave(self, signum: int = signal.SIGKILL) -> int:
        self._stop_workers(signum)
        self._reap()
        # Its keys (node, workers, and the leadership if it led) go now: the others plan
        # without this node, and a new leader is elected, at once rather than in a TTL.
        self.client.revoke(self.lease)
        return 1

    # --------------------------------------------------------------- leader
    def _lead(self) -> None:
        if not self._leading():
            return
        if not self._settled():
            return
        try:
            if self.controller.plan is None:  # waiting for the first epoch's nodes
                if not self.controller.resume():
                    self._start_job()
                return
            self.controller.poll(self._alive_now, self._kill)
        except StepDown as err:
            self.log(str(err))
            self.controller = None

    def _start_job(self) -> None:
        """Publish epoch 0 once `min_nodes` whole nodes (every worker up) are alive, and
        `max_nodes` or `last_call_s` after `min_nodes` were; fail the job when fewer than
        `min_nodes` came within `join_timeout_s` (torchrun's rendezvous, over the nodes'
        registrations)."""
        alive = self._alive_now()
        per_node = Counter(node for node, _ in alive)
        nodes = [node for node, count in per_node.items() if count == self.nproc]
        now = time.monotonic()
        if len(nodes) < self.min_nodes:
            if now - self._started_at > self.join_timeout_s:
                reason = (f"{len(nodes)} of the {self.min_nodes} nodes --nnodes asks for came within "
                          f"join_timeout={self.join_timeout_s:g} s; start the missing nodes (same --rdzv-id), "
                          "or lower --nnodes' minimum")
                self.log(f"the job cannot start: {reason}")
                self.store.set(keys.DONE, f"{keys.JOB_FAILED}{reason}")
            return
        if self._min_reached_at is None:
            self._min_reached_at = now
            if self.last_call_s > 0 and (self.max_nodes is None or len(nodes) < self.max_nodes):
                self.log(f"{len(nodes)} nodes are here; waiting up to {self.last_call_s:g} s (last_call_timeout) "
                         f"for more{f', up to {self.max_nodes}' if self.max_nodes else ''}")
        if (self.max_nodes is None or len(nodes) < self.max_nodes) and now - self._min_reached_at < self.last_call_s:
            return
        self.controller.start(sorted(w for w in alive if w[0] in nodes))
        self.log(f"epoch 0 published for {len(nodes)} nodes")

    def _leading(self) -> bool:
        """Campaign for `leader` (a create-if-absent under this agent's lease), or check
        that this agent still holds it: a lease that expired while etcd was away may
        have handed it to another agent."""
        won = self.client.put_if_absent(self.prefix + keys.LEADER, self.node.encode(), lease=self.lease)
        holder = self.node.encode() if won else self.client.get(self.prefix + keys.LEADER)[0]
        if holder != self.node.encode():
            if self.controller is not None:
                self.log(f"{holder.decode() if holder else 'nobody'} leads the job now; following")
                self.controller = None
            return False
        if self.controller is None:
            self.log("leading the job")
            self.controller = self._new_controller()
        return True

    def _settled(self) -> bool:
        """False for a lease period (and a margin) after an etcd outage ended: every agent
        renews its lease or registers again meanwhile, so that the leader never takes a
        worker whose key has not come back yet for a dead one."""
        back_at = self.client.back_at
        if back_at is None:
            return True
        wait = back_at + self.lease_ttl_s + 2 - time.monotonic()
        if wait <= 0:
            return True
        if self._said_settling != back_at:
            self._said_settling = back_at
            self.log(f"etcd is back; the leader waits {wait:.0f} s for every node to renew its "
                     "membership before acting on it")
        return False

    def _new_controller(self) -> Controller:
        costs = cost_model(self.cfg, hardware_name=self.hardware, gpus_per_node=self.nproc)
        return Controller(
            self.store, build_planner(self.cfg, costs), total_steps=self.cfg.train.steps,
            gpus_per_node=self.nproc, status_timeout_s=status_timeout_s(self.cfg.comm),
            log=lambda message: self.log(message), interrupted=lambda: self._signal is not None,
            leading=self._still_leading, node=self.node, unreachable=self._unreachable_views,
            notices=self._posted_notices, max_nodes=self.max_nodes,
            checkpoints=CheckpointPolicy(self.cfg.checkpoint_dir, self.cfg.checkpoint.every,
                                         self.cfg.checkpoint.keep))

    def _still_leading(self) -> bool:
        """This agent's lease still exists and the leader key is still its own: asked by
        its controller before acting, since a node cut off for longer than its lease's TTL
        may have a successor already."""
        lease = self.lease
        try:
            alive = self.client.refresh(lease)
        except LeaseExpired:
            alive = False
        if not alive:
            self._lost(lease)
            return False
        return self.client.get(self.prefix + keys.LEADER)[0] == self.node.encode()

    def _alive_now(self) -> set[Worker]:
        """Workers under `alive/`, less those of nodes whose agent this node's probe found
        gone (a refused connection: seen a second after the node died, its lease expires
        seconds later; `planaria.elastic.peer_probe` says why this is safe), and less this
        node's own workers that exited. Their keys go when the loop reaps them, but the
        loop is the leader's controller while it collects an epoch's statuses: a worker
        of the leader's own node that exited then was waited for until the status
        timeout (minutes), the whole job with it."""
        gone = set(self.probe.gone) if self.probe is not None else set()
        exited = {w for w, proc in self.workers.items() if proc.poll() is not None}
        return {w for w in map(parse_worker_key, self.client.keys_with_prefix(self.prefix + keys.ALIVE))
                if w[0] not in gone and w not in exited}

    def _kill(self, worker: Worker) -> None:
        self.store.set(f"kill/{worker_key(worker)}", "1")


def node_range(text: str) -> tuple[int, int | None]:
    """`--nnodes`: "N" (at least N, no maximum) or "MIN:MAX", as torchrun writes it."""
    try:
        low, _, high = text.partition(":")
        bounds = int(low), int(high) if high else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN:MAX (numbers of nodes)") from None
    if bounds[0] < 1 or (bounds[1] is not None and bounds[1] < bounds[0]):
        raise argparse.ArgumentTypeError(f"{text!r}: MIN must be at least 1 and MAX at least MIN")
    return bounds


def parse_signals(names: str) -> list[signal.Signals]:
    """torchrun's --signals-to-handle: comma-separated names, such as SIGTERM,SIGUSR1."""
    found = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        try:
            found.append(signal.Signals[name])
        except KeyError:
            raise ValueError(f"unknown signal {name!r} in --signals-to-handle; give names such as "
                             f"SIGTERM,SIGUSR1") from None
    return found


def _metrics_port(text: str) -> int:
    try:
        return port_number(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planaria.elastic.agent",
                                     description="Run one node's agent of an elastic Planaria job.")
    parser.add_argument("--node", required=True, help="this node's name, unique in the job")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--etcd", required=True, help="etcd endpoint host:port")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--nnodes", type=node_range, required=True, metavar="MIN[:MAX]",
                        help="nodes to wait for before epoch 0; the most a plan uses (beyond it, nodes wait "
                             "as spares and replace failed ones; default: no maximum)")
    parser.add_argument("--join-timeout", type=float, default=600.0,
                        help="seconds for MIN nodes to come before the job fails (default 600, torchrun's)")
    parser.add_argument("--last-call-timeout", type=float, default=0.0,
                        help="seconds to wait for more nodes, up to MAX, once MIN are here (default 0: "
                             "start at once; later nodes join at a step boundary)")
    parser.add_argument("--monitor-interval", type=float, default=POLL_S,
                        help=f"seconds between looks at the workers and the job (default {POLL_S})")
    parser.add_argument("--lease-ttl", type=int, default=5, help="seconds (default 5)")
    parser.add_argument("--hardware", default="h100", help="cost model preset for the planner")
    parser.add_argument("--etcd-retry", type=float, default=30.0,
                        help="seconds to retry an unreachable etcd while starting (default 30)")
    parser.add_argument("--etcd-outage-limit", type=float, default=0.0,
                        help="seconds a running job waits for etcd to come back before this agent "
                             "gives up and stops its workers (default 0: as long as it takes)")
    parser.add_argument("--etcd-ca-cert", default=None, help="CA certificate (PEM) for TLS to etcd")
    parser.add_argument("--etcd-cert", default=None, help="client certificate (PEM) for TLS to etcd")
    parser.add_argument("--etcd-key", default=None, help="client key (PEM) for TLS to etcd")
    parser.add_argument("--etcd-user", default=None,
                        help="etcd user name; the password is read from PLANARIA_ETCD_PASSWORD")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="times this node's workers are started again after one of them dies, "
                             "rejoining the job as new capacity (default 0: the node leaves)")
    parser.add_argument("--signals-to-handle", default=DEFAULT_SIGNALS,
                        help=f"signals that stop this node's workers and take the node out (default {DEFAULT_SIGNALS})")
    parser.add_argument("--shutdown-timeout", type=float,
                        default=float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30)),
                        help="seconds stopped workers get before SIGKILL (default 30, or "
                             "TORCH_ELASTIC_SHUTDOWN_TIMEOUT)")
    parser.add_argument("--preemption-notice", choices=SOURCES,
                        default=os.environ.get("PLANARIA_PREEMPTION_NOTICE", "signal"),
                        help="where this node learns that it will be preempted: signal (the signals of "
                             "--preemption-signals, as Kubernetes and Slurm send them), aws, gcp or azure "
                             "(the cloud's instance metadata); the node then leaves at a step boundary and "
                             "hands its layers over (default signal, or PLANARIA_PREEMPTION_NOTICE)")
    parser.add_argument("--preemption-grace", type=float,
                        default=float(os.environ.get("PLANARIA_PREEMPTION_GRACE", 30)),
                        help="seconds between a notice signal and the node's end (the scheduler's grace "
                             "period: Kubernetes' terminationGracePeriodSeconds, Slurm's --signal); 0: the "
                             "signal stops the node at once (default 30, or PLANARIA_PREEMPTION_GRACE)")
    parser.add_argument("--preemption-signals", default=os.environ.get("PLANARIA_PREEMPTION_SIGNALS", "SIGTERM"),
                        help="the signals read as a notice under --preemption-notice signal; a second one "
                             "stops the node at once (default SIGTERM)")
    parser.add_argument("--preemption-endpoint", default=os.environ.get("PLANARIA_PREEMPTION_ENDPOINT"),
                        help="the cloud's metadata address (default: the cloud's documented one)")
    parser.add_argument("--local-addr", default=None,
                        help="the address other nodes reach this one at (default: that of "
                             "GLOO_SOCKET_IFNAME's interface, else this host's route to etcd)")
    parser.add_argument("--metrics-port", type=_metrics_port, default=os.environ.get(PORT_ENV, "0"),
                        help="serve Prometheus metrics on this port, at the --local-addr address "
                             f"(docs/monitoring.md; default 0: off, or {PORT_ENV})")
    parser.add_argument("--log-dir", default=None,
                        help="write each worker's output to DIR/<node>.<local>.log (default: this output)")
    parser.add_argument("--run-log-dir", default=None,
                        help="torchrun's --log-dir layout: DIR/attempt_<n>/<local rank>/{stdout,stderr}.log and "
                             "error.json (DIR: <log dir>/<run id>_<random>, shared by a machine's agents)")
    parser.add_argument("--redirects", default="0", help="torchrun's -r, with --run-log-dir (default 0)")
    parser.add_argument("--tee", default="0", help="torchrun's -t, with --run-log-dir (default 0)")
    parser.add_argument("--local-ranks-filter", default="", help="torchrun's, with --run-log-dir")
    parser.add_argument("--local-rank-offset", type=int, default=0,
                        help="the machine-wide local rank of this node's first worker (default 0)")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args(argv)
    try:
        given = {"ca_cert": args.etcd_ca_cert, "cert_cert": args.etcd_cert,
                 "cert_key": args.etcd_key, "user": args.etcd_user}
        from_env = EtcdSettings.from_env(args.etcd)
        settings = EtcdSettings(endpoint=args.etcd, retry_s=args.etcd_retry, **{
            name: value if value is not None else getattr(from_env, name) for name, value in given.items()},
            password=from_env.password)
        output = None
        if args.run_log_dir:
            std_of(args.redirects, 0), std_of(args.tee, 0)  # refuse a malformed choice now
            output = OutputSpec(Path(args.run_log_dir), args.redirects, args.tee,
                                ranks_filter(args.local_ranks_filter), args.local_rank_offset)
        agent = Agent(node=args.node, nproc=args.nproc_per_node, settings=settings,
                      run_id=args.run_id, min_nodes=args.nnodes[0], max_nodes=args.nnodes[1],
                      join_timeout_s=args.join_timeout, last_call_s=args.last_call_timeout,
                      monitor_interval_s=args.monitor_interval, output=output, config=args.config,
                      overrides=args.overrides, lease_ttl_s=args.lease_ttl, hardware=args.hardware,
                      log_dir=args.log_dir, outage_limit_s=args.etcd_outage_limit or math.inf,
                      max_restarts=args.max_restarts, signals=args.signals_to_handle,
                      shutdown_timeout_s=args.shutdown_timeout, local_addr=args.local_addr,
                      preemption=args.preemption_notice, preemption_grace_s=args.preemption_grace,
                      preemption_endpoint=args.preemption_endpoint, notice_signals=args.preemption_signals,
                      metrics_port=args.metrics_port)
        return agent.run()
    except (EtcdUnavailable, ConfigError, ValueError) as err:
        print(f"planaria agent {args.node}: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
