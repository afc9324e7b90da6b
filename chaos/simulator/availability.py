"""Which nodes a simulated job has, and when: the input of every policy.

An `Availability` is the initial set of live nodes and a time-ordered list of changes
(nodes added, nodes removed), read from

- an event trace (`time_ms,add|remove,NODE`: the p3 and g4dn traces),
- a sampled-count trace (`YYYY-MM-DD, HH:MM:SS, COUNT`: the GCP a100 trace),
- or `synthetic:EVERY`: Oobleck's setup, 30 nodes at first and one removed every EVERY
  (`6h`, `3h`, `1h`, `30m`, `10m`, or seconds).

Scaling: `time_scale` X compresses time X-fold (as `planaria chaos --time-scale` does);
`nodes` N rescales the live count to peak at N (count × N / the trace's peak, rounded).
Which nodes leave is then drawn by a seeded generator, the same for every policy, so
all policies see the same nodes vanish. Node identity in a trace says little (a
preempted spot instance is any instance), while the count and its timing say all.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from planaria.chaos.faults import FaultSpecError
from planaria.chaos.sources import BUNDLED_TRACES, find_trace, read_trace

SIMULTANEOUS_S = 1.0
"""Changes this close together reach a job as one (the control plane debounces them)."""
SYNTHETIC_NODES = 30
"""Oobleck's synthetic traces start with 30 nodes."""
_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class Change:
    at_s: float
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    downtime_s: float | None = None
    """The training time this change costs, when measured (a replayed chaos run: the
    median for its kind of fault), replacing the modelled detection and recovery.
    None: modelled."""


@dataclass(frozen=True)
class Availability:
    """Live nodes over [0, duration_s]: `initial` at 0, then each change in order."""

    name: str
    initial: tuple[str, ...]
    changes: tuple[Change, ...]
    duration_s: float

    def __post_init__(self) -> None:
        live = set(self.initial)
        for change in self.changes:
            if not 0 <= change.at_s <= self.duration_s:
                raise ValueError(f"{self.name}: a change at {change.at_s:g} s lies outside [0, {self.duration_s:g}]")
            if set(change.added) & live or not set(change.removed) <= live:
                raise ValueError(f"{self.name}: the change at {change.at_s:g} s adds a live node "
                                 "or removes one that is not live")
            live = (live | set(change.added)) - set(change.removed)

    def counts(self) -> list[tuple[float, int]]:
        """(time, live nodes from then on), starting at 0."""
        live = len(self.initial)
        out = [(0.0, live)]
        for change in self.changes:
            live += len(change.added) - len(change.removed)
            out.append((change.at_s, live))
        return out

    @property
    def peak(self) -> int:
        return max(n for _, n in self.counts())

    @property
    def smallest(self) -> int:
        return min(n for _, n in self.counts())

    @property
    def removals(self) -> int:
        return sum(len(c.removed) for c in self.changes)

    def node_seconds(self) -> float:
        """Live node-seconds over the whole trace: what a policy must account for."""
        points = self.counts() + [(self.duration_s, 0)]
        return sum(n * (points[i + 1][0] - t) for i, (t, n) in enumerate(points[:-1]))


def parse_duration(text: str) -> float:
    """`6h`, `30m`, `10min`, `90s`, `2d` or plain seconds, as seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in ("", *_UNITS):
        raise ValueError(f"{text!r} is not a duration: use a number with s, m, h or d (6h, 30m, 600)")
    seconds = float(match.group(1)) * _UNITS.get(match.group(2), 1)
    if seconds <= 0:
        raise ValueError(f"duration {text!r} must be positive")
    return seconds


def synthetic(every_s: float, *, nodes: int = SYNTHETIC_NODES, duration_s: float | None = None,
              name: str | None = None) -> Availability:
    """`nodes` nodes at 0, one removed every `every_s` seconds. Without `duration_s` the
    trace lasts until half the nodes are gone (at least one removal): long enough to see
    the rate's effect, short of the point where too few nodes hold the model at all."""
    if nodes < 1:
        raise ValueError(f"a synthetic trace needs at least one node, got {nodes}")
    ids = tuple(f"node{i}" for i in range(nodes))
    duration = duration_s if duration_s is not None else every_s * max(1, nodes // 2) + every_s / 2
    removals = min(nodes - 1, int(duration // every_s))
    rng = random.Random(0)
    live = list(ids)
    changes = []
    for k in range(1, removals + 1):
        victim = live.pop(rng.randrange(len(live)))
        changes.append(Change(k * every_s, removed=(victim,)))
    return Availability(name or f"synthetic:{_format_every(every_s)}", ids, tuple(changes), duration)


def _format_every(seconds: float) -> str:
    for unit in ("d", "h", "m"):
        if seconds >= _UNITS[unit] and seconds % _UNITS[unit] == 0:
            return f"{int(seconds // _UNITS[unit])}{unit}"
    return f"{seconds:g}s"


def load_availability(spec: str, *, nodes: int | None = None, time_scale: float = 1.0,
                      seed: int = 0) -> Availability:
    """`synthetic:EVERY`, a shipped trace's name (p3, g4dn, gcp), or a trace file."""
    if time_scale <= 0:
        raise ValueError(f"time scale {time_scale:g} must be > 0 (trace seconds per simulated second)")
    if nodes is not None and nodes < 1:
        raise ValueError(f"--nodes {nodes}: must be at least 1")
    if spec.startswith("synthetic:"):
        every = parse_duration(spec.split(":", 1)[1]) / time_scale
        return synthetic(every, nodes=nodes or SYNTHETIC_NODES)
    path = _find(spec)
    counts = _read_counts(path) if _is_sampled(path) else _event_counts(path)
    return _from_counts(path.name, counts, nodes=nodes, time_scale=time_scale, seed=seed)


def _find(spec: str) -> Path:
    if spec == "gcp" or spec.startswith("gcp-"):
        candidates = sorted(BUNDLED_TRACES.glob(f"{spec if spec != 'gcp' else 'gcp-'}*.txt"))
        if candidates:
            return candidates[0]
    return find_trace(spec)


def _is_sampled(path: Path) -> bool:
    with open(path, encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    return bool(re.match(r"\s*\d{4}-\d{2}-\d{2}\s*,", first))


def _event_counts(path: Path) -> list[tuple[float, int]]:
    """(seconds since the first event, live count) after each distinct moment."""
    events = read_trace(path)
    t0, live, out = events[0].ms, 0, []
    for event in events:
        live += 1 if event.op == "add" else -1
        at = (event.ms - t0) / 1000.0
        if out and out[-1][0] == at:
            out[-1] = (at, live)
        else:
            out.append((at, live))
    return out


def _read_counts(path: Path) -> list[tuple[float, int]]:
    """A `YYYY-MM-DD, HH:MM:SS, COUNT` file, checked line by line."""
    out: list[tuple[float, int]] = []
    t0 = None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            cells = [c.strip() for c in line.split(",")]
            if len(cells) != 3:
                raise FaultSpecError(f"{where}: expected YYYY-MM-DD, HH:MM:SS, COUNT; got {line.strip()!r}")
            try:
                moment = datetime.strptime(f"{cells[0]} {cells[1]}", "%Y-%m-%d %H:%M:%S")
            except ValueError:
                raise FaultSpecError(f"{where}: {cells[0]}, {cells[1]} is not a date and time "
                                     "(YYYY-MM-DD, HH:MM:SS)") from None
            if not cells[2].isdigit():
                raise FaultSpecError(f"{where}: the count {cells[2]!r} is not a whole number")
            t0 = t0 or moment
            at = (moment - t0).total_seconds()
            if out and at < out[-1][0]:
                raise FaultSpecError(f"{where}: {cells[0]}, {cells[1]} comes before the previous line; "
                                     "a trace is sorted by time")
            out.append((at, int(cells[2])))
    if not out:
        raise FaultSpecError(f"{path}: the trace has no samples")
    return out


def _from_counts(name: str, counts: list[tuple[float, int]], *, nodes: int | None,
                 time_scale: float, seed: int) -> Availability:
    peak = max(n for _, n in counts)
    if peak < 1:
        raise FaultSpecError(f"{name}: no node is ever live")
    scale = (nodes or peak) / peak
    rng = random.Random(seed)
    fresh = (f"node{i}" for i in range(10**9))
    live: list[str] = []
    initial: tuple[str, ...] = ()
    changes: list[Change] = []
    for at, count in counts:
        target = round(count * scale)
        added, removed = [], []
        while len(live) < target:
            added.append(next(fresh))
            live.append(added[-1])
        while len(live) > target:
            removed.append(live.pop(rng.randrange(len(live))))
        if at == 0:
            initial = tuple(live)
        elif added or removed:
            changes.append(Change(at / time_scale, tuple(added), tuple(removed)))
    return Availability(name, initial, tuple(changes), counts[-1][0] / time_scale)


def with_boot_delay(availability: Availability, boot_s: float) -> Availability:
    """The nodes as a job can use them: an added node becomes usable `boot_s` after it
    arrives (its agent starts, its worker imports torch and builds the model, then it
    asks to join); a node removed before then never joins, and its removal touches no
    job. The nodes live at the start are usable at once."""
    if boot_s <= 0:
        return availability
    ready: dict[str, float] = {}
    gone_early: set[str] = set()
    for change in availability.changes:
        for node in change.added:
            ready[node] = change.at_s + boot_s
        for node in change.removed:
            if node in ready and ready[node] > change.at_s:
                gone_early.add(node)
    events: list[tuple[float, int, Change]] = []
    for order, change in enumerate(availability.changes):
        removed = tuple(n for n in change.removed if n not in gone_early)
        if removed or (not change.added and not change.removed and change.downtime_s is not None):
            events.append((change.at_s, order, Change(change.at_s, removed=removed, downtime_s=change.downtime_s)))
        for node in change.added:
            if node not in gone_early and ready[node] <= availability.duration_s:
                events.append((ready[node], order, Change(ready[node], added=(node,), downtime_s=change.downtime_s)))
    events.sort(key=lambda e: (e[0], e[1]))
    merged: list[Change] = []
    for at, _, change in events:  # changes within a second of each other are one
        if merged and at - merged[-1].at_s <= SIMULTANEOUS_S:
            last = merged[-1]
            costs = [c for c in (last.downtime_s, change.downtime_s) if c is not None]
            added = tuple(n for n in last.added + change.added if n not in change.removed)
            removed = last.removed + tuple(n for n in change.removed if n not in last.added)
            merged[-1] = Change(last.at_s, added, removed, max(costs) if costs else None)
        else:
            merged.append(change)
    return Availability(availability.name, availability.initial, tuple(merged), availability.duration_s)
