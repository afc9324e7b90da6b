"""`planaria chaos`: run a job on a local cluster, inject faults, compare with the same job
without faults, and say plainly whether anything was lost.

The reference is the same job on the same local cluster with no fault (so that its
step time is this machine's, for the ETTR), cached by a hash of the config file, the
overrides and the cluster's shape. The run injects each fault once the job has
committed the fault's step (faults due together fire together), samples the live nodes,
and at the end reads back what the job did (`planaria.chaos.report`).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from planaria.chaos.cluster import LocalCluster
from planaria.chaos.faults import FaultSpec, validate
from planaria.chaos.report import (InjectedFault, Report, build_report, committed_iterations, plot_report,
                                   read_commits, recovery_notes, recovery_table, step_losses, verdict_table,
                                   write_json_atomically, write_report)
from planaria.runtime.config import load_config

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


def run_chaos(settings: ChaosSettings, console: Console) -> Report:
    cfg = load_config(settings.config, settings.overrides)
    validate(settings.faults, steps=cfg.train.steps, nodes=settings.nodes, nproc=settings.nproc,
             etcd_members=settings.etcd_members)
    out = Path(settings.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reference = reference_run(settings, console)
    console.print(f"[bold]chaos run[/]: {settings.nodes} nodes x {settings.nproc} worker(s), "
                  f"{len(settings.faults)} fault(s): {', '.join(map(str, settings.faults)) or 'none'}")
    run = _Run(settings, out / "run", console, steps=cfg.train.steps)
    report = run.execute(reference)
    write_report(report, out)
    plot = plot_report(report, run.injected, out / "report.png")
    console.print(recovery_table(report.recoveries))
    for note in recovery_notes(report.recoveries):
        console.print(f"  {note}")
    console.print(verdict_table(report))
    console.print(f"report: {out / 'report.json'}   plot: {plot}")
    return report


# ----------------------------------------------------------------- reference
def _reference_key(settings: ChaosSettings) -> str:
    from importlib.metadata import version

    text = Path(settings.config).read_text()
    shape = json.dumps({"overrides": settings.overrides, "nodes": settings.nodes,
                        "nproc": settings.nproc, "planaria": version("planaria")}, sort_keys=True)
    return hashlib.sha256((text + shape).encode()).hexdigest()[:16]


def _cache_dir(settings: ChaosSettings) -> Path:
    if settings.reference_cache is not None:
        return Path(settings.reference_cache)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "planaria" / "chaos-references"


def reference_run(settings: ChaosSettings, console: Console) -> dict:
    """{"losses": {iteration: loss}, "step_s": seconds per step} of the job with no fault."""
    cache = _cache_dir(settings) / f"{_reference_key(settings)}.json"
    if cache.exists():
        console.print(f"reference: cached ({cache.name})")
        return json.loads(cache.read_text())
    console.print("[bold]reference run[/] (no faults; cached for next time)")
    cfg = load_config(settings.config, settings.overrides)
    run = _Run(settings, Path(settings.out_dir) / "reference", console, steps=cfg.train.steps, faults=[])
    run.execute(None)
    if run.outcome != "ok":
        raise RuntimeError(f"the reference run (no faults) did not finish: {run.outcome}; see "
                           f"{run.out_dir / 'logs'}. Fix the job before injecting faults into it")
    losses, times, _ = step_losses(read_commits(run.out_dir))
    step_s = (times[-1][0] - times[0][0]) / max(1, len(times) - 1)
    data = {"losses": {str(i): v for i, v in losses.items()}, "step_s": step_s}
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomically(cache, data)
    return data


# ----------------------------------------------------------------------- run
class _Run:
    """One job on a fresh local cluster, with `faults` injected (the settings' by default)."""

    def __init__(self, settings: ChaosSettings, out_dir: Path, console: Console, *, steps: int,
                 faults: list[FaultSpec] | None = None):
        self.settings, self.out_dir, self.console, self.steps = settings, Path(out_dir), console, steps
        self.pending = sorted(settings.faults if faults is None else faults, key=lambda f: f.step)
        self.injected: list[InjectedFault] = []
        self.live_nodes: list[tuple[float, int]] = []
        self.rng = random.Random(settings.seed)
        self._reached: dict[FaultSpec, float] = {}
        """When each pending fault's step was reached."""
        self.outcome = "not started"

    def execute(self, reference: dict | None) -> Report | None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.out_dir.glob("commits-*.jsonl"):  # a previous run's
            stale.unlink()
        started = time.time()
        cluster = LocalCluster(self.settings.config, [*self.settings.overrides, f"output.dir={self.out_dir}"],
                               nodes=self.settings.nodes, nproc=self.settings.nproc, out_dir=self.out_dir,
                               run_id=f"chaos-{uuid.uuid4().hex[:8]}",
                               etcd_members=self.settings.etcd_members)
        try:
            self.outcome = self._drive(cluster, started)
            events, timings = _events_and_timings(cluster)
        finally:
            cluster.close()
        if reference is None:
            return None
        return build_report(out_dir=self.out_dir, steps=self.steps, outcome=self.outcome,
                            faults=self.injected, events=events, timings=timings, reference=reference,
                            live_nodes=self.live_nodes, wall_s=time.time() - started)

    def _drive(self, cluster: LocalCluster, started: float) -> str:
        shown = -1
        while True:
            committed = committed_iterations(self.out_dir)
            now = time.time()
            for fault in self.pending:
                if fault.step <= committed:
                    self._reached.setdefault(fault, now)
            due = [f for f in self.pending if f in self._reached and now - self._reached[f] >= f.delay_s]
            if due:
                self.pending = [f for f in self.pending if f not in due]
                for fault in due:
                    self._inject(cluster, fault, committed)
            self.live_nodes.append((time.time(), len(cluster.live_nodes())))
            if committed != shown:
                shown = committed
                self.console.print(f"  step {committed}/{self.steps} | live nodes {len(cluster.live_nodes())}")
            if not cluster.live_nodes():
                return cluster.outcome() or "failed: every node is gone"
            if time.time() - started > self.settings.timeout_s:
                return f"timed out after {self.settings.timeout_s:.0f} s"
            outcome = cluster.outcome()
            if outcome is not None and all(a.poll() is not None for a in cluster.agents.values()):
                return outcome
            time.sleep(POLL_S)

    def _inject(self, cluster: LocalCluster, fault: FaultSpec, committed: int) -> None:
        kind = fault.kind
        if kind == "add-node":
            target = f"{cluster.add_node()}"
        elif kind == "kill-etcd-member":
            members = cluster.live_etcd_members()
            member = fault.node if fault.node is not None else self.rng.choice(members)
            cluster.kill_etcd_member(member)
            target = f"{member}"
        else:
            live = cluster.live_nodes()
            if fault.node is not None and fault.node not in live:
                self.console.print(f"  [yellow]{fault}: node {fault.node} is already gone; skipped[/]")
                return
            node = fault.node if fault.node is not None else self.rng.choice(live)
            if kind == "kill-node":
                cluster.kill_node(node)
                target = f"{node}"
            elif kind == "kill-agent":
                cluster.kill_agent(node)
                target = f"{node}"
            else:
                local = fault.local if fault.local is not None else self.rng.randrange(self.settings.nproc)
                signum = signal.SIGKILL if kind == "kill-worker" else signal.SIGSTOP
                if not cluster.signal_worker(node, local, signum):
                    self.console.print(f"  [yellow]{fault}: worker node{node}.{local} is not running; skipped[/]")
                    return
                target = f"{node}.{local}"
        spec = f"{str(fault).split(':')[0]}:target={target}"
        self.injected.append(InjectedFault(spec, committed, time.time()))
        self.console.print(f"  [red]fault[/] {spec} (job at step {committed})")


def _events_and_timings(cluster: LocalCluster) -> tuple[list[dict], dict[int, list[dict]]]:
    events, timings = [], {}
    for key in cluster.store_keys("epoch/"):
        parts = key.split("/")
        if len(parts) == 2 and parts[1] == "event":
            events.append(cluster.store_json(f"epoch/{key}"))
        elif len(parts) == 3 and parts[1] == "timing":
            timings.setdefault(int(parts[0]), []).append(cluster.store_json(f"epoch/{key}"))
    return [e for e in events if e], timings
