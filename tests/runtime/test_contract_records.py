"""Every record that crosses a process boundary (planaria.runtime.contract) round-trips
exactly through JSON, and one written with another field set is read or refused by name.

Property tests (hypothesis) over random records of every type: what a writer's
`to_json` gives, a reader's `from_json` turns back into an equal record (floats to the
bit, NaN and infinities included, tuples as tuples, a plan as the same plan). A record
written by an older version, one field short, is read with that field's default or
refused with a message naming the record and the field; one written by a newer version,
with a field this one does not know, is refused naming that field.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planaria.runtime.contract.checkpoint_layout import CheckpointManifest
from planaria.runtime.contract.epochs import EpochEvent, EpochRecord, EpochTiming, Progress
from planaria.runtime.contract.exactly_once import STATES, CommitRecord, SnapshotHeld, WorkerStatus
from planaria.runtime.contract.logs import (AuditEntry, CommitEntry, EpochStep, EvalEntry, MetricsEntry, Mismatch,
                                            StepEntry)
from planaria.runtime.contract.membership import Announcement, JobSpec, LeaveNotice, NodeRegistration, Waiting
from planaria.runtime.contract.record import RecordError
from planaria.templates.layout import plan_from_layout
from planaria.templates.plan import Transfer
from tests.templates.plan_cases import layout_args

FAST = settings(max_examples=80, deadline=None)

steps = st.integers(-1, 10**12)
counts = st.integers(0, 2**62)
anything_float = st.floats(allow_nan=True, allow_infinity=True)
seconds = st.floats(0, 4e9, allow_nan=False)
names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
node_names = st.from_regex(r"[a-z][a-z0-9.-]{0,10}", fullmatch=True)
workers = st.tuples(node_names, st.integers(0, 7))
maybe = lambda strategy: st.none() | strategy  # noqa: E731
small_tuples = lambda strategy: st.lists(strategy, max_size=4).map(tuple)  # noqa: E731

commits = st.builds(CommitRecord, iteration=steps, loss=anything_float, grad_norm=anything_float)
shards = small_tuples(st.tuples(st.integers(0, 99), st.integers(0, 7)))
snapshots_held = st.builds(SnapshotHeld, commit=commits, epoch=st.integers(0, 10**6), shards=shards)


@st.composite
def worker_statuses(draw):
    last = draw(steps)
    commit = draw(maybe(st.builds(CommitRecord, iteration=st.just(last), loss=anything_float,
                                  grad_norm=anything_float)))
    return WorkerStatus(worker=draw(workers), last_stepped=last, state=draw(st.sampled_from(STATES)),
                        commit=commit, holds=draw(shards), finished=draw(st.booleans()),
                        snapshots=draw(small_tuples(snapshots_held)))


@st.composite
def epoch_records(draw):
    plan = plan_from_layout(**draw(layout_args()))
    transfers = draw(small_tuples(st.builds(Transfer, layer=st.integers(0, 99), tp_rank=st.integers(0, 7),
                                            src=workers, dst=workers)))
    return EpochRecord(plan, roll_forward=draw(maybe(commits)), transfers=transfers,
                       restore=draw(maybe(names)), snapshot=draw(maybe(snapshots_held)),
                       leaving=draw(small_tuples(node_names)))


RECORDS = {
    CommitRecord: commits,
    SnapshotHeld: snapshots_held,
    WorkerStatus: worker_statuses(),
    EpochRecord: epoch_records(),
    EpochEvent: st.builds(
        EpochEvent, epoch=st.integers(0, 10**6), reason=st.sampled_from(["failure", "join", "leave"]),
        detected_s=seconds, statuses_s=seconds, planned_s=seconds, published_s=seconds,
        failed=small_tuples(names), joined=small_tuples(names), first_iteration=steps,
        rolled_forward=maybe(steps), transfers=counts, restored=maybe(steps), moved_bytes=counts,
        plan_shape=small_tuples(st.integers(1, 64)), cut_off=small_tuples(names), snapshot=maybe(steps),
        rerun=counts, left=small_tuples(names), handed_off=counts, cut_wait_s=maybe(seconds)),
    EpochTiming: st.builds(
        EpochTiming, record_s=seconds, rendezvous_s=maybe(seconds), transfer_s=maybe(seconds),
        first_step_s=maybe(seconds), failed_s=maybe(seconds), error=maybe(names), bytes_received=counts,
        bytes_sent=counts, transfer_seconds=maybe(seconds)),
    CheckpointManifest: st.builds(CheckpointManifest, iteration=steps, loss=anything_float,
                                  grad_norm=anything_float, num_layers=st.integers(1, 200),
                                  tp=st.integers(1, 8)),
    Announcement: st.builds(Announcement, pid=st.integers(1, 2**22)),
    NodeRegistration: st.builds(NodeRegistration, gpus=st.integers(1, 8), agent=names),
    LeaveNotice: st.builds(LeaveNotice, source=names, deadline=seconds, posted=seconds),
    Waiting: st.builds(Waiting, since=seconds, nodes=st.integers(0, 10**5), needs=st.integers(1, 10**5),
                       limit_s=seconds),
    Progress: st.builds(Progress, epoch=st.integers(0, 10**6), step=steps, time_s=seconds, step_s=seconds),
    JobSpec: st.builds(JobSpec, config=names, overrides=small_tuples(names)),
    MetricsEntry: st.builds(MetricsEntry, step=steps, loss=anything_float, grad_norm=anything_float,
                            lr=st.floats(0, 1), tokens=counts, step_time_s=seconds, time=seconds,
                            val_loss=maybe(anything_float)),
    CommitEntry: st.builds(CommitEntry, step=steps, loss=anything_float, grad_norm=anything_float,
                           epoch=st.integers(0, 10**6), time=seconds, rolled_forward=st.booleans(),
                           step_time_s=maybe(seconds)),
    EvalEntry: st.builds(EvalEntry, step=steps, val_loss=anything_float, epoch=st.integers(0, 10**6),
                         time=seconds),
    Mismatch: st.builds(Mismatch, layer=st.integers(0, 99), tp_rank=st.integers(0, 7),
                        majority=small_tuples(st.integers(0, 64)), minority=small_tuples(st.integers(0, 64)),
                        repaired=st.booleans()),
    AuditEntry: st.builds(AuditEntry, step=steps, layer=st.integers(0, 99), tp_rank=st.integers(0, 7),
                          majority=small_tuples(st.integers(0, 64)), minority=small_tuples(st.integers(0, 64)),
                          repaired=st.booleans()),
}
any_record = st.one_of(*RECORDS.values())


def same(a, b) -> bool:
    """Equal, with NaN equal to NaN (a diverged loss is still a loss to report)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_every_contract_record_has_a_strategy():
    # A record added to the contract without a strategy here would go untested.
    import planaria.runtime.contract as contract
    import pkgutil
    import importlib
    from planaria.runtime.contract.record import JsonRecord

    found = set()
    for info in pkgutil.iter_modules(contract.__path__):
        module = importlib.import_module(f"planaria.runtime.contract.{info.name}")
        found |= {v for v in vars(module).values()
                  if isinstance(v, type) and issubclass(v, JsonRecord)
                  and v not in (JsonRecord, StepEntry, EpochStep)}  # bases, never written alone
    assert found == set(RECORDS)


@FAST
@given(any_record)
def test_a_record_round_trips_exactly_through_json(record):
    text = record.to_json()
    back = type(record).from_json(text)
    assert same(back, record)
    assert back.to_json() == text
    if "nan" not in text.lower() and "infinity" not in text.lower():
        assert back == record


@FAST
@given(any_record, st.data())
def test_a_record_one_field_short_is_read_with_its_default_or_refused_by_name(record, data):
    cls = type(record)
    written = json.loads(record.to_json())
    if not written:
        return
    dropped = data.draw(st.sampled_from(sorted(written)))
    del written[dropped]
    spec = {f.name: f for f in dataclasses.fields(cls)}[dropped]
    has_default = spec.default is not dataclasses.MISSING or spec.default_factory is not dataclasses.MISSING
    if has_default:
        back = cls.from_dict(written)
        default = spec.default if spec.default is not dataclasses.MISSING else spec.default_factory()
        assert same(getattr(back, dropped), default)
    else:
        with pytest.raises(RecordError, match=rf"{cls.__name__}\.{dropped}: missing"):
            cls.from_dict(written)


@FAST
@given(any_record, st.from_regex(r"[a-z_]{1,12}", fullmatch=True))
def test_a_field_this_version_does_not_know_is_refused_by_name(record, extra):
    written = json.loads(record.to_json())
    if extra in written or extra in type(record).renamed:
        return
    written[extra] = 1
    with pytest.raises(RecordError, match=rf"{type(record).__name__}\.{extra}: unknown field"):
        type(record).from_dict(written)


def test_logs_of_earlier_versions_say_iteration_and_are_read_as_step():
    old = '{"iteration": 7, "loss": 2.5, "grad_norm": 1.0, "epoch": 2, "time": 1.5}'
    assert CommitEntry.from_json(old) == CommitEntry(step=7, loss=2.5, grad_norm=1.0, epoch=2, time=1.5)
    assert EvalEntry.from_json('{"iteration": 3, "val_loss": 4.0, "epoch": 0, "time": 2.0}').step == 3


@pytest.mark.parametrize("text, message", [
    ('{"iteration": "7", "loss": 1.0, "grad_norm": 1.0}', r"CommitRecord\.iteration: Input should be a valid integer"),
    ('{"worker": ["a", 0], "last_stepped": 1, "state": "done"}', r"WorkerStatus\.state: Input should be 'synced' or"),
    ('[1, 2]', r"a CommitRecord record must be a JSON object, got list"),
    ('{"iteration": 1,', r"a CommitRecord record is not valid JSON"),
])
def test_a_malformed_record_is_refused_naming_what_is_wrong(text, message):
    cls = WorkerStatus if "worker" in text else CommitRecord
    with pytest.raises(RecordError, match=message):
        cls.from_json(text)


def test_a_worker_status_that_contradicts_itself_is_refused():
    with pytest.raises(RecordError, match="reports the commit record of 3"):
        WorkerStatus.from_json(json.dumps({"worker": ["a", 0], "last_stepped": 4, "state": "synced",
                                           "commit": {"iteration": 3, "loss": 1.0, "grad_norm": 1.0}}))


def test_an_epoch_record_carries_the_plan_contracts_own_validation():
    record = EpochRecord(plan_from_layout(layout=[[2, 2]], n_blocks=4, tp=1, schedule="1f1b",
                                          virtual_stages=1, global_batch=2, micro_batch=1))
    written = json.loads(record.to_json())
    written["plan"]["schedule"] = "zigzag"
    with pytest.raises(RecordError, match="schedule 'zigzag' is unknown"):
        EpochRecord.from_dict(written)


def _record_moving_every_layer(nodes: int) -> EpochRecord:
    """A re-plan of `nodes` nodes of 8 workers in which every worker receives the 4 layers
    of its new stage from 4 others: an epoch record's transfers when nearly every layer
    moves (a re-cut into deeper pipelines)."""
    plan = plan_from_layout(layout=[[2, 2]], n_blocks=4, tp=1, schedule="1f1b", virtual_stages=1,
                            global_batch=2, micro_batch=1)
    workers = [(f"node{n:04d}", local) for n in range(nodes) for local in range(8)]
    transfers = tuple(Transfer(layer=i % 80, tp_rank=i % 8, src=workers[(i + 8 * (i % 4 + 1)) % len(workers)],
                               dst=workers[i // 4]) for i in range(4 * len(workers)))
    return EpochRecord(plan, transfers=transfers)


def test_transfers_are_written_compactly_and_the_earlier_form_is_still_read():
    record = _record_moving_every_layer(512)
    written = json.loads(record.to_json())
    assert set(written["transfers"]) == {"workers", "shards"} and len(written["transfers"]["shards"]) == 16384
    earlier = dict(written, transfers=[{"layer": t.layer, "tp_rank": t.tp_rank, "src": list(t.src),
                                        "dst": list(t.dst)} for t in record.transfers])
    assert EpochRecord.from_dict(earlier) == EpochRecord.from_json(record.to_json()) == record
    # Less than half the bytes of an object per transfer: what keeps a re-plan of a
    # thousand nodes that moves every layer within etcd's request limit.
    assert len(record.to_json()) < 0.45 * len(json.dumps(earlier, sort_keys=True))


@pytest.mark.parametrize("transfers, message", [
    ({"workers": [["node0", 0]]}, "transfers must be"),
    ({"workers": [["node0", 0]], "shards": [[1, 0, 0, 3]]}, "expected an integer from 0 to 0"),
    ({"workers": [["node0", 0], ["node1", 0]], "shards": [[1, 0, -1, 0]]}, "expected an integer from 0 to 1"),
    ({"workers": [["node0", 0]], "shards": [[-1, 0, 0, 0]]}, "expected an integer"),
    ({"workers": [["node0", 0]], "shards": [[1, 0, 0]]}, "not a list of transfers"),
    ([{"layer": 1, "tp_rank": 0, "src": ["node0", 0], "dst": ["node1", 0], "bytes": 9}], "each is"),
    ({"workers": [["node0", "0"]], "shards": [[1, 0, 0, 0]]}, "expected an integer"),
    ({"workers": [[0, 0]], "shards": []}, "a worker is"),
    ({"workers": [["node0", 0]], "shards": [[1.5, 0, 0, 0]]}, "expected an integer"),
    ([{"layer": 1, "tp_rank": 0, "src": ["node0", 0]}], "each is"),
])
def test_malformed_transfers_are_refused(transfers, message):
    written = json.loads(_record_moving_every_layer(1).to_json())
    with pytest.raises(RecordError, match=message):
        EpochRecord.from_dict(dict(written, transfers=transfers))
