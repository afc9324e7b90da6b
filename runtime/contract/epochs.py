"""The records of an epoch: what the controller publishes, and what workers report back.

- `EpochRecord`: the plan of an epoch and what survivors do before it starts (written
  by the leader's controller, read by every worker);
- `EpochEvent`: the controller's account of one reconfiguration (read by the chaos
  harness, its report and the benchmarks);
- `EpochTiming`: when each of a worker's recovery phases ended (read by the same).

Times are wall-clock seconds (`time.time()`): they are compared across processes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import PlainSerializer, PlainValidator

from planaria.runtime.contract.exactly_once import CommitRecord, SnapshotHeld
from planaria.runtime.contract.record import JsonRecord, RecordError
from planaria.templates.plan import Plan, Transfer


def _plan_from_json(value) -> Plan:
    if isinstance(value, Plan):
        return value
    if not isinstance(value, dict):
        raise RecordError(f"a plan must be a JSON object, got {type(value).__name__}")
    return Plan.from_dict(value)  # the plan contract's own reader and validation


PlanField = Annotated[Plan, PlainValidator(_plan_from_json), PlainSerializer(Plan.to_dict)]
"""A Plan in a record, in `Plan.to_dict`'s form (the plan contract owns its JSON)."""


def _transfers_to_json(transfers: tuple[Transfer, ...]) -> dict:
    """{"workers": each worker once, "shards": [layer, tp rank, source, destination] with
    the workers as indexes into it}: a third of the bytes of an object per transfer. A
    re-plan that moves nearly every layer of a thousand nodes lists tens of thousands of
    transfers, in a record that etcd takes in one request of at most 1.5 MiB."""
    index: dict = {}
    for t in transfers:
        index.setdefault(t.src, len(index))
        index.setdefault(t.dst, len(index))
    return {"workers": [list(w) for w in index],
            "shards": [[t.layer, t.tp_rank, index[t.src], index[t.dst]] for t in transfers]}


def _transfers_from_json(value) -> tuple[Transfer, ...]:
    """`_transfers_to_json`'s form, or the earlier one of an object per transfer."""
    if isinstance(value, (tuple, list)) and all(isinstance(t, Transfer) for t in value):
        return tuple(value)
    try:
        if isinstance(value, list):
            if any(set(t) != {"layer", "tp_rank", "src", "dst"} for t in value):
                raise RecordError("transfers: each is {layer, tp_rank, src, dst}")
            return tuple(Transfer(layer=_int(t["layer"]), tp_rank=_int(t["tp_rank"]), src=_worker(t["src"]),
                                  dst=_worker(t["dst"])) for t in value)
        if not isinstance(value, dict) or set(value) != {"workers", "shards"}:
            raise RecordError('transfers must be {"workers": [...], "shards": [...]}')
        workers = [_worker(w) for w in value["workers"]]
        at = lambda i: workers[_int(i, below=len(workers))]  # noqa: E731
        return tuple(Transfer(layer=_int(layer), tp_rank=_int(tp), src=at(src), dst=at(dst))
                     for layer, tp, src, dst in value["shards"])
    except RecordError:
        raise
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise RecordError(f"transfers: not a list of transfers ({type(err).__name__}: {err})") from None


def _int(value, below: int | None = None) -> int:
    """A non-negative integer (below `below`, an index into the workers, when given)."""
    if type(value) is not int or value < 0 or (below is not None and value >= below):
        raise RecordError(f"transfers: expected an integer from 0{f' to {below - 1}' if below is not None else ''}, "
                          f"got {value!r}")
    return value


def _worker(value) -> tuple[str, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not isinstance(value[0], str):
        raise RecordError(f"transfers: a worker is [node, local rank], got {value!r}")
    return value[0], _int(value[1])


TransfersField = Annotated[tuple[Transfer, ...], PlainValidator(_transfers_from_json),
                           PlainSerializer(_transfers_to_json)]
"""An epoch's transfers in a record, in `_transfers_to_json`'s compact form."""


@dataclass(frozen=True)
class EpochRecord(JsonRecord):
    """An epoch's plan and what survivors do before it starts."""

    plan: PlanField
    roll_forward: CommitRecord | None = None
    """Workers one step behind apply this committed step first (exactly-once rule)."""
    transfers: TransfersField = field(default=())
    """Layer shards to copy from holders to the workers that lack them."""
    restore: str | None = None
    """A checkpoint directory every worker loads its layers from (some layer lost every
    replica and every peer snapshot); the plan then starts right after the checkpoint's
    iteration."""
    snapshot: SnapshotHeld | None = None
    """Some layer lost every replica: every worker drops its layers and takes the plan's
    from the peer snapshots of this step (its own, or sent by `transfers`' sources); the
    plan then starts right after it."""
    leaving: tuple[str, ...] = ()
    """Nodes that leave with notice (`keys.LEAVE`): in no plan any more, their workers
    send the layers whose only holders they are (the `transfers` from them, over a group
    of their own: `planaria.runtime.state.transfer.exchange_handoff`), then exit."""
    connect_ahead: bool = False
    """Set on a join's prepared record (`keys.epoch_prepared`): its workers, the
    survivors still training and the joiners, connect its process groups before the
    stop (`planaria.runtime.parallel.prepared_groups`); a survivor lets the epoch in
    force stop only once they are connected, so that the switch holds no rendezvous."""


Reason = Literal["failure", "join", "leave"]


@dataclass(frozen=True)
class EpochEvent(JsonRecord):
    """What happened at one reconfiguration, for reports and benchmarks."""

    epoch: int
    reason: Reason
    detected_s: float
    """When the controller saw the change."""
    statuses_s: float
    """When every live worker's status was in (or the silent ones were given up)."""
    planned_s: float
    published_s: float
    """When the epoch's record was published (workers may start)."""
    failed: tuple[str, ...] = ()
    """Workers ("node.local") of the old plan that did not report."""
    joined: tuple[str, ...] = ()
    first_iteration: int = 0
    rolled_forward: int | None = None
    """The iteration survivors one step behind applied first, if any."""
    transfers: int = 0
    """Layer shards copied between workers."""
    restored: int | None = None
    """The checkpoint's iteration, when the job went back to one (read from disk)."""
    snapshot: int | None = None
    """The step restored from peer snapshots (host memory), when some layer lost every
    replica and the job went back to it instead of to the disk checkpoint."""
    moved_bytes: int = 0
    """The planner's estimate of the layer state the transfers move."""
    plan_shape: tuple[int, ...] = ()
    """Stages of each pipeline of the new plan."""
    cut_off: tuple[str, ...] = ()
    """Nodes alive but left out because they could not reach the planned ones (a partition)."""
    rerun: int = 0
    """Committed steps the job trains again (it went back to a snapshot or a checkpoint)."""
    left: tuple[str, ...] = ()
    """Nodes that left with notice (a planned leave)."""
    handed_off: int = 0
    """Layer shards the leaving nodes sent before they left (no other holder had them)."""
    cut_wait_s: float | None = None
    """Seconds the job waited for nodes out of reach that held layers nobody reachable
    had (a cut is not a death: `planaria.elastic.cut_wait`), when it did."""

    @property
    def source(self) -> str:
        """Where the next plan's layer state came from: "replicas" (the survivors' own and
        copies between them), "memory" (peer snapshots) or "disk" (the checkpoint)."""
        if self.restored is not None:
            return "disk"
        return "memory" if self.snapshot is not None else "replicas"


@dataclass(frozen=True)
class EpochTiming(JsonRecord):
    """A worker's account of one epoch: when each phase ended (absent: not reached)."""

    record_s: float
    """It read the epoch's record."""
    rendezvous_s: float | None = None
    """Its process groups were up and every rank was in the epoch (its ranks agreed on its
    first iteration: `Engine.agreed_s`)."""
    transfer_s: float | None = None
    """It held every layer of the plan (transfers, a restore, or nothing to do)."""
    first_step_s: float | None = None
    """Its first step of the epoch committed."""
    failed_s: float | None = None
    error: str | None = None
    """The first line of what ended the epoch on this worker, when it failed."""
    bytes_received: int = 0
    bytes_sent: int = 0
    transfer_seconds: float | None = None
    """How long its layer exchange took."""


@dataclass(frozen=True)
class Progress(JsonRecord):
    """How far the job is (`keys.PROGRESS`), written by the plan's rank 0 about once a
    second off its step: the controller estimates from it how long a planned leave takes,
    and `planaria status` shows it."""

    epoch: int
    step: int
    """The last committed iteration."""
    time_s: float
    """When it was committed (wall clock)."""
    step_s: float
    """The median time of the recent steps."""
