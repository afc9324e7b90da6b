"""An agent's Prometheus endpoint: the job as its etcd store shows it, and this node's
part in it, served over HTTP when the agent is given `--metrics-port` (off by default).

    python -m planaria.elastic.agent ... --metrics-port 9400      # then GET http://ADDRESS:9400/metrics
    PLANARIA_METRICS_PORT=9400 planaria-run ...                  # the same, through planaria-run

This module owns the metrics (their names, types, labels and meaning are listed in
docs/monitoring.md), how they are read from the job's keys, and the HTTP endpoint.

What a scrape shows is read from etcd when it is asked for, not kept up by the agent:
the epoch in force (`epoch`), this node's state (as `planaria status` defines it,
`planaria.elastic.status`), the last committed step and the step rate (`progress`),
the reconfigurations by reason (`epoch/<e>/event`), and how long the last recovery from
a failure took (its event's detection time to the new epoch's first committed step,
`epoch/<e>/trained`). Every agent answers every scrape, so a read is kept lean: a few
single keys; the plan of the epoch in force and each reconfiguration's event are read once
and remembered.

A scrape never waits on etcd for long, and never on the agent: reads are made by a
thread of this module's own, through an etcd client of its own (short timeouts, no
waiting out an outage), which each scrape asks for a fresh reading. A scrape waits at
most `SCRAPE_WAIT_S` for it; if etcd has not answered by then it gets the last reading
with `planaria_etcd_reachable 0`. The agent's loop shares nothing with it but two
read-only callables (this node's name and its live workers).
"""
from __future__ import annotations

import dataclasses
import errno
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import get_args

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from planaria.elastic.etcd_client import EtcdClient, EtcdSettings, EtcdUnavailable
from planaria.runtime.contract import keys
from planaria.runtime.contract.epochs import EpochEvent, EpochRecord, Progress, Reason
from planaria.runtime.contract.membership import Waiting

PORT_ENV = "PLANARIA_METRICS_PORT"
"""`planaria-run`'s way to ask for metrics (its command line is torchrun's): the port of
its first agent; with `--standalone`, agent i serves on PORT + i."""
SCRAPE_WAIT_S = 1.0
"""The longest a scrape waits for etcd before it answers with what it had."""
FRESH_S = 1.0
"""A reading this recent is served again rather than read anew (several scrapers)."""
READ_TIMEOUT_S = 2.0
"""One etcd request of the reader; it is given up after this (a hung member)."""
READ_RETRY_S = 0.5
"""Transient errors are retried this long: a blip is not an outage, but an outage is
reported, not waited out (the agent's own client waits it out)."""
STATES = ("training", "joining", "spare", "leaving", "gone")
"""A node's states, as `planaria status` names them (`planaria.elastic.status`)."""
REASONS: tuple[str, ...] = get_args(Reason)
"""Why an epoch began (`EpochEvent.reason`); a recovery is a reconfiguration for a failure."""


def port_number(text: str) -> int:
    """`--metrics-port` or PLANARIA_METRICS_PORT: a TCP port, or 0 (no metrics)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"metrics port {text!r} (--metrics-port, or {PORT_ENV}): give a TCP port number "
                         "(1-65535), or 0 for no metrics")
    return port


def agent_port_env(environ, agents: int) -> list[dict[str, str]]:
    """Each of `planaria-run`'s agents' PLANARIA_METRICS_PORT: the given port plus the
    agent's index (several agents on one machine cannot share a port); nothing when unset
    or 0. A bad value raises ValueError, before any agent starts."""
    base = port_number(environ.get(PORT_ENV) or "0")
    if not base:
        return [{} for _ in range(agents)]
    if base + agents - 1 > 65535:
        raise ValueError(f"{PORT_ENV}={base}: its {agents} agents need ports {base} to {base + agents - 1}; "
                         "give a lower port")
    return [{PORT_ENV: str(base + i)} for i in range(agents)]


def node_state(*, registered: bool, in_plan: bool, spare: bool, noticed: bool) -> str:
    """One of `STATES`, by the rules of `planaria status` (`planaria.elastic.status`)."""
    if not registered:
        return "gone"
    if noticed:
        return "leaving"
    return "training" if in_plan else "spare" if spare else "joining"


@dataclass(frozen=True)
class Reading:
    """What the store said at one read; None where it said nothing (yet)."""

    reachable: bool = False
    epoch: int | None = None
    state: str | None = None
    committed_step: int | None = None
    committed_at_s: float | None = None
    """When that step was committed (wall clock)."""
    steps_per_s: float | None = None
    reconfigurations: dict[str, int] | None = None
    """By reason (`REASONS`); None until the store was read once."""
    last_recovery_s: float | None = None
    waiting_for_nodes: int | None = None
    """While the job, below one replica's nodes, waits for nodes: how many more (`node_wait`)."""
    error: str | None = None
    """Why the last read failed, when it did."""


@dataclass
class _Seen:
    """What the reader remembers between reads: records that never change once written."""

    plan_nodes: tuple[int, frozenset[str]] = (-1, frozenset())
    """(epoch, the nodes of its plan)."""
    reasons: dict[int, str | None] = field(default_factory=dict)
    """Epoch -> its event's reason; None: no event will come (its leader died first)."""
    failures: dict[int, float] = field(default_factory=dict)
    """Epochs that recovered from a failure -> when the controller detected it."""
    recovery: tuple[int, float] | None = None
    """(epoch, seconds) of the newest recovery that has trained a step."""


class JobReader:
    """Reads a `Reading` for one node of the job (module docstring); not thread-safe: one
    thread reads (`MetricsCollector`'s)."""

    def __init__(self, client: EtcdClient, run_id: str):
        self.client, self.prefix = client, keys.run_prefix(run_id)
        self._seen = _Seen()
        self.last = Reading()

    def read(self, node: str, member: str) -> Reading:
        """`node`: the agent's registration; `member`: its workers' node name in plans (the
        node's, or `<node>~<restart>` once its workers were started again)."""
        try:
            self.last = self._read(node, member)
        except EtcdUnavailable as err:
            self.last = dataclasses.replace(self.last, reachable=False, error=str(err))
        return self.last

    def _value(self, key: str) -> bytes | None:
        return self.client.get(self.prefix + key)[0]

    def _read(self, node: str, member: str) -> Reading:
        text = self._value(keys.EPOCH)
        epoch = int(text) if text else None
        spares = self._value(keys.SPARES)
        state = node_state(registered=self._value(keys.node_registration(node)) is not None,
                           in_plan=member in self._plan_nodes(epoch),
                           spare=spares is not None and member in _json_list(spares),
                           noticed=self._value(keys.notice(member)) is not None)
        reading = Reading(reachable=True, epoch=epoch, state=state,
                          reconfigurations=self._reconfigurations(epoch),
                          last_recovery_s=self._last_recovery())
        progress = self._value(keys.PROGRESS)
        if progress:
            p = Progress.from_json(progress)
            reading = dataclasses.replace(reading, committed_step=p.step, committed_at_s=p.time_s,
                                          steps_per_s=1 / p.step_s if p.step_s > 0 else None)
        waiting = self._value(keys.WAITING)
        if waiting:
            w = Waiting.from_json(waiting)
            reading = dataclasses.replace(reading, waiting_for_nodes=w.needs - w.nodes)
        return reading

    def _plan_nodes(self, epoch: int | None) -> frozenset[str]:
        if epoch is None:
            return frozenset()
        if self._seen.plan_nodes[0] != epoch:  # an epoch's record is final once `epoch` names it
            record = EpochRecord.from_json(self._value(keys.epoch_record(epoch)))
            self._seen.plan_nodes = (epoch, frozenset(record.plan.nodes()))
        return self._seen.plan_nodes[1]

    def _reconfigurations(self, epoch: int | None) -> dict[str, int]:
        """Counts by reason of the events of epochs 1 to `epoch`, each read once. An event
        is written just after its epoch is published: one missing for the newest two
        epochs is asked for again; older, its leader died between the two writes."""
        seen = self._seen.reasons
        for e in range(1, (epoch or 0) + 1):
            if e in seen:
                continue
            text = self._value(keys.epoch_event(e))
            if text is None:
                if e < epoch - 1:
                    seen[e] = None
                continue
            event = EpochEvent.from_json(text)
            seen[e] = event.reason
            if event.reason == "failure":
                self._seen.failures[e] = event.detected_s
        counts = dict.fromkeys(REASONS, 0)
        for reason in seen.values():
            if reason is not None:
                counts[reason] = counts.get(reason, 0) + 1
        return counts

    def _last_recovery(self) -> float | None:
        """Seconds from the newest trained recovery's detection to its first committed
        step (`epoch/<e>/trained` holds when that was); a recovery whose epoch has not
        trained yet (under way, or cut short by another failure) does not count."""
        done = self._seen.recovery
        for e in sorted((e for e in self._seen.failures if done is None or e > done[0]), reverse=True):
            text = self._value(keys.epoch_trained(e))
            try:
                trained_s = float(text) if text else math.nan
            except ValueError:
                trained_s = math.nan
            if trained_s >= self._seen.failures[e]:  # (nan: not trained, or a store without the time)
                self._seen.recovery = done = (e, trained_s - self._seen.failures[e])
                break
        return None if done is None else done[1]


def _json_list(text: bytes) -> list[str]:
    value = json.loads(text)
    return value if isinstance(value, list) else []


class MetricsCollector:
    """A Prometheus collector of the job's metrics, read at scrape time by a thread of its
    own (module docstring). `node()` gives (registration name, name in plans) and
    `live_workers()` this node's running workers: both must return at once."""

    def __init__(self, reader: JobReader, *, run_id: str, node: Callable[[], tuple[str, str]],
                 live_workers: Callable[[], int], log: Callable[[str], None],
                 wait_s: float = SCRAPE_WAIT_S, fresh_s: float = FRESH_S):
        self.reader, self.run_id, self.node, self.live_workers, self.log = reader, run_id, node, live_workers, log
        self.wait_s, self.fresh_s = wait_s, fresh_s
        self._changed = threading.Condition()
        self._reading = Reading()
        self._read_at = -math.inf
        """time.monotonic() when the newest reading was started."""
        self._asked = threading.Event()
        self._stopped = threading.Event()
        self._said: str | None = None
        self._thread = threading.Thread(target=self._read_when_asked, daemon=True, name="metrics-reader")
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._asked.set()

    def _read_when_asked(self) -> None:
        while True:
            self._asked.wait()
            if self._stopped.is_set():
                self.reader.client.close()
                return
            self._asked.clear()
            started = time.monotonic()
            try:
                reading = self.reader.read(*self.node())
            except Exception as err:  # noqa: BLE001 - a dead reader would blank every scrape
                # for good: a record it cannot read is reported, and asked for again next time
                reading = dataclasses.replace(self._reading, error=f"{type(err).__name__}: {err}")
                if reading.error != self._said:
                    self.log(f"metrics: reading the job's keys failed ({reading.error})")
                self._said = reading.error
            with self._changed:
                self._reading, self._read_at = reading, started
                self._changed.notify_all()

    def _current(self) -> tuple[Reading, bool]:
        """(the freshest reading, whether etcd answered it), waiting at most `wait_s`."""
        with self._changed:
            recent = time.monotonic() - self.fresh_s  # a read started since is fresh enough
            answered = True
            if self._read_at < recent:
                self._asked.set()
                answered = self._changed.wait_for(lambda: self._read_at >= recent, timeout=self.wait_s)
            # No fresh reading within the wait: etcd is slow or away, whatever it said before.
            return self._reading, self._reading.reachable and answered

    def collect(self) -> Iterator[Metric]:
        reading, reachable = self._current()
        member = self.node()[1]
        yield InfoMetricFamily("planaria_agent", "This agent's job (run id) and node (its workers' "
                               "name in plans)", value={"run_id": self.run_id, "node": member})
        yield GaugeMetricFamily("planaria_etcd_reachable", "1 if the job's etcd answered this "
                                "scrape's read, else 0 (the other values are then the last read)",
                                value=1 if reachable else 0)
        yield GaugeMetricFamily("planaria_live_workers", "This node's worker processes that run",
                                value=self.live_workers())
        state = GaugeMetricFamily("planaria_node_state", "1 for this node's state in the job, 0 for "
                                  "the others", labels=["state"])
        for name in STATES:
            state.add_metric([name], 1 if reading.state == name else 0)
        yield state
        yield from _job_families(reading)


def _job_families(reading: Reading) -> Iterator[Metric]:
    """The job's metrics, those the store has said something of."""
    if reading.epoch is not None:
        yield GaugeMetricFamily("planaria_epoch", "The epoch in force (a new one at each "
                                "reconfiguration)", value=reading.epoch)
    if reading.committed_step is not None:
        yield GaugeMetricFamily("planaria_committed_step", "The last committed step (iteration), "
                                "counted from 0", value=reading.committed_step)
        yield GaugeMetricFamily("planaria_last_commit_timestamp_seconds", "When the last committed "
                                "step was committed (Unix time)", value=reading.committed_at_s)
    if reading.steps_per_s is not None:
        yield GaugeMetricFamily("planaria_steps_per_second", "Training steps per second (the "
                                "median of the recent step times)", value=reading.steps_per_s)
    if reading.reconfigurations is not None:
        counter = CounterMetricFamily("planaria_reconfigurations", "Reconfigurations (new epochs) of "
                                      "the job so far, by reason; reason=\"failure\" are recoveries",
                                      labels=["reason"])
        for reason, count in reading.reconfigurations.items():
            counter.add_metric([reason], count)
        yield counter
    yield GaugeMetricFamily("planaria_waiting_for_nodes", "While the job, below one replica's nodes, waits "
                            "for nodes (up to --join-timeout): how many more it needs; 0 otherwise",
                            value=reading.waiting_for_nodes or 0)
    if reading.last_recovery_s is not None:
        yield GaugeMetricFamily("planaria_last_recovery_seconds", "The last recovery from a failure: "
                                "from its detection to the first step committed after it",
                                value=reading.last_recovery_s)


class MetricsPortInUse(ValueError):
    """The metrics port is taken (or the address is not this machine's): a bad setting."""


class MetricsServer:
    """The HTTP endpoint (`/metrics`) on `host:port`, and the collector behind it."""

    def __init__(self, collector: MetricsCollector, host: str, port: int):
        self.collector, self.host = collector, host
        registry = CollectorRegistry(auto_describe=False)  # registering reads nothing
        registry.register(collector)
        try:
            self._server, _ = start_http_server(port, addr=host, registry=registry)
        except OSError as err:
            collector.stop()
            raise MetricsPortInUse(_bind_error(host, port, err)) from None
        self.port = self._server.server_port

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.collector.stop()


def _bind_error(host: str, port: int, err: OSError) -> str:
    if err.errno == errno.EADDRINUSE:
        return (f"--metrics-port {port}: port {port} on {host} is in use (by another agent on this "
                "machine?); give each agent a free port of its own, or 0 for no metrics")
    return (f"--metrics-port {port}: cannot listen on {host}:{port} ({err.strerror or err}); give a free "
            "port (ports below 1024 need root), and with --local-addr an address of this machine")


def serve(settings: EtcdSettings, run_id: str, host: str, port: int, *, node: Callable[[], tuple[str, str]],
          live_workers: Callable[[], int], log: Callable[[str], None]) -> MetricsServer:
    """Serve the job's metrics on `host:port` (the agent's; module docstring), through an
    etcd client of their own. Raises MetricsPortInUse when the port cannot be had."""
    own = dataclasses.replace(settings, timeout_s=READ_TIMEOUT_S, retry_s=READ_RETRY_S)
    client = EtcdClient(own, on_outage=lambda line: None)  # the agent's own client says it
    collector = MetricsCollector(JobReader(client, run_id), run_id=run_id, node=node,
                                 live_workers=live_workers, log=log)
    return MetricsServer(collector, host, port)
