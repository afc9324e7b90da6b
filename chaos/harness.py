"""`planaria chaos`: run a job on a local cluster, inject faults, compare with the same job
without faults, and say plainly whether anything was lost.

The reference is the same job on the same local cluster with no fault (so that its
step time is this machine's, for the ETTR), cached by a hash of the config file, the
overrides and the cluster's shape. The run injects each fault once the job has
committed the fault's step (faults due together fire together), samples the live nodes,
and at the end reads back what the job did (`planaria.chaos.report`). The run (not the
reference) writes its TensorBoard events to `<out>/tensorboard` unless the overrides say
otherwise (docs/training_metrics.md).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from rich.console import Console

from planaria.chaos.cluster import LocalCluster
from planaria.chaos.faults import ETCD_KINDS, NETWORK_KINDS, FaultSpec, FaultSpecError, preemption_grace, validate
from planaria.chaos.plot import plot_report
from planaria.chaos.progress import RunProgress
from planaria.chaos.report import (InjectedFault, Report, build_report, CommitTail, read_commits, read_evals,
                                   step_losses, step_val_losses, write_json_atomically, write_report)
from planaria.chaos.report_tables import format_epoch_event, recovery_notes, recovery_table, verdict_table
from planaria.chaos.sources import (RandomFaults, TraceReplay, find_trace, random_kinds, read_trace,
                                    replay_schedule)
from planaria.runtime.config.loading import load_config
from planaria.runtime.contract import keys
from planaria.runtime.contract.epochs import EpochEvent, EpochTiming
from planaria.runtime.contract.logs import AUDIT, COMMITS, EVALS, log_paths

POLL_S = 0.1


@dataclass
class ChaosSettings:
    config: Path
    overrides: list[str]
    nodes: int
    nproc: int = 1
    faults: list[FaultSpec] = field(default_factory=list)
    seed: int = 0
    etcd_members: int = 1
    out_dir: Path = Path("chaos-out")
    timeout_s: float = 900.0
    reference_cache: Path | None = None
    """Where cached references live; None: $XDG_CACHE_HOME/planaria/chaos-references."""
    random_rate: float | None = None
    """Random faults a minute (`--random`); None: none."""
    random_nodes: tuple[int, int] | None = None
    """Live nodes the random process keeps to (low, high); None: (nodes - 2, nodes), at least 1."""
    random_kinds: tuple[str, ...] | None = None
    random_follow_up: float = 0.0
    """The chance that a random fault comes during the recovery from the last one
    (`RandomFaults.follow_up`)."""
    """Kinds the random process draws; None: every kind that applies."""
    trace: Path | None = None
    """A preemption trace to replay (`--trace`); None: none."""
    time_scale: float = 1.0
    """Trace seconds per second of the run."""
    fresh_reference: bool = False
    """Run the reference again even when a cached one exists (its step time is this
    machine's now)."""
    etcd_restart_s: float = 10.0
    """A killed etcd member is started again this long after (as its supervisor would)."""
    hosts: bool = False
    """Each node and etcd member a host of its own (`--hosts`, `planaria.chaos.hosts`)."""
    notice_s: float | None = None
    """A trace's removals come with this much notice (`--notice`): preemptions announced
    ahead (`preempt-node`) instead of machines that vanish; None: no notice."""
    metrics_port: int = 0
    """Node i's agent serves Prometheus metrics on this port + i (`--metrics-port`); 0: none."""

    def clock_sources(self) -> tuple[RandomFaults | None, TraceReplay | None, int]:
        """(the random process, the trace replay, trace events left out by the node cap),
        checked: a trace replays alone, since its node indices assume nobody else adds nodes."""
        if self.trace is not None and (self.faults or self.random_rate is not None):
            raise FaultSpecError("--trace replays alone: its removals name nodes by the order the "
                                 "trace added them; drop --fault and --random, or drop --trace")
        random_faults = replay = None
        left_out = 0
        if self.random_rate is not None:
            low, high = self.random_nodes or (max(1, self.nodes - 2), self.nodes)
            random_faults = RandomFaults(self.random_rate, self.seed, low=low, high=high,
                                         kinds=self.random_kinds or random_kinds(None, self.etcd_members, self.hosts),
                                         follow_up=self.random_follow_up)
        if self.trace is not None:
            if self.notice_s is not None and self.hosts:
                raise FaultSpecError("--notice announces removals through a local cloud that the simulated "
                                     "hosts cannot reach; drop --notice or --hosts")
            schedule, left_out = replay_schedule(read_trace(self.trace), self.nodes, self.time_scale,
                                                 name=find_trace(self.trace).name, notice_s=self.notice_s)
            replay = TraceReplay(schedule)
        return random_faults, replay, left_out


def run_chaos(settings: ChaosSettings, console: Console) -> Report:
    cfg = load_config(settings.config, settings.overrides)
    validate(settings.faults, steps=cfg.train.steps, nodes=settings.nodes, nproc=settings.nproc,
             etcd_members=settings.etcd_members, hosts=settings.hosts)
    random_faults, replay, left_out = settings.clock_sources()
    out = Path(settings.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reference = reference_run(settings, console)
    console.print(f"[bold]chaos run[/]: {settings.nodes} nodes x {settings.nproc} worker(s), "
                  f"{_describe_faults(settings, replay, left_out)}")
    if replay is not None and replay.duration_s > cfg.train.steps * reference["step_s"]:
        console.print(f"  [yellow]the trace runs {replay.duration_s:.0f} s; the job trains about "
                      f"{cfg.train.steps * reference['step_s']:.0f} s without faults and may end first "
                      f"(raise train.steps or --time-scale to replay all of it)[/]")
    run = _Run(settings, out / "run", console, steps=cfg.train.steps, random_faults=random_faults,
               replay=replay, tensorboard=out / "tensorboard")
    report = run.execute(reference)
    write_report(report, out)
    plot = plot_report(report, out / "report.png")
    console.print(recovery_table(report.recoveries))
    for note in recovery_notes(report.recoveries):
        console.print(f"  {note}")
    console.print(verdict_table(report))
    events = run.tensorboard_dir
    console.print(f"report: {out / 'report.json'}   plot: {plot}" + (f"   tensorboard: {events}" if events else ""))
    if run.interrupted:
        raise RunInterrupted(out / "report.json")
    return report


class ReferenceFailed(RuntimeError):
    """The fault-free reference run did not finish: the job itself is broken."""


class RunInterrupted(KeyboardInterrupt):
    """The run was stopped by the user; `report` holds what it did until then."""

    def __init__(self, report: Path):
        super().__init__(str(report))
        self.report = report


def _describe_faults(settings: ChaosSettings, replay: TraceReplay | None, left_out: int) -> str:
    parts = []
    if settings.faults:
        parts.append(f"{len(settings.faults)} fault(s): {', '.join(map(str, settings.faults))}")
    if settings.random_rate is not None:
        low, high = settings.random_nodes or (max(1, settings.nodes - 2), settings.nodes)
        parts.append(f"random faults, {settings.random_rate:g} a minute (seed {settings.seed}), "
                     f"{low} to {high} live nodes")
    if replay is not None:
        removals = sum(1 for s in replay.pending if s.fault.kind != "add-node")
        notice = "" if settings.notice_s is None else f", each announced {settings.notice_s:g} s ahead"
        parts.append(f"trace {find_trace(settings.trace).name} at {settings.time_scale:g}x: "
                     f"{removals} removal(s){notice} and {len(replay.pending) - removals} addition(s) over "
                     f"{replay.duration_s:.0f} s ({left_out} trace event(s) beyond {settings.nodes} nodes left out)")
    return "; ".join(parts) or "no faults"


# ----------------------------------------------------------------- reference
def _reference_key(settings: ChaosSettings) -> str:
    from importlib.metadata import version

    text = Path(settings.config).read_text()
    shape = json.dumps({"overrides": settings.overrides, "nodes": settings.nodes,
                        "nproc": settings.nproc, "planaria": version("planaria"),
                        "inputs": _input_files_state(settings)}, sort_keys=True)
    return hashlib.sha256((text + shape).encode()).hexdigest()[:16]


def _input_files_state(settings: ChaosSettings) -> list:
    """What the job reads besides its config, as (path, size, mtime) of its files: the data
    (a prepared corpus's manifest, which holds its shards' checksums, or a token file) and
    an init_from checkpoint's files. A corpus prepared again at the same path, or another
    checkpoint there, must not reuse a reference computed on the old one."""
    cfg = load_config(settings.config, settings.overrides)
    paths = [Path(cfg.data.source)]
    if paths[0].is_dir():
        paths = [paths[0] / "manifest.json"]
    if cfg.model.init_from:
        paths += sorted(Path(cfg.model.init_from).glob("*.json")) + \
            sorted(Path(cfg.model.init_from).glob("*.safetensors"))
    state = []
    for path in paths:
        if path.is_file():
            stat = path.stat()
            state.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    return state


def _cache_dir(settings: ChaosSettings) -> Path:
    if settings.reference_cache is not None:
        return Path(settings.reference_cache)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "planaria" / "chaos-references"


def reference_run(settings: ChaosSettings, console: Console) -> dict:
    """{"losses": {iteration: loss}, "step_s": seconds per step} of the job with no fault."""
    cache = _cache_dir(settings) / f"{_reference_key(settings)}.json"
    if cache.exists() and not settings.fresh_reference:
        data = json.loads(cache.read_text())
        console.print(f"reference: cached ({cache.name}, {data['step_s']:.3f} s a step; "
                      "--fresh-reference measures it again)")
        return data
    console.print("[bold]reference run[/] (no faults; cached for next time)")
    cfg = load_config(settings.config, settings.overrides)
    run = _Run(settings, Path(settings.out_dir) / "reference", console, steps=cfg.train.steps, faults=[])
    run.execute(None)
    if run.interrupted:
        raise KeyboardInterrupt("the reference run was interrupted")
    if run.outcome != "ok":
        raise ReferenceFailed(f"the reference run (no faults) did not finish: {run.outcome}; see "
                              f"{run.out_dir / 'logs'}. Fix the job before injecting faults into it")
    losses, times, _ = step_losses(read_commits(run.out_dir))
    # The mean step is the ETTR's fault-free time per step; the median beside it shows
    # whether the machine was busy with something else meanwhile (then the two differ,
    # and --fresh-reference measures again).
    gaps = [b[0] - a[0] for a, b in zip(times, times[1:])]
    data = {"losses": {str(i): v for i, v in losses.items()},
            "val_losses": {str(i): v for i, v in step_val_losses(read_evals(run.out_dir)).items()},
            "step_s": (times[-1][0] - times[0][0]) / max(1, len(times) - 1),
            "median_step_s": statistics.median(gaps) if gaps else 0.0}
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomically(cache, data)
    return data


# ----------------------------------------------------------------------- run
class _Run:
    """One job on a fresh local cluster, with `faults` injected (the settings' by default)."""

    def __init__(self, settings: ChaosSettings, out_dir: Path, console: Console, *, steps: int,
                 faults: list[FaultSpec] | None = None, random_faults: RandomFaults | None = None,
                 replay: TraceReplay | None = None, tensorboard: Path | None = None):
        """`tensorboard`: the job writes its TensorBoard events there (None: as its config says)."""
        self.settings, self.out_dir, self.console, self.steps = settings, Path(out_dir), console, steps
        self.tensorboard = tensorboard
        self.pending = sorted(settings.faults if faults is None else faults, key=lambda f: f.step)
        self.random_faults, self.replay = random_faults, replay
        self._etcd_restarts: list[tuple[float, int]] = []
        self._heals: list[tuple[float, str, Callable[[], None]]] = []
        """Network faults to heal: (when, the fault, what heals it)."""
        self._deadlines: list[tuple[float, int]] = []
        """Preempted nodes: (their deadline, node), killed then if they are still there."""
        """(when, member): killed etcd members to start again."""
        self.injected: list[InjectedFault] = []
        self.live_nodes: list[tuple[float, int]] = []
        self.rng = random.Random(settings.seed)
        self._reached: dict[FaultSpec, float] = {}
        """When each pending fault's step was reached."""
        self.outcome = "not started"
        self.interrupted = False
        """Ctrl-C (or SIGTERM) stopped the run: its report covers the run so far."""
        self.progress: RunProgress | None = None
        self._events_polled = 0.0
        self._epochs_shown = 0

    def execute(self, reference: dict | None) -> Report | None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # A previous run's records, and its checkpoints: a job resumes from the newest
        # checkpoint it finds, so a run in a reused folder would go on from where the
        # last one stopped instead of being the run the report compares.
        for stale in [*log_paths(self.out_dir, COMMITS), *log_paths(self.out_dir, EVALS),
                      *log_paths(self.out_dir, AUDIT)]:
            stale.unlink()
        checkpoints = self.out_dir / "checkpoints"
        shutil.rmtree(checkpoints, ignore_errors=True)
        started = time.time()
        overrides = [*self._events_overrides(), *self.settings.overrides, f"output.dir={self.out_dir}",
                     f"checkpoint.dir={checkpoints}"]
        if self.tensorboard is not None and self.tensorboard_dir == self.tensorboard:
            shutil.rmtree(self.tensorboard, ignore_errors=True)  # a previous run's events are not this run's
        if self.tensorboard_dir is not None:
            self.console.print(f"  TensorBoard events: {self.tensorboard_dir}")
        cluster = LocalCluster(self.settings.config, overrides,
                               nodes=self.settings.nodes, nproc=self.settings.nproc, out_dir=self.out_dir,
                               run_id=f"chaos-{uuid.uuid4().hex[:8]}",
                               etcd_members=self.settings.etcd_members, hosts=self.settings.hosts,
                               metrics_port=self.settings.metrics_port,
                               preemption_grace_s=preemption_grace(self.settings.faults) if self.settings.hosts else None)
        try:
            self._announce_metrics(cluster, list(cluster.agents), self.console.print)
            try:
                self.outcome = self._drive(cluster, started)
            except KeyboardInterrupt:
                self.interrupted, self.outcome = True, "interrupted"
            events, timings = _events_and_timings(cluster)
        finally:
            cluster.close()
        if reference is None:
            return None
        return build_report(out_dir=self.out_dir, steps=self.steps, outcome=self.outcome,
                            faults=self.injected, events=events, timings=timings, reference=reference,
                            live_nodes=self.live_nodes, wall_s=time.time() - started)

    def _events_overrides(self) -> list[str]:
        """This run's TensorBoard events, placed before the user's overrides, which may turn
        them off or send them elsewhere."""
        return [] if self.tensorboard is None else [
            "logging.tensorboard.enabled=true", f"logging.tensorboard.dir={self.tensorboard}"]

    @property
    def tensorboard_dir(self) -> Path | None:
        """Where the job writes its TensorBoard events, as its config and overrides say."""
        return load_config(self.settings.config, [*self._events_overrides(), *self.settings.overrides,
                                                  f"output.dir={self.out_dir}"]).tensorboard_dir

    def _drive(self, cluster: LocalCluster, started: float) -> str:
        self.progress = progress = RunProgress(self.console, self.steps)
        first_step = None
        tail = CommitTail(self.out_dir)
        with progress:
            while True:
                committed = tail.committed()
                now = time.time()
                if first_step is None and committed > 0:
                    first_step = now
                for fault in self._due(committed, now, first_step, cluster):
                    self._inject(cluster, fault, committed)
                self._restart_etcd_members(cluster, now)
                self._heal_network(now)
                self._end_preempted(cluster, now)
                if now - self._events_polled >= 1.0:
                    self._events_polled = now
                    self._show_new_epochs(cluster)
                live = len(cluster.live_nodes())
                self.live_nodes.append((time.time(), live))
                outcome = cluster.outcome()
                if outcome is None:  # once the job has ended, its nodes leaving is no news
                    progress.update(committed, live)
                if not live:
                    return outcome or "failed: every node is gone"
                if time.time() - started > self.settings.timeout_s:
                    return f"timed out after {self.settings.timeout_s:.0f} s"
                if outcome is not None and all(a.poll() is not None for a in cluster.agents.values()):
                    return outcome
                time.sleep(POLL_S)

    def _due(self, committed: int, now: float, first_step: float | None,
             cluster: LocalCluster) -> list[FaultSpec]:
        """Faults to inject now: scheduled ones whose step (and delay) has come, then, once
        the job has taken its first step, the random process's and the trace's."""
        for fault in self.pending:
            if fault.step <= committed:
                self._reached.setdefault(fault, now)
        due = [f for f in self.pending if f in self._reached and now - self._reached[f] >= f.delay_s]
        self.pending = [f for f in self.pending if f not in due]
        if first_step is None:
            return due
        elapsed = now - first_step
        if self.random_faults is not None:
            etcd_all_up = (len(cluster.live_etcd_members()) == self.settings.etcd_members
                           and not any(h[1].startswith("isolate-etcd-member") for h in self._heals))
            due += [replace(f, step=committed) for f in
                    self.random_faults.due(elapsed, len(cluster.live_nodes()), etcd_all_up)]
        if self.replay is not None:
            for step in self.replay.due(elapsed):
                self.progress.note(f"  trace {step.source} at {step.at_s:.1f} s")
                due.append(replace(step.fault, step=committed))
        return due

    def _announce_metrics(self, cluster: LocalCluster, nodes: list[int], say: Callable[[str], None]) -> None:
        """Say where these nodes' metrics are served, and keep every node's endpoint in the
        run's folder (metrics.json, {node: URL}), for a scraper's configuration."""
        if not cluster.metrics_port:
            return
        for node in nodes:
            say(f"  node{node} metrics: {cluster.metrics_endpoint(node)}")
        write_json_atomically(self.out_dir / "metrics.json",
                              {f"node{i}": cluster.metrics_endpoint(i) for i in cluster.agents})

    def _show_new_epochs(self, cluster: LocalCluster) -> None:
        """A line per reconfiguration as the leader publishes it: the recoveries as they
        happen, before the table at the end."""
        try:
            current = int(cluster.store_value(keys.EPOCH) or 0)
        except (TypeError, ValueError):
            return
        for epoch in range(self._epochs_shown + 1, current + 1):
            event = cluster.store_record(keys.epoch_event(epoch), EpochEvent)
            if event is None and epoch == current:
                return  # published a moment ago; its account follows the record
            if event is not None:  # (none: its leader died between the two writes)
                self.progress.note(format_epoch_event(event))
            self._epochs_shown = epoch

    def _restart_etcd_members(self, cluster: LocalCluster, now: float) -> None:
        for when, member in [r for r in self._etcd_restarts if r[0] <= now]:
            self._etcd_restarts.remove((when, member))
            cluster.restart_etcd_member(member)
            self.progress.note(f"  etcd member {member} started again")

    def _end_preempted(self, cluster: LocalCluster, now: float) -> None:
        """Preempted nodes at their deadline: gone already (they left), or killed now."""
        for due in [d for d in self._deadlines if d[0] <= now]:
            self._deadlines.remove(due)
            if due[1] in cluster.live_nodes():
                cluster.kill_node(due[1])
                self.progress.note(f"  [red]node{due[1]} still there at its preemption deadline: killed[/]")
            else:
                self.progress.note(f"  node{due[1]} had left before its preemption deadline")

    def _heal_network(self, now: float) -> None:
        for due in [h for h in self._heals if h[0] <= now]:
            self._heals.remove(due)
            due[2]()
            self.progress.note(f"  {due[1]}: healed")

    def _partition_side(self, fault: FaultSpec, live: list[int]) -> list[int] | None:
        """The side a partition cuts off: the fault's group (None if a node of it is gone),
        or, drawn, up to f live nodes (`fault_tolerance.f` replicas: a side that small
        never holds the last replica of a layer, so the other side trains on without a
        checkpoint)."""
        if fault.group:
            return list(fault.group) if set(fault.group) <= set(live) and len(live) > len(fault.group) else None
        if len(live) < 2:
            return None
        f = load_config(self.settings.config, self.settings.overrides).fault_tolerance.f
        size = self.rng.randint(1, max(1, min(f, (len(live) - 1) // 2)))  # the smaller side
        return sorted(self.rng.sample(live, size))

    def _inject(self, cluster: LocalCluster, fault: FaultSpec, committed: int) -> None:
        kind = fault.kind
        if kind == "add-node":
            target = f"{cluster.add_node()}"
            self._announce_metrics(cluster, [int(target)], self.progress.note)
        elif kind in ETCD_KINDS:
            members = cluster.live_etcd_members()
            member = fault.node if fault.node is not None else self.rng.choice(members)
            if kind == "kill-etcd-member":
                cluster.kill_etcd_member(member)
                self._etcd_restarts.append((time.time() + self.settings.etcd_restart_s, member))
            else:
                self._heals.append((time.time() + fault.duration_s, f"{kind} of member {member}",
                                    cluster.isolate_etcd_member(member)))
            target = f"{member}"
        elif kind == "partition":
            group = self._partition_side(fault, cluster.live_nodes())
            if group is None:
                self.progress.note(f"  [yellow]{fault}: nodes {list(fault.group)} are not all live; skipped[/]")
                return
            self._heals.append((time.time() + fault.duration_s, f"partition of nodes {group}",
                                cluster.partition(group)))
            target = "+".join(map(str, group))
        else:
            live = cluster.live_nodes()
            if fault.node is not None and fault.node not in live:
                self.progress.note(f"  [yellow]{fault}: node {fault.node} is already gone; skipped[/]")
                return
            node = fault.node if fault.node is not None else self.rng.choice(live)
            if kind == "kill-node":
                cluster.kill_node(node)
                target = f"{node}"
            elif kind == "kill-agent":
                cluster.kill_agent(node)
                target = f"{node}"
            elif kind == "freeze-node":
                cluster.freeze_node(node)
                target = f"{node}"
            elif kind == "preempt-node":
                self._deadlines.append((cluster.preempt(node, fault.notice_s), node))
                target = f"{node}"
            elif kind in NETWORK_KINDS:
                heal = cluster.isolate_node(node) if kind == "isolate-node" else cluster.slow_link(node)
                target = f"{node}"
                self._heals.append((time.time() + fault.duration_s, f"{kind} of node{node}", heal))
            else:
                local = fault.local if fault.local is not None else self.rng.randrange(self.settings.nproc)
                signum = signal.SIGKILL if kind == "kill-worker" else signal.SIGSTOP
                if not cluster.signal_worker(node, local, signum):
                    self.progress.note(f"  [yellow]{fault}: worker node{node}.{local} is not running; skipped[/]")
                    return
                target = f"{node}.{local}"
        spec = f"{str(fault).split(':')[0]}:target={target}" + (
            "" if fault.duration_s is None else f":for={fault.duration_s:g}") + (
            "" if fault.notice_s is None else f":notice={fault.notice_s:g}")
        self.injected.append(InjectedFault(spec, committed, time.time()))
        self.progress.note(f"  [red]fault[/] {spec} (job at step {committed})")


def _events_and_timings(cluster: LocalCluster) -> tuple[list[EpochEvent], dict[int, list[EpochTiming]]]:
    """Every reconfiguration's account and every worker's timings, by epoch."""
    current = int(cluster.store_value(keys.EPOCH) or 0)
    events, timings = [], {}
    for epoch in range(1, current + 1):
        event = cluster.store_record(keys.epoch_event(epoch), EpochEvent)
        if event is not None:  # (none: its leader died between the two writes)
            events.append(event)
    for epoch in range(current + 1):
        for worker in cluster.store_keys(keys.epoch_timings(epoch)):
            timings.setdefault(epoch, []).append(cluster.store_record(keys.epoch_timings(epoch) + worker, EpochTiming))
    return events, timings
