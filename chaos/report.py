"""What a chaos run did, in numbers a person can check: the report and report.json (the
tables printed at a run's end are `planaria.chaos.report_tables`'s, the plot
`planaria.chaos.plot`'s).

Everything is read back from what the run left: the workers' commit logs
(`commits-<worker>.jsonl`: one line per committed step; `evals-<worker>.jsonl`: one line
per validation loss, with `eval.every`), the controller's account of
each reconfiguration and the workers' recovery timings (from the job's store), and the
harness's own list of injected faults. Nothing is taken on the harness's word that can
be read from the job itself.
"""
from __future__ import annotations

import statistics
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from planaria.chaos.faults import ETCD_KINDS, parse_fault
from planaria.runtime.contract.epochs import EpochEvent, EpochTiming
from planaria.runtime.contract.logs import COMMITS, EVALS, CommitEntry, EvalEntry, log_paths, read_logs


@dataclass(frozen=True)
class InjectedFault:
    """A fault as the harness injected it."""

    fault: str
    """The spec with its target resolved, e.g. kill-node@3:target=2."""
    step: int
    time: float


@dataclass
class Recovery:
    fault: str
    step: int
    detect_s: float | None
    """From the fault to the controller's detection; None: nothing to detect (an etcd
    member), or the fault struck while a reconfiguration was under way, and that one
    counted its node among the failed (`note` says so)."""
    plan_s: float | None
    """From detection (or the fault, when it joined a reconfiguration under way) to the
    next epoch's publication (statuses, decision, plan)."""
    transfer_s: float | None
    """The slowest worker's layer transfers in the new epoch."""
    total_s: float | None
    """From the fault to the first step committed in the new epoch."""
    bytes_moved: int
    epoch: int | None
    """The epoch the job recovered into."""
    plan_shape: list[int] | None = None
    """Stages of each pipeline in that epoch."""
    transfers: int = 0
    """Layer shards copied between workers to enter it."""
    source: str = ""
    """Where that epoch's layer state came from: "replicas", "memory" (peer snapshots) or
    "disk" (the checkpoint); empty when no reconfiguration followed."""
    rerun: int = 0
    """Committed steps trained again because the job went back (to a snapshot or checkpoint)."""
    note: str = ""
    rendezvous_s: float | None = None
    """From the epoch's publication to the slowest worker's process groups being up."""
    first_step_s: float | None = None
    """From the slowest worker's end of transfers to its first step committed."""
    release_s: float | None = None
    """From the controller's detection to the last survivor leaving the failed epoch (its
    blocked collectives released, or failed of themselves); 0 when every survivor had
    left it before (a dead peer's closed sockets); None: no survivor reported a failed epoch."""
    step_time_ratio: float | None = None
    """A fault that lasts (a network fault's :for=): the median time of the steps that ran
    while it lasted over the median away from every fault (a slow link's straggler shows here); None:
    no step, or no fault-free step to compare with."""
    reason: str = ""
    """How the job took it: "failure" (an iteration interrupted), "leave" (a node left
    with notice, at a step boundary) or "join"; empty when no reconfiguration followed."""
    pause_s: float | None = None
    """The pause in training at the switch: from the last step committed before the new
    epoch to its first (a step's own time included)."""
    switch_s: float | None = None
    """What the switch took from training: `pause_s` less one step of the run away from
    faults (`Report.own_step_s`), the step the pause contains. A planned leave's goal is
    one step plus its copies at most (docs/chaos.md)."""
    longest_gap_s: float | None = None
    """The longest gap between two commits from the last before the new epoch to the
    `GAP_STEPS`-th after its first: the pause, or a later step of the new epoch that the
    switch still slowed (its first steps, with what the switch left to them)."""


@dataclass
class Report:
    completed: bool
    outcome: str
    steps: int
    steps_committed: int
    max_loss_diff: float | None
    committed_steps_lost: int
    checkpoint_loads: int
    """Reconfigurations that read the disk checkpoint (some layer lost every replica and
    every peer snapshot)."""
    ettr: float | None
    wall_s: float
    recoveries: list[Recovery] = field(default_factory=list)
    memory_restores: int = 0
    """Reconfigurations that went back to a peer snapshot (some layer lost every replica)."""
    planned_leaves: int = 0
    """Reconfigurations in which nodes left with notice, at a step boundary (no iteration
    interrupted); the others that removed a node were failures."""
    interrupted: int = 0
    """Reconfigurations that began with a failure: each cut an iteration short, which ran again."""
    reference_step_s: float | None = None
    """The fault-free run's time a step on this machine (the ETTR's yardstick)."""
    own_step_s: float | None = None
    """This run's own fault-free time a step (`own_step_s`): the machine's speed during
    the run, which on a shared machine drifts from the reference's."""
    ettr_own_steps: float | None = None
    """The ETTR against `own_step_s`: what the faults cost, without that drift."""
    losses: dict[int, float] = field(default_factory=dict)
    reference_losses: dict[int, float] = field(default_factory=dict)
    max_val_loss_diff: float | None = None
    """Over every validation loss any worker logged (`eval.every`), against the reference's."""
    val_losses: dict[int, float] = field(default_factory=dict)
    reference_val_losses: dict[int, float] = field(default_factory=dict)
    commit_times: list[tuple[float, int]] = field(default_factory=list)
    """(time since the first commit, iteration) of every step, in commit order."""
    live_nodes: list[tuple[float, int]] = field(default_factory=list)
    """(time since the first commit, live nodes) as the harness sampled it."""
    training_nodes: list[tuple[float, int]] = field(default_factory=list)
    """(time of an epoch's first commit since the first commit, nodes whose workers
    committed steps in that epoch): the nodes the job's plan used."""
    first_commit_time: float | None = None
    faults: list[InjectedFault] = field(default_factory=list)
    """As injected, with their times (the plot marks them)."""

    SERIES = ("losses", "reference_losses", "commit_times", "live_nodes", "training_nodes",
              "first_commit_time", "faults", "val_losses", "reference_val_losses")

    def summary(self) -> dict:
        data = asdict(self)
        for bulky in self.SERIES:
            data.pop(bulky)
        return data


def read_commits(out_dir: Path) -> dict[str, list[CommitEntry]]:
    """Each worker's committed steps, in the order it committed them."""
    return read_logs(out_dir, COMMITS, CommitEntry)


def read_evals(out_dir: Path) -> dict[str, list[EvalEntry]]:
    """Each worker's validation losses, in the order it logged them."""
    return read_logs(out_dir, EVALS, EvalEntry)


def step_val_losses(logs: dict[str, list[EvalEntry]]) -> dict[int, float]:
    """The validation loss after each evaluated step, the first logged in time."""
    found: dict[int, float] = {}
    for e in sorted((e for entries in logs.values() for e in entries), key=lambda e: e.time):
        found.setdefault(e.step, e.val_loss)
    return found


class CommitTail:
    """How many steps the job has committed so far (the newest iteration + 1), read from
    the commit logs incrementally: a long run's logs are not parsed whole ten times a
    second."""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)
        self._offsets: dict[Path, int] = {}
        self.newest = -1

    def committed(self) -> int:
        for path in log_paths(self.out_dir, COMMITS):
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            complete = data[:data.rfind(b"\n") + 1]  # a line being written is read next time
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                if line.strip():
                    self.newest = max(self.newest, CommitEntry.from_json(line).step)
        return self.newest + 1


def step_losses(logs: dict[str, list[CommitEntry]]) -> tuple[dict[int, float], list[tuple[float, int]], int]:
    """(loss per iteration, (time, iteration) of each step's first commit, steps lost):
    a step is lost when it was committed in one epoch and committed again in a later one
    (the job went back to a checkpoint). A roll-forward is not a second commit: it applies,
    on a worker one step behind, the step its peers committed (the exactly-once rule)."""
    losses: dict[int, float] = {}
    first_commit: dict[int, float] = {}
    epochs: dict[int, set[int]] = {}
    for e in sorted((e for entries in logs.values() for e in entries), key=lambda e: e.time):
        losses.setdefault(e.step, e.loss)  # the first commit's, in time
        first_commit.setdefault(e.step, e.time)
        if not e.rolled_forward:
            epochs.setdefault(e.step, set()).add(e.epoch)
    lost = sum(len(found) - 1 for found in epochs.values())
    times = sorted((t, i) for i, t in first_commit.items())
    return losses, times, lost


def recoveries(faults: list[InjectedFault], events: list[EpochEvent], timings: dict[int, list[EpochTiming]],
               logs: dict[str, list[CommitEntry]]) -> list[Recovery]:
    """One entry per fault: the first reconfiguration the controller detected after it
    (simultaneous faults share one)."""
    stepped = sorted((e.time, e.epoch) for entries in logs.values() for e in entries if not e.rolled_forward)

    def resumed_after(fault_time: float, epoch: int) -> float | None:
        """The first step committed after the fault in that epoch or a later one (the
        epoch may itself have failed before its first step: a fault during a recovery)."""
        return next((t for t, e in stepped if t > fault_time and e >= epoch), None)
    found = []
    first_commits: dict[int, float] = {}
    in_epochs: dict[tuple[int, int], float] = {}
    """Each step's first commit in each epoch that committed it (a step trained again
    after a restore from an older checkpoint is committed in two)."""
    for entries in logs.values():
        for e in entries:
            first_commits[e.step] = min(first_commits.get(e.step, e.time), e.time)
            if not e.rolled_forward:
                in_epochs[e.step, e.epoch] = min(in_epochs.get((e.step, e.epoch), e.time), e.time)
    ratios = _step_time_ratios(faults, sorted(first_commits.values()))
    step_commits = sorted((t, epoch) for (_, epoch), t in in_epochs.items())
    commit_times = sorted(t for t, _ in stepped)
    for fault in faults:
        event = _handling_event(fault, events)
        kind = parse_fault(fault.fault).kind
        if kind in UNSEEN_KINDS:
            note = "etcd member: no reconfiguration needed" if kind in ETCD_KINDS else "no reconfiguration needed"
            found.append(Recovery(fault.fault, fault.step, None, None, None, None, 0, None, note=note,
                                  step_time_ratio=ratios.get(fault)))
            continue
        if event is None:
            note = ("the job ended before the node joined" if fault.fault.startswith("add-node")
                    else "no reconfiguration followed")
            found.append(Recovery(fault.fault, fault.step, None, None, None, None, 0, None, note=note))
            continue
        epoch = event.epoch
        worker_timings = timings.get(epoch, [])
        transfers = [t.transfer_s - t.rendezvous_s for t in worker_timings
                     if t.transfer_s is not None and t.rendezvous_s is not None]
        resumed = resumed_after(fault.time, epoch)
        # Measured by the receivers; a receiver that died in that epoch never reported,
        # and then the planner's count of the bytes its transfers carry stands in.
        received = sum(t.bytes_received for t in worker_timings)
        moved = received if received or not event.transfers else event.moved_bytes
        rendezvous = [t.rendezvous_s - event.published_s for t in worker_timings if t.rendezvous_s is not None]
        first_steps = [t.first_step_s - t.transfer_s for t in worker_timings
                       if t.first_step_s is not None and t.transfer_s is not None]
        # The survivors: whoever left the failed epoch before the next one was published (a
        # node cut off and declared failed leaves it only when its network comes back).
        left = [t.failed_s for t in timings.get(epoch - 1, [])
                if t.failed_s is not None and t.failed_s <= event.published_s]
        # A fault that struck while this reconfiguration was under way was not what it
        # detected: no detection time, and its plan time counts from the fault.
        under_way = event.detected_s < fault.time
        found.append(Recovery(
            fault.fault, fault.step, detect_s=None if under_way else event.detected_s - fault.time,
            plan_s=event.published_s - max(event.detected_s, fault.time),
            transfer_s=max(transfers) if transfers else None,
            total_s=None if resumed is None else resumed - fault.time,
            bytes_moved=moved, epoch=epoch, plan_shape=list(event.plan_shape),
            transfers=event.transfers, source=event.source, rerun=event.rerun,
            note=_note(fault, event, epoch, under_way),
            rendezvous_s=max(rendezvous) if rendezvous else None,
            first_step_s=max(first_steps) if first_steps else None,
            release_s=max(0.0, max(left) - event.detected_s) if left and not under_way else None,
            step_time_ratio=ratios.get(fault), reason=event.reason,
            pause_s=_pause(commit_times, event.published_s, resumed),
            longest_gap_s=longest_commit_gap(step_commits, epoch, resumed)))
    return found


def _note(fault, event, epoch: int, under_way: bool) -> str:
    """What the reconfiguration did beyond its figures: took in a fault that struck while
    it was under way; waited for nodes out of reach that held layers nobody else had."""
    notes = []
    if under_way:
        notes.append(f"{'arrived' if fault.fault.startswith('add-node') else 'struck'} while the "
                     f"reconfiguration to epoch {epoch} was under way; it took this in")
    if event.cut_wait_s is not None:
        notes.append(f"waited {event.cut_wait_s:.1f} s for nodes out of reach that held layers nobody else "
                     "had, rather than train steps again")
    return "; ".join(notes)


def _pause(commit_times: list[float], published_s: float, resumed: float | None) -> float | None:
    """From the last commit before the epoch's publication to the first after it."""
    before = [t for t in commit_times if t <= published_s]
    return None if resumed is None or not before else resumed - before[-1]


GAP_STEPS = 5
"""How many commits of a new epoch after its first `Recovery.longest_gap_s` looks at."""


def longest_commit_gap(steps: list[tuple[float, int]], epoch: int, resumed: float | None) -> float | None:
    """The longest gap between the commits of consecutive steps (`steps`: each step's
    first commit in an epoch, and that epoch, in order) from the last one before `epoch`, the new
    epoch, to the `GAP_STEPS`-th after the new epoch's first (fewer at the job's end)."""
    before = [t for t, e in steps if e < epoch and (resumed is None or t < resumed)]
    if resumed is None or not before:
        return None
    # The steps of the epoch it resumed in only: a second fault within them is its own.
    resumed_in = next((e for t, e in steps if t == resumed), epoch)
    after = [t for t, e in steps if e == resumed_in and t >= resumed][:GAP_STEPS + 1]
    times = [before[-1], *after]
    return max(b - a for a, b in zip(times, times[1:]))


UNSEEN_KINDS = ("kill-etcd-member", "isolate-etcd-member", "slow-link")
"""Faults the job must ride out without a reconfiguration: a later one is another
fault's, and is not credited to them."""


def _step_time_ratios(faults: list[InjectedFault], commit_times: list[float]) -> dict[InjectedFault, float]:
    """For each fault that lasts: the median time of the steps that ran while it lasted
    (in part: a step slowed by a 10 s fault may take longer than 10 s) over the median of
    the steps away from every fault (`commit_times`: each step's first
    commit, in order)."""
    spans = {f: parse_fault(f.fault).duration_s for f in faults}
    steps = list(zip(commit_times, commit_times[1:]))
    calm = [b - a for a, b in steps if _clear_of(fault_spans(faults), a, b, QUIET_S)]
    if not calm:
        return {}
    found = {}
    for fault, duration in spans.items():
        during = [b - a for a, b in steps if duration and b > fault.time and a < fault.time + duration]
        if during:
            found[fault] = statistics.median(during) / statistics.median(calm)
    return found


def _handling_event(fault: InjectedFault, events: list[EpochEvent]) -> EpochEvent | None:
    """The reconfiguration that took `fault` in: the first one detected after it, or an
    earlier one, already under way when the fault struck (collecting statuses, say),
    that counted the fault's node among the failed before it published its plan. A node
    added is taken in by the reconfiguration that lists it among the joined, which may be
    one that a failure started before the node arrived."""
    spec = parse_fault(fault.fault)
    node = None if spec.node is None else f"node{spec.node}"
    joining = spec.kind == "add-node" and node is not None
    ordered = sorted(events, key=lambda ev: ev.epoch)
    # The one that names the node wins over any that merely came after the fault: under
    # random faults and trace replay a join handled in between would otherwise take the
    # credit (and a bogus detection time) for a kill. A preempted node is named among
    # those that left (with notice), or among the failed (its notice was too short).
    for ev in ordered:
        listed = ev.joined if joining else ev.failed + ev.left
        if ev.published_s >= fault.time and node in {w.split(".")[0].split("~")[0] for w in listed}:
            return ev
    if joining:
        return None
    return next((ev for ev in ordered if ev.detected_s >= fault.time), None)


def build_report(*, out_dir: Path, steps: int, outcome: str, faults: list[InjectedFault],
                 events: list[EpochEvent], timings: dict[int, list[EpochTiming]], reference: dict,
                 live_nodes: list[tuple[float, int]], wall_s: float) -> Report:
    logs = read_commits(out_dir)
    losses, times, lost = step_losses(logs)
    ref_losses = {int(k): v for k, v in reference["losses"].items()}
    # Every commit of a step counts, a step run again after a rollback too: it must
    # equal the reference as much as the first one did.
    diffs = [abs(e.loss - ref_losses[e.step]) for entries in logs.values() for e in entries
             if e.step in ref_losses]
    evals = read_evals(out_dir)
    ref_val = {int(k): v for k, v in reference.get("val_losses", {}).items()}
    val_diffs = [abs(e.val_loss - ref_val[e.step]) for entries in evals.values() for e in entries
                 if e.step in ref_val]
    start = times[0][0] if times else 0.0
    last = times[-1][0] - start if times else 0.0
    own = own_step_s([t for t, _ in times], fault_spans(faults)) if times else None
    ettr = ettr_against(len(losses), last, reference["step_s"]) if times and reference.get("step_s") else None
    ettr_own = ettr_against(len(losses), last, own) if own else None
    return Report(
        completed=outcome == "ok" and len(losses) == steps, outcome=outcome, steps=steps,
        steps_committed=len(losses), max_loss_diff=max(diffs) if diffs else None,
        committed_steps_lost=lost,
        checkpoint_loads=sum(1 for ev in events if ev.source == "disk"),
        memory_restores=sum(1 for ev in events if ev.source == "memory"),
        planned_leaves=sum(1 for ev in events if ev.reason == "leave"),
        interrupted=sum(1 for ev in events if ev.reason == "failure"),
        ettr=ettr, wall_s=wall_s, recoveries=[
            r if r.pause_s is None or own is None else replace(r, switch_s=r.pause_s - own)
            for r in recoveries(faults, events, timings, logs)],
        reference_step_s=reference.get("step_s"), own_step_s=own, ettr_own_steps=ettr_own,
        losses=losses, reference_losses=ref_losses,
        max_val_loss_diff=max(val_diffs) if val_diffs else None, val_losses=step_val_losses(evals),
        reference_val_losses=ref_val,
        commit_times=[(t - start, i) for t, i in times],
        live_nodes=[(t - start, n) for t, n in live_nodes], training_nodes=training_nodes(logs, start),
        first_commit_time=times[0][0] if times else None, faults=list(faults))


QUIET_S = 20.0
"""Steps that begin this long after a fault or later are past its recovery's effects."""


def fault_spans(faults: list[InjectedFault]) -> list[tuple[float, float]]:
    """(start, end) of each fault: a network fault lasts its `:for=`, the others an instant."""
    return [(f.time, f.time + (parse_fault(f.fault).duration_s or 0.0)) for f in faults]


def own_step_s(commit_times: list[float], faults: list[float | tuple[float, float]],
               quiet_s: float = QUIET_S) -> float | None:
    """A run's own fault-free step time: the mean time between commits over the steps that
    begin at least `quiet_s` after every fault before them has ended (`faults`: moments,
    or (start, end) spans) and end before the next one begins (checkpoint pauses
    included, as in the reference's step time). None when no step is that far from
    every fault."""
    spans = [f if isinstance(f, tuple) else (f, f) for f in faults]
    quiet = [end - begin for begin, end in zip(commit_times, commit_times[1:])
             if _clear_of(spans, begin, end, quiet_s)]
    return sum(quiet) / len(quiet) if quiet else None


def _clear_of(spans: list[tuple[float, float]], begin: float, end: float, quiet_s: float) -> bool:
    return all(end < start or begin >= stop + quiet_s for start, stop in spans)


def ettr_against(steps: int, last_commit_s: float, step_s: float) -> float:
    """Effective training time ratio: `steps` of `step_s` each over the time from the
    first commit to the end of the last step (`last_commit_s` after the first, plus one)."""
    return min(1.0, steps * step_s / (last_commit_s + step_s))


def training_nodes(logs: dict[str, list[CommitEntry]], start: float) -> list[tuple[float, int]]:
    """Per epoch, in order: (its first commit, since `start`; the nodes that committed in it)."""
    first: dict[int, float] = {}
    nodes: dict[int, set[str]] = {}
    for worker, entries in logs.items():
        for e in entries:
            if e.rolled_forward:
                continue
            first[e.epoch] = min(first.get(e.epoch, e.time), e.time)
            nodes.setdefault(e.epoch, set()).add(worker.rsplit(".", 1)[0])
    return [(first[e] - start, len(nodes[e])) for e in sorted(first, key=first.get)]


def write_json_atomically(path: Path, data) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def write_report(report: Report, out_dir: Path) -> Path:
    """report.json (the summary and the per-step series: enough to draw the plot again),
    atomically."""
    data = report.summary()
    series = asdict(report)
    data["series"] = {name: series[name] for name in Report.SERIES}
    path = Path(out_dir) / "report.json"
    write_json_atomically(path, data)
    return path


def load_report(path: Path) -> Report:
    """A report as `write_report` wrote it (to redraw its plot, say)."""
    data = json.loads(Path(path).read_text())
    series = data.pop("series")
    recoveries = [Recovery(**r) for r in data.pop("recoveries")]
    return Report(**data, recoveries=recoveries,
                  losses={int(k): v for k, v in series["losses"].items()},
                  reference_losses={int(k): v for k, v in series["reference_losses"].items()},
                  commit_times=[tuple(x) for x in series["commit_times"]],
                  live_nodes=[tuple(x) for x in series["live_nodes"]],
                  training_nodes=[tuple(x) for x in series.get("training_nodes", [])],
                  first_commit_time=series.get("first_commit_time"),
                  faults=[InjectedFault(**f) for f in series.get("faults", [])],
                  val_losses={int(k): v for k, v in series.get("val_losses", {}).items()},
                  reference_val_losses={int(k): v for k, v in series.get("reference_val_losses", {}).items()})
