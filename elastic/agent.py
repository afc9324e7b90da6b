"""One agent per node: membership under an etcd lease, the node's workers, and, on the
agent that holds the leadership, the controller (docs/control_plane.md).

    python -m planaria.elastic.agent --node NAME --nproc-per-node G --etcd HOST:PORT \\
        --run-id JOB --nnodes MIN [--lease-ttl S] -- CONFIG.yaml [section.key=value ...]

The agent is one loop (`Agent.run`: a look at the node and the job every
`--monitor-interval`) over parts that each own one concern, and hold their own keys
under /planaria/<run-id>/:

- `node_membership.Membership`: the lease, the node's registration under it
  (`nodes/<node>`), its renewal and its loss, and the campaign for `leader`;
- `worker_supervisor.WorkerSupervisor`: the node's workers (`alive/<node>.<local>`),
  their restarts, their output and error files, frozen workers, the leader's
  `kill/<node>.<local>` requests;
- `preemption_notices.PreemptionNotices`: this node's preemption notice
  (`notice/<node>`), posted for the leader and served;
- `peer_probe.PeerProbe`: the nodes this one reaches, published here (`probe/<node>`,
  `unreachable/<node>`);
- `node_relay.NodeRelay`: the job's store, served to the node's workers (one record read,
  one set of watches, writes committed together for the whole node; `--no-node-relay`:
  each worker reaches etcd itself);
- `agent_options`: the command line.

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
under a new name (`WorkerSupervisor.restart`). The signals of `--signals-to-handle`
(torchrun's default: SIGTERM, SIGINT, SIGHUP, SIGQUIT) stop the node's workers (the
same signal, then SIGKILL after `--shutdown-timeout`, 30 s), take the node out (the
leader recovers in place without it), and exit 128 + the signal's number. Workers die
with their agent: a killed agent takes its node out, as a dead machine would.

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
period to renew (`Membership.settled`), so that a returning etcd causes no reconfiguration.

With `--metrics-port PORT` (PLANARIA_METRICS_PORT) the agent serves the job's and its
node's metrics to Prometheus on its node's address (`planaria.elastic.metrics`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from planaria.elastic.agent_options import (DEFAULT_SIGNALS, POLL_S, agent_parser, etcd_settings, output_spec,
                                            parse_signals)
from planaria.elastic.controller import Controller
from planaria.elastic.controller_errors import StepDown
from planaria.elastic.etcd_client import EtcdClient, EtcdSettings, EtcdUnavailable, LeaseExpired
from planaria.elastic.etcd_kv import EtcdKeyValue
from planaria.elastic.job_checkpoints import CheckpointPolicy
from planaria.elastic.metrics import MetricsServer, serve as serve_metrics
from planaria.elastic.node_membership import Membership, NodeNameTaken
from planaria.elastic.node_relay import NodeRelay
from planaria.elastic.peer_probe import PeerProbe, node_address
from planaria.elastic.preemption import make_watcher
from planaria.elastic.preemption_notices import PreemptionNotices
from planaria.elastic.worker_output import OutputSpec
from planaria.elastic.worker_supervisor import WorkerSupervisor
from planaria.runtime.config.loading import load_config
from planaria.runtime.config.sections import ConfigError, status_timeout_s
from planaria.runtime.contract import keys
from planaria.runtime.contract.keys import parse_worker_key
from planaria.runtime.contract.membership import JobSpec
from planaria.runtime.planning.job_plans import build_planner, cost_model
from planaria.templates.plan import Worker


def _probe_addresses(items: dict[str, bytes]) -> dict[str, str]:
    """{node: "host:port"} from the keys under `probe/`."""
    return {key[len(keys.PROBE):]: value.decode() for key, value in items.items()}


class Agent:
    """One node's agent: its loop, and the parts it holds (the module docstring lists them)."""

    def __init__(self, *, node: str, nproc: int, settings: EtcdSettings, run_id: str, min_nodes: int,
                 config: str, overrides: list[str], lease_ttl_s: int = 5, hardware: str = "h100",
                 log_dir: Path | None = None, outage_limit_s: float = math.inf, max_restarts: int = 0,
                 signals: str = DEFAULT_SIGNALS, shutdown_timeout_s: float = 30.0, metrics_port: int = 0,
                 local_addr: str | None = None, preemption: str = "signal", preemption_grace_s: float = 30.0,
                 preemption_endpoint: str | None = None, notice_signals: str = "SIGTERM",
                 max_nodes: int | None = None, join_timeout_s: float = 600.0, last_call_s: float = 0.0,
                 monitor_interval_s: float = POLL_S, output: OutputSpec | None = None,
                 client: EtcdClient | None = None, node_relay: bool = True):
        """`client`: how this agent reaches etcd; None: a client of its own, from `settings`
        (the scale harness, `planaria.chaos.scale`, gives one that it can cut off)."""
        self.node, self.nproc, self.min_nodes = node, nproc, min_nodes
        self.max_nodes = max_nodes
        """The most nodes a plan uses; the others wait as spares (`Spares.max_nodes`)."""
        self.join_timeout_s, self.last_call_s = join_timeout_s, last_call_s
        """torchrun's rendezvous timeouts: epoch 0 is given up (the job fails) when fewer than
        `min_nodes` nodes came within `join_timeout_s`; once `min_nodes` are there, it waits
        `last_call_s` more for nodes up to `max_nodes` (0: it starts at once, and later nodes
        join at a step boundary)."""
        self.monitor_interval_s = monitor_interval_s
        """How often the agent looks at its workers and the job (torchrun's --monitor-interval)."""
        self._started_at = time.monotonic()
        self._min_reached_at: float | None = None
        self.run_id = run_id
        self.signals = parse_signals(signals)
        watcher = make_watcher(preemption, preemption_endpoint, log=self.log)
        notice_signums = parse_signals(notice_signals) if preemption == "signal" and preemption_grace_s > 0 else []
        # A request that hangs (an etcd member cut off from the others still accepts
        # connections, but serves nothing) must give up, and fail over to another member,
        # well within the lease's TTL: a third of it, as often as the lease is renewed.
        settings = dataclasses.replace(settings, timeout_s=min(settings.timeout_s, max(1.0, lease_ttl_s / 3)))
        self.settings = settings
        self.client = client or EtcdClient(settings, on_outage=self.log)
        self.outage_limit_s = outage_limit_s
        self.prefix = keys.run_prefix(run_id)
        self.store = EtcdKeyValue(self.client, self.prefix)
        self.store_url = f"etcd://{settings.endpoint}{self.prefix.rstrip('/')}"
        self.config, self.overrides = config, overrides
        self.cfg = load_config(config, overrides)
        self.notices = PreemptionNotices(self.client, self.prefix, store=self.store, watcher=watcher,
                                         grace_s=preemption_grace_s,
                                         signals=notice_signums, log=self.log)
        self.membership = Membership(self.client, self.prefix, node=node, nproc=nproc, run_id=run_id,
                                     leader_view=lambda: self.store.get_if_present(keys.LEADER),
                                     ttl_s=lease_ttl_s, log=self.log)
        self.supervisor = WorkerSupervisor(
            node=node, nproc=nproc, store=self.store, lease=lambda: self.membership.lease, store_url=self.store_url,
            etcd_env=settings.to_env(), run_id=run_id, config=config, overrides=overrides, comm=self.cfg.comm,
            max_restarts=max_restarts, shutdown_timeout_s=shutdown_timeout_s, log_dir=log_dir, output=output,
            log=self.log)
        self.hardware = hardware
        self.node_relay = node_relay
        self.relay: NodeRelay | None = None
        """The node's relay, serving the job's store to its workers (`_start_relay`)."""
        self.controller: Controller | None = None
        self._stop = threading.Event()
        self._signal: int | None = None
        self.local_addr = local_addr
        self.probe: PeerProbe | None = None
        """This node's reachability probe of the others (made in `run`)."""
        self.metrics_port = metrics_port
        self.metrics: MetricsServer | None = None
        """The Prometheus endpoint (`--metrics-port`, `planaria.elastic.metrics`); None: off."""
        self._published_view: list[str] | None = None
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
        self.supervisor.node_address = address  # where this node's workers host an epoch's bootstrap store
        try:
            self._register()
        except NodeNameTaken as err:
            self.log(str(err))
            return 2
        # Renewed from now on: what comes before the workers start (the mirrors' reads and
        # watches, the relay) may take longer than the lease's TTL on a slow etcd.
        threading.Thread(target=self.membership.keep_alive, args=(self._stop, lambda: self._signal is not None),
                         daemon=True, name="lease").start()
        self._follow_job()
        self._start_relay()
        if self.notices.watcher is not None:
            threading.Thread(target=self.notices.watch, args=(self._stop,), daemon=True, name="preemption").start()
        for signum in {*self.signals, *self.notices.signals}:
            signal.signal(signum, self._on_signal)
        self.supervisor.start()
        self.client.retry_s = self.outage_limit_s  # from now on, etcd outages are waited out
        try:
            return self._loop()
        finally:
            self._stop.set()
            self.probe.stop()
            if self.metrics is not None:
                self.metrics.stop()
            self.supervisor.finish_tails()
            if self.relay is not None:
                self.relay.close()

    def _start_relay(self, loop=None) -> None:
        """Serve the job's store to this node's workers: they reach etcd through it
        (`planaria.elastic.node_relay`), with the URL it gives them in PLANARIA_STORE."""
        if self.node_relay:
            self.relay = NodeRelay(self.store, loop=loop).start()
            self.supervisor.store_url = self.relay.url
            self.log(f"serving the job's store to this node's workers on {self.relay.host}:{self.relay.port}")

    def _follow_job(self) -> None:
        """The keys this agent asks about at every look, mirrored by watches from now on
        (`EtcdKeyValue.follow`): its looks cost etcd no request while nothing changes."""
        for key in (keys.LEADER, keys.DONE):
            self.store.follow(key)
        for prefix in (keys.kill_requests_of(self.node), keys.PROBE):
            self.store.follow(prefix, prefix=True)

    LEADER_PREFIXES = (keys.ALIVE, keys.UNREACHABLE, keys.NOTICE, "ready/", keys.MEMBERS)
    """What the leader's controller reads at every poll, mirrored while it leads."""

    def _follow_as_leader(self, leading: bool) -> None:
        for prefix in self.LEADER_PREFIXES:
            if leading:
                self.store.follow(prefix, prefix=True)
            else:
                self.store.unfollow(prefix)

    def _loop(self) -> int:
        """Look at the node and the job every monitor interval until the agent's exit code."""
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
                self.membership.mark_lost(self.membership.lease)
                continue
            if outcome is not None:
                return outcome
            time.sleep(self.monitor_interval_s)

    def _serve_metrics(self, address: str) -> MetricsServer | None:
        """The Prometheus endpoint on this node's address (where the other nodes reach it,
        so a scraper on their network does too); None without --metrics-port."""
        if not self.metrics_port:
            return None
        server = serve_metrics(self.settings, self.run_id, address, self.metrics_port,
                               node=lambda: (self.node, self.supervisor.member),
                               live_workers=self.supervisor.live_workers, log=self.log)
        self.log(f"metrics on {server.endpoint}")
        return server

    def _tick(self) -> int | None:
        """One look at the node and the job; the agent's exit code once it is over."""
        if self.membership.lost.is_set():
            self.log("this node's lease expired while etcd was away; registering again")
            try:
                self._register()
            except NodeNameTaken as err:  # another agent took the name meanwhile
                self.log(f"{err}; this node's workers stop and the node leaves the job")
                self.supervisor.stop(signal.SIGKILL)
                return 1
        self.supervisor.kill_frozen()
        self._publish_reachability()
        if self.notices.pending:
            code = self.notices.serve(self.supervisor.member, self.membership.lease, self.supervisor.running,
                                      self._leave)
            if code is not None:
                return code
        if self.supervisor.reap() and not self.notices.pending:  # a leaving node's exits: `notices.serve`
            # A reset first: it is not one of the user's --max-restarts, even while some are left.
            reset = self._signal is None and self.supervisor.reset_asked()
            if reset or (self._signal is None and self.supervisor.restarts < self.supervisor.max_restarts):
                self.supervisor.restart(reset)
                return None
            self.log("a worker of this node exited; the node leaves the job")
            return self._leave()
        self.supervisor.serve_kill_requests()
        self._lead()
        if self.store.check([keys.DONE]) and not self.supervisor.running():
            outcome = self.store.get(keys.DONE).decode()
            self.log(f"job ended: {outcome}")
            return 0 if outcome == "ok" else 1
        return None

    def _on_signal(self, signum, frame) -> None:
        if self.notices.on_signal(signum):
            return  # a notice, not a stop (`PreemptionNotices.serve`); the same signal again stops the node
        self._signal = signum  # acted on by the main loop, between two looks at etcd
        self.client.abort.set()  # a look that waits for an absent etcd gives up

    def _stop_on_signal(self, signum: int) -> int:
        """Stop the workers with the signal, take the node out, exit 128 + its number."""
        self.log(f"{signal.Signals(signum).name}: stopping this node's workers; the node leaves the job")
        self.supervisor.stop(signum)
        self.client.abort.clear()
        self.client.retry_s = 5.0
        try:
            self._leave(signal.SIGKILL)
        except EtcdUnavailable:
            self.log("etcd did not answer; this node's keys go when its lease expires")
        return 128 + signum

    def _leave(self, signum: int = signal.SIGKILL) -> int:
        self.supervisor.stop(signum)
        self.supervisor.reap()
        # Its keys (node, workers, and the leadership if it led) go now: the others plan
        # without this node, and a new leader is elected, at once rather than in a TTL.
        self.client.revoke(self.membership.lease)
        return 1

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
        """This node's lease and its registration (`Membership.register`), then every other
        key bound to the lease, again after one expired: the live workers', the notice's
        (posted again at the next look) and the probe's."""
        self.membership.register()
        self.supervisor.put_alive_keys()
        self.notices.post_again()
        if self.probe is not None:
            self.client.put(self.prefix + keys.PROBE + self.node, self.probe.address.encode(),
                            lease=self.membership.lease)
            self._published_view = None  # written again under the new lease

    # --------------------------------------------------------- reachability
    def _probe_addresses(self) -> dict[str, str]:
        """Every node's probe listener, parsed once per change of `probe/` (a thousand
        nodes' addresses read every 2 s by every agent were a thousand items each time)."""
        return self.store.derived(keys.PROBE, _probe_addresses)

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
        self.client.put(self.prefix + keys.UNREACHABLE + self.node, json.dumps(view).encode(),
                        lease=self.membership.lease)
        if view or self._published_view:
            self.log(f"cannot reach {view}" if view else "reaches every node again")
        self._published_view = view

    def _unreachable_views(self) -> dict[str, list[str]]:
        """{node: the nodes it cannot reach}, as the nodes published them (parsed once per
        change of `unreachable/`, which the leader mirrors: it asks at every poll), this
        node's own as its probe sees it now (the leader's agent publishes nothing while
        its controller waits)."""
        views = self.store.derived(keys.UNREACHABLE, _parse_views)
        return {**views, self.node: list(self.probe.unreachable)}

    # --------------------------------------------------------------- leader
    def _lead(self) -> None:
        if not self._leading():
            return
        if not self.membership.settled():
            return
        try:
            # Waiting for the first epoch's nodes; unless epoch 0 could not be published
            # (the job ended then, and `poll` says so).
            if self.controller.plan is None and self.controller.outcome is None:
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
        if self.controller.outcome is None:
            self.log(f"epoch 0 published for {len(nodes)} nodes")

    def _leading(self) -> bool:
        """Campaign for `leader` (`Membership.campaign`): a controller while this agent
        leads, none once another does."""
        holder = self.membership.campaign()
        if holder != self.node:
            if self.controller is not None:
                self.log(f"{holder or 'nobody'} leads the job now; following")
                self.controller = None
                self._follow_as_leader(False)
            return False
        if self.controller is None:
            self.log("leading the job")
            self._follow_as_leader(True)
            self.controller = self._new_controller()
        return True

    def _new_controller(self) -> Controller:
        costs = cost_model(self.cfg, hardware_name=self.hardware, gpus_per_node=self.nproc)
        return Controller(
            self.store, build_planner(self.cfg, costs), total_steps=self.cfg.train.steps,
            gpus_per_node=self.nproc, status_timeout_s=status_timeout_s(self.cfg.comm),
            log=lambda message: self.log(message), interrupted=lambda: self._signal is not None,
            leading=self.membership.still_leading, node=self.node, unreachable=self._unreachable_views,
            notices=self.notices.posted, max_nodes=self.max_nodes, wait_for_nodes_s=self.join_timeout_s,
            gone=self._probed_gone, cut_wait_s=self.cfg.fault_tolerance.cut_wait_s,
            checkpoints=CheckpointPolicy(self.cfg.checkpoint_dir, self.cfg.checkpoint.every,
                                         self.cfg.checkpoint.keep))

    def _probed_gone(self) -> set[str]:
        """The nodes whose agent this node's probe found gone (a refused connection)."""
        return set(self.probe.gone) if self.probe is not None else set()

    def _alive_now(self) -> set[Worker]:
        """Workers under `alive/`, less those of nodes whose agent this node's probe found
        gone (a refused connection: seen a second after the node died, its lease expires
        seconds later; `planaria.elastic.peer_probe` says why this is safe), and less this
        node's own workers that exited. Their keys go when the loop reaps them, but the
        loop is the leader's controller while it collects an epoch's statuses: a worker
        of the leader's own node that exited then was waited for until the status
        timeout (minutes), the whole job with it."""
        gone = self._probed_gone()
        exited = self.supervisor.exited()
        alive = self.store.derived(keys.ALIVE, _alive_workers)  # parsed once per change of `alive/`
        if not gone and not exited:
            return set(alive)
        return {w for w in alive if w[0] not in gone and w not in exited}

    def _kill(self, worker: Worker) -> None:
        self.store.set(keys.kill_request(worker), "1")


def _parse_views(found: dict[str, bytes]) -> dict[str, list[str]]:
    """{node: the nodes it reports it cannot reach}, from the `unreachable/<node>` keys in `found`."""
    return {key[len(keys.UNREACHABLE):]: json.loads(value) for key, value in found.items()}


def _alive_workers(found: dict[str, bytes]) -> frozenset[Worker]:
    """The workers whose `alive/<node>.<local>` keys are in `found`."""
    return frozenset(parse_worker_key(key[len(keys.ALIVE):]) for key in found)


def main(argv: list[str] | None = None) -> int:
    args = agent_parser().parse_args(argv)
    try:
        agent = Agent(node=args.node, nproc=args.nproc_per_node, settings=etcd_settings(args),
                      run_id=args.run_id, min_nodes=args.nnodes[0], max_nodes=args.nnodes[1],
                      join_timeout_s=args.join_timeout, last_call_s=args.last_call_timeout,
                      monitor_interval_s=args.monitor_interval, output=output_spec(args), config=args.config,
                      overrides=args.overrides, lease_ttl_s=args.lease_ttl, hardware=args.hardware,
                      log_dir=args.log_dir, outage_limit_s=args.etcd_outage_limit or math.inf,
                      max_restarts=args.max_restarts, signals=args.signals_to_handle,
                      shutdown_timeout_s=args.shutdown_timeout, local_addr=args.local_addr,
                      preemption=args.preemption_notice, preemption_grace_s=args.preemption_grace,
                      preemption_endpoint=args.preemption_endpoint, notice_signals=args.preemption_signals,
                      metrics_port=args.metrics_port, node_relay=args.node_relay)
        return agent.run()
    except (EtcdUnavailable, ConfigError, ValueError) as err:
        print(f"planaria agent {args.node}: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
