"""Faults that come by the clock rather than by the step: a seeded random process
(`--random RATE`) and a replayed spot-preemption trace (`--trace FILE --time-scale X`).

Both count seconds from the job's first committed step (start-up is not the story),
and both hand the harness `FaultSpec`s to inject now; the harness stamps them with
the step the job is at. A trace is read and checked whole before anything starts.
"""
from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

from planaria.chaos.faults import ETCD_KINDS, NETWORK_KINDS, FaultSpec, FaultSpecError

NODE_LOSSES = ("kill-worker", "kill-node", "kill-agent", "hang-worker", "freeze-node", "preempt-node")
"""Kinds that take a node out of the job (a worker killed or hung takes its node with it)."""
NOTICE_S = (5.0, 30.0)
"""A drawn preemption's notice (uniform): from too short for some jobs' leave to GCP's 30 s."""
OPT_IN_KINDS = ("preempt-node",)
"""Drawn only when --random-kinds names them: the soak's default mix stays what it was."""
NETWORK_DURATION_S = (5.0, 30.0)
FOLLOW_UP_S = (0.3, 4.0)
"""A follow-up fault comes this long after the last one (`RandomFaults.follow_up`): while
the job detects it, plans, copies layers or takes its first step."""
"""A drawn network fault lasts between these (uniform): from shorter than a lease's TTL
(a blip the job should ride out) to several TTLs (a node or side planned out, then in)."""


# --------------------------------------------------------------------- random
class RandomFaults:
    """Faults at random moments, RATE a minute on average: the gaps are uniform in
    [0.5, 1.5] x 60/RATE seconds (RATE 1.5: every 20 to 60 s). The kind is drawn among
    `kinds`, but the live nodes are kept within [low, high]: at `low` the next fault adds
    a node, at `high` it removes one (or kills an etcd member). A network fault's
    duration is drawn too (`NETWORK_DURATION_S`). The harness picks targets with its own
    seeded generator.

    `follow_up`: the chance that a fault is followed by another within `FOLLOW_UP_S` (a
    node killed, cut off or added while the job recovers from the last fault: a cut
    while an epoch is being planned, a kill during a partition), instead of the usual
    gap."""

    def __init__(self, rate_per_min: float, seed: int, *, low: int, high: int, kinds: tuple[str, ...],
                 follow_up: float = 0.0):
        if rate_per_min <= 0:
            raise FaultSpecError(f"--random {rate_per_min:g}: the rate is faults per minute and must be > 0")
        if not 1 <= low <= high:
            raise FaultSpecError(f"--random-nodes {low}-{high}: need 1 <= LOW <= HIGH")
        if not 0 <= follow_up <= 1:
            raise FaultSpecError(f"--random-follow-up {follow_up:g}: a chance, from 0 to 1")
        self.mean_s, self.low, self.high, self.kinds = 60.0 / rate_per_min, low, high, kinds
        self.follow_up = follow_up
        self.rng = random.Random(seed)
        self.next_s = self._gap()

    def _gap(self) -> float:
        return self.rng.uniform(0.5, 1.5) * self.mean_s

    def due(self, elapsed_s: float, live_nodes: int, etcd_all_up: bool) -> list[FaultSpec]:
        if elapsed_s < self.next_s:
            return []
        # (Drawn from its own stream of the generator only when asked for: a run without
        # follow-ups draws the faults it always did for its seed.)
        followed = self.follow_up > 0 and self.rng.random() < self.follow_up
        self.next_s = elapsed_s + (self.rng.uniform(*FOLLOW_UP_S) if followed else self._gap())
        if live_nodes <= self.low and "add-node" in self.kinds:
            return [FaultSpec("add-node", 0)]
        choices = [k for k in self.kinds
                   if (k != "add-node" or live_nodes < self.high)
                   and (k not in NODE_LOSSES or live_nodes > self.low)
                   and (k not in ETCD_KINDS or etcd_all_up)]
        if live_nodes >= self.high:  # bring it down before anything else is added
            choices = [k for k in choices if k != "add-node"] or choices
        if not choices:
            return []
        kind = self.rng.choice(choices)
        duration = round(self.rng.uniform(*NETWORK_DURATION_S), 1) if kind in NETWORK_KINDS else None
        notice = round(self.rng.uniform(*NOTICE_S), 1) if kind == "preempt-node" else None
        return [FaultSpec(kind, 0, duration_s=duration, notice_s=notice)]


def parse_node_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    if not sep or not low.isdigit() or not high.isdigit():
        raise FaultSpecError(f"--random-nodes {text!r}: expected LOW-HIGH, such as 4-6")
    return int(low), int(high)


def random_kinds(text: str | None, etcd_members: int, hosts: bool = False) -> tuple[str, ...]:
    """The kinds the random process draws from: those named (comma-separated), or every
    kind that makes sense here (an etcd member's only with 3 members, the network's only
    with simulated hosts)."""
    from planaria.chaos.faults import KINDS

    if text is None:
        return tuple(k for k in KINDS if (k not in ETCD_KINDS or etcd_members >= 3)
                     and (k not in NETWORK_KINDS or hosts) and k not in OPT_IN_KINDS)
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise FaultSpecError(f"--random-kinds {text!r}: unknown kind(s) {unknown}; known kinds: {', '.join(KINDS)}")
    if any(k in ETCD_KINDS for k in kinds) and etcd_members < 3:
        raise FaultSpecError(f"--random-kinds names {', '.join(k for k in kinds if k in ETCD_KINDS)} but etcd "
                             "has one member; run with --etcd-members 3")
    if any(k in NETWORK_KINDS for k in kinds) and not hosts:
        raise FaultSpecError(f"--random-kinds names network faults ({', '.join(k for k in kinds if k in NETWORK_KINDS)}), "
                             "which need nodes with networks of their own; run with --hosts")
    if "preempt-node" in kinds and hosts:
        raise FaultSpecError("--random-kinds names preempt-node, which the simulated hosts cannot be told "
                             "of (their cloud is on loopback); drop it or --hosts")
    return kinds


# ---------------------------------------------------------------------- trace
@dataclass(frozen=True)
class TraceEvent:
    ms: int
    op: str
    """"add" or "remove"."""
    node: str
    line: int


BUNDLED_TRACES = Path(__file__).resolve().parent / "traces"


def find_trace(name: str | Path) -> Path:
    """A trace file: the path given, or a trace shipped with Planaria by its name
    (`p3`, `p3-trace.csv`, `g4dn`)."""
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (BUNDLED_TRACES / str(name), BUNDLED_TRACES / f"{name}-trace.csv"):
        if candidate.is_file():
            return candidate
    shipped = ", ".join(sorted(p.name for p in BUNDLED_TRACES.glob("*.csv")))
    raise FileNotFoundError(f"trace {name} does not exist; give a file, or one of the traces "
                            f"shipped with Planaria: {shipped}")


def read_trace(path: Path) -> list[TraceEvent]:
    """The events of a `time_ms,add|remove,NODE` trace, checked line by line: the error
    names the file, the line and what would be right."""
    path = find_trace(path)
    events: list[TraceEvent] = []
    live: set[str] = set()
    with open(path, newline="", encoding="utf-8") as f:
        for number, row in enumerate(csv.reader(f), start=1):
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            where = f"{path}:{number}"
            if len(row) != 3:
                raise FaultSpecError(f"{where}: expected time_ms,add|remove,NODE; got {','.join(row)!r}")
            ms_text, op, node = (cell.strip() for cell in row)
            if not ms_text.isdigit():
                raise FaultSpecError(f"{where}: the time {ms_text!r} is not a whole number of milliseconds")
            if op not in ("add", "remove"):
                raise FaultSpecError(f"{where}: {op!r} is neither add nor remove")
            if not node:
                raise FaultSpecError(f"{where}: the node name is empty")
            ms = int(ms_text)
            if events and ms < events[-1].ms:
                raise FaultSpecError(f"{where}: time {ms} ms comes before the previous line's "
                                     f"{events[-1].ms} ms; a trace is sorted by time")
            if op == "add" and node in live:
                raise FaultSpecError(f"{where}: {node} is added while it is already live")
            if op == "remove" and node not in live:
                raise FaultSpecError(f"{where}: {node} is removed but was never added (or already removed)")
            (live.add if op == "add" else live.discard)(node)
            events.append(TraceEvent(ms, op, node, number))
    if not events:
        raise FaultSpecError(f"{path}: the trace has no events")
    return events


@dataclass(frozen=True)
class ReplayStep:
    at_s: float
    """Seconds after the job's first step, time-scaled."""
    fault: FaultSpec
    source: str
    """The trace's line, for the report: `p3-trace.csv:42 remove node7`."""


def replay_schedule(events: list[TraceEvent], nodes: int, time_scale: float,
                    name: str = "trace", notice_s: float | None = None) -> tuple[list[ReplayStep], int]:
    """(what to inject when, trace events left out by the cap) for a local cluster that
    starts with `nodes` nodes. The replay starts at the trace's first moment with `nodes`
    nodes live: those are local nodes 0..nodes-1, in the order the trace added them. From
    then on a removal of a local node kills it (a preempted machine vanishes), and an
    addition takes the next local index while fewer than `nodes` are live; other events
    (nodes beyond the cap) are left out.

    With `notice_s`, every removal is announced that many seconds of the run before it
    (a preemption with notice: `preempt-node`; less when the removal comes sooner after
    the start or after the node's own addition). The notice is in the run's own seconds, not the trace's: what it is
    weighed against, the job's steps and copies, does not shrink with the time scale."""
    if time_scale <= 0:
        raise FaultSpecError(f"--time-scale {time_scale:g}: must be > 0 (trace seconds per run second)")
    live: list[str] = []
    start = None
    for k, event in enumerate(events):
        (live.append if event.op == "add" else live.remove)(event.node)
        if len(live) >= nodes and (k + 1 == len(events) or events[k + 1].ms != event.ms):
            start = k + 1
            break
    if start is None:
        most = max(_live_counts(events))
        raise FaultSpecError(f"the trace never has {nodes} nodes live at once (at most {most}); "
                             f"run with --nodes {most} or fewer")
    t0 = events[start - 1].ms
    local = {node: i for i, node in enumerate(live[:nodes])}
    added_at = dict.fromkeys(local, 0.0)  # a notice never comes before its node is there
    launched, left_out = nodes, len(live) - nodes
    schedule = []
    for event in events[start:]:
        at_s = (event.ms - t0) / 1000.0 / time_scale
        source = f"{name}:{event.line} {event.op} {event.node}"
        if event.op == "remove" and event.node in local and notice_s is not None:
            announced = max(added_at.pop(event.node), at_s - notice_s)
            fault = FaultSpec("preempt-node", 0, local.pop(event.node), notice_s=round(at_s - announced, 3))
            schedule.append(ReplayStep(announced, fault, source))
        elif event.op == "remove" and event.node in local:
            schedule.append(ReplayStep(at_s, FaultSpec("kill-node", 0, local.pop(event.node)), source))
        elif event.op == "add" and len(local) < nodes:
            local[event.node], added_at[event.node] = launched, at_s
            launched += 1
            schedule.append(ReplayStep(at_s, FaultSpec("add-node", 0), source))
        else:
            left_out += 1
    # A notice moves its removal's announcement earlier: the replay hands steps out in
    # time order (stable: events of one moment keep the trace's order).
    return sorted(schedule, key=lambda step: step.at_s), left_out


def _live_counts(events: list[TraceEvent]):
    live = 0
    for event in events:
        live += 1 if event.op == "add" else -1
        yield live


class TraceReplay:
    """A replay schedule, handed out as its moments pass."""

    def __init__(self, schedule: list[ReplayStep]):
        self.pending = list(schedule)

    @property
    def duration_s(self) -> float:
        return self.pending[-1].at_s if self.pending else 0.0

    def due(self, elapsed_s: float) -> list[ReplayStep]:
        ready = [s for s in self.pending if s.at_s <= elapsed_s]
        self.pending = self.pending[len(ready):]
        return ready
