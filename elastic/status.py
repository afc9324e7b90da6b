"""`planaria status`: a running job's state, read from its store in etcd, never written.

    planaria status --etcd HOST:PORT --run-id JOB [--watch [SECONDS]] [--json]

What the leader and the agents keep in etcd (`planaria.runtime.contract.keys`) says all
a person watching a long job asks: the epoch in force and its plan (pipelines, stages,
nodes, layers), each node's state and when its agent last renewed its lease, the last
committed step and the step rate (`progress`, written by the plan's rank 0 about once a
second), and every reconfiguration so far with its reason, its pause and where its layer
state came from. A node is

- `training`: in the plan in force, its agent registered;
- `spare`: registered, not in the plan, waiting to take a failed node's place (the job
  is at `--nnodes`' maximum, or no plan can use it: the leader's `spares` key);
- `joining`: registered, not in the plan (it joins at the next step boundary, or waits
  while no plan can use it; a node that just died shows here until its lease expires,
  seconds, though the leader may have planned around it already);
- `leaving`: told it will be preempted (`notice/<node>`), still registered;
- `gone`: in an earlier plan, its agent's registration gone with its lease.

Reading takes a handful of range reads, whatever the job's size (the recoveries: the
last `RECOVERIES` epochs). While the job recovers the view is that of the moment; while
etcd is away it says so (with `--watch`, the last view is kept on screen).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field

from planaria.elastic.etcd_client import EtcdClient, EtcdSettings, EtcdUnavailable
from planaria.runtime.contract import keys
from planaria.runtime.contract.epochs import EpochEvent, EpochRecord, Progress
from planaria.runtime.contract.membership import LeaveNotice, Waiting

RECOVERIES = 50
"""Reconfigurations shown (the newest), and epochs looked back through for gone nodes."""


@dataclass
class NodeView:
    name: str
    state: str
    """training, joining, spare, leaving or gone."""
    renewed_s_ago: float | None = None
    """Since its agent last renewed its lease (None: gone)."""
    workers: int = 0
    """Its live workers."""
    leaves_in_s: float | None = None
    """Until its preemption deadline, when it was told one."""


@dataclass
class StageView:
    node: str
    layers: list[int]


@dataclass
class RecoveryView:
    epoch: int
    reason: str
    at: float
    """When the epoch was published (wall clock)."""
    decided_s: float
    """From the controller's detection to the publication."""
    source: str
    first_step: int
    rerun: int
    failed: list[str] = field(default_factory=list)
    joined: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


@dataclass
class JobView:
    run_id: str
    etcd: str
    reachable: bool = True
    error: str | None = None
    read_at: float = 0.0
    epoch: int | None = None
    outcome: str | None = None
    """"ok" or "failed: ..." once the job is over."""
    leader: str | None = None
    pipelines: list[list[StageView]] = field(default_factory=list)
    nodes: list[NodeView] = field(default_factory=list)
    committed_step: int | None = None
    step_s: float | None = None
    steps_per_s: float | None = None
    committed_s_ago: float | None = None
    recoveries: list[RecoveryView] = field(default_factory=list)
    waiting: dict | None = None
    """While the job, below one replica's nodes, waits for nodes: `node_wait.Waiting`'s fields."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def read_status(client: EtcdClient, run_id: str) -> JobView:
    """The job's state now (module docstring); `reachable` False when etcd did not answer."""
    view = JobView(run_id=run_id, etcd=client.endpoint, read_at=time.time())
    try:
        _read(client, keys.run_prefix(run_id), view)
    except EtcdUnavailable as err:
        view.reachable, view.error = False, str(err)
    return view


def _read(client: EtcdClient, prefix: str, view: JobView) -> None:
    value = lambda key: client.get(prefix + key)[0]  # noqa: E731
    epoch = value(keys.EPOCH)
    done, leader = value(keys.DONE), value(keys.LEADER)
    view.outcome = done.decode() if done else None
    view.leader = leader.decode() if leader else None
    if epoch is None:
        if value(keys.JOB) is None:
            view.error = f"no job with run id {view.run_id!r} in this etcd (is --run-id right?)"
        view.nodes = _nodes(client, prefix, plan_nodes=set(), past=set(), spares=set())
        return
    view.epoch = int(epoch)
    record = EpochRecord.from_json(value(keys.epoch_record(view.epoch)))
    plan = record.plan
    view.pipelines = [[StageView(s.node, list(s.layers())) for s in p.stages] for p in plan.pipelines]
    past: set[str] = set()
    for e in range(max(0, view.epoch - RECOVERIES), view.epoch):
        text = value(keys.epoch_record(e))
        if text:
            past |= set(EpochRecord.from_json(text).plan.nodes())
    spares = value(keys.SPARES)
    view.nodes = _nodes(client, prefix, plan_nodes=set(plan.nodes()), past=past,
                        spares=set(json.loads(spares)) if spares else set())
    waiting = value(keys.WAITING)
    if waiting:
        view.waiting = Waiting.from_json(waiting).to_dict()
    progress = value(keys.PROGRESS)
    if progress:
        p = Progress.from_json(progress)
        view.committed_step, view.step_s = p.step, p.step_s
        view.steps_per_s = 1 / p.step_s if p.step_s > 0 else None
        view.committed_s_ago = max(0.0, view.read_at - p.time_s)
    for e in range(max(1, view.epoch - RECOVERIES + 1), view.epoch + 1):
        text = value(keys.epoch_event(e))
        if text:
            view.recoveries.append(_recovery(EpochEvent.from_json(text)))


def _nodes(client: EtcdClient, prefix: str, *, plan_nodes: set[str], past: set[str],
           spares: set[str]) -> list[NodeView]:
    registered = client.leases_with_prefix(prefix + keys.NODES)
    workers: dict[str, int] = {}
    for key in client.keys_with_prefix(prefix + keys.ALIVE):
        node = keys.parse_worker_key(key)[0]
        workers[node] = workers.get(node, 0) + 1
    notices = {node: LeaveNotice.from_json(text)
               for node, text in client.items_with_prefix(prefix + keys.NOTICE).items()}
    now, found = time.time(), []
    for node in sorted(set(registered) | plan_nodes | past):
        if node in notices and node in registered:
            state = "leaving"
        elif node in registered:
            state = "training" if node in plan_nodes else "spare" if node in spares else "joining"
        else:
            state = "gone"
        lease = registered.get(node)
        found.append(NodeView(node, state, renewed_s_ago=client.lease_age_s(lease) if lease else None,
                              workers=workers.get(node, 0),
                              leaves_in_s=notices[node].deadline - now if node in notices else None))
    return found


def _recovery(event: EpochEvent) -> RecoveryView:
    return RecoveryView(epoch=event.epoch, reason=event.reason, at=event.published_s,
                        decided_s=event.published_s - event.detected_s, source=event.source,
                        first_step=event.first_iteration, rerun=event.rerun, failed=list(event.failed),
                        joined=list(event.joined), left=list(event.left))


# ------------------------------------------------------------------ display
def render(view: JobView):
    """The view as rich renderables, for the terminal."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    clock = time.strftime("%H:%M:%S", time.localtime(view.read_at))
    head = Text(f"job {view.run_id} on etcd {view.etcd}, read at {clock}", style="bold")
    if not view.reachable:
        return Group(head, Text(f"etcd unreachable: {view.error}", style="red"))
    lines = [head]
    if view.error:
        lines.append(Text(view.error, style="red"))
    state = "over: " + view.outcome if view.outcome else "running"
    lines.append(Text(f"{state}; epoch {view.epoch if view.epoch is not None else '- (not started)'}; "
                      f"leader {view.leader or '-'}"))
    if view.waiting is not None:
        w = view.waiting
        lines.append(Text(f"waiting for {w['needs'] - w['nodes']} more node(s): {w['nodes']} left, one replica of "
                          f"the model needs {w['needs']}; waiting for {view.read_at - w['since']:.0f} s of at most "
                          f"{w['limit_s']:g} s (--join-timeout)", style="yellow"))
    if view.committed_step is not None:
        lines.append(Text(f"step {view.committed_step + 1} committed {view.committed_s_ago:.1f} s ago; "
                          f"{view.steps_per_s:.2f} steps/s ({view.step_s:.3f} s a step)"))
    if view.pipelines:
        plan = Table(title="plan", title_justify="left")
        plan.add_column("pipeline", justify="right")
        plan.add_column("stages: node (layers)")
        for i, stages in enumerate(view.pipelines):
            plan.add_row(str(i), "  ".join(f"{s.node} ({_span(s.layers)})" for s in stages))
        lines.append(plan)
    nodes = Table(title="nodes", title_justify="left")
    for column in ("node", "state", "workers", "lease renewed", "notice"):
        nodes.add_column(column)
    for n in view.nodes:
        nodes.add_row(n.name, n.state, str(n.workers),
                      "-" if n.renewed_s_ago is None else f"{n.renewed_s_ago:.0f} s ago",
                      "-" if n.leaves_in_s is None else f"gone in {max(0.0, n.leaves_in_s):.0f} s")
    lines.append(nodes)
    if view.recoveries:
        table = Table(title=f"reconfigurations (the last {len(view.recoveries)})", title_justify="left")
        for column in ("epoch", "at", "reason", "decided in", "layers from", "from step", "nodes"):
            table.add_column(column)
        for r in view.recoveries:
            who = "; ".join(f"{k} {', '.join(v)}" for k, v in
                            (("failed", r.failed), ("joined", r.joined), ("left", r.left)) if v)
            table.add_row(str(r.epoch), time.strftime("%H:%M:%S", time.localtime(r.at)), r.reason,
                          f"{r.decided_s:.2f} s", r.source + (f" ({r.rerun} again)" if r.rerun else ""),
                          str(r.first_step), who or "-")
        lines.append(table)
    return Group(*lines)


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0]) if layers else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="planaria status", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--etcd", required=True, metavar="HOST:PORT[,HOST:PORT...]", help="the job's etcd")
    parser.add_argument("--run-id", required=True, help="the job's run id (planaria-run's --rdzv-id)")
    parser.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until interrupted")
    parser.add_argument("--json", action="store_true", help="print JSON (with --watch: one object a line)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    if args.watch is not None and args.watch <= 0:
        print(f"planaria status: --watch {args.watch:g}: give a positive number of seconds", file=sys.stderr)
        return 2
    try:
        settings = EtcdSettings.from_env(args.etcd, retry_s=1.0, timeout_s=2.0)
        client = EtcdClient(settings, on_outage=lambda line: None)
    except (ValueError, OSError) as err:
        print(f"planaria status: {err}", file=sys.stderr)
        return 2
    if args.watch is None:
        view = read_status(client, args.run_id)
        if args.json:
            print(view.to_json())
        else:
            Console().print(render(view))
        return 0 if view.reachable and not view.error else 1
    try:
        if args.json:  # one object a line, for a script to follow
            while True:
                print(json.dumps(asdict(read_status(client, args.run_id))), flush=True)
                time.sleep(args.watch)
        last = None
        with Live(refresh_per_second=4, screen=False) as live:
            while True:
                view = read_status(client, args.run_id)
                if view.reachable or last is None:
                    live.update(render(view))
                    last = view
                else:  # etcd away: the last state read stays on screen, said to be old
                    live.update(_away(render(last), view))
                time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def _away(shown, view: JobView):
    from rich.console import Group
    from rich.text import Text

    return Group(Text(f"etcd unreachable ({view.error}); the last state read is below", style="red"), shown)
