"""What the simulated workers of an epoch derive from its record, derived once for all.

A real worker parses its epoch's record and derives its rank and the epoch's groups on
a CPU of its own. At 1,024 nodes of 8 that is some 0.2 s of Python a worker (the JSON
of a 123 KiB record, 123 ms; the rank table, 14 ms; the groups' creation order, 3,104
groups, 45 ms): nothing beside a real worker's start, but 27 minutes of the harness's
one Python core for 8,192 simulated workers, which would measure the harness instead of
the control plane. So the harness parses each record once and every simulated worker
shares the result. Their requests are untouched: each still reads its record through
its own store (`SharedRecordCoordinator` only replaces the parse).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from planaria.runtime.contract.epochs import EpochRecord
from planaria.runtime.parallel.groups import creation_order
from planaria.runtime.worker.coordination import StoreCoordinator
from planaria.templates.plan import Plan, Worker


@dataclass(frozen=True)
class PlanFacts:
    """What a simulated worker asks of its epoch's plan."""

    rank_of_worker: dict[Worker, int]
    groups: list[tuple[int, ...]]
    """Every group the epoch's ranks create, in creation order (`creation_order`)."""
    nodes: int


class SharedRecords:
    """Each record parsed once, and each epoch's plan facts derived once (thread-safe)."""

    def __init__(self, tied_layers: tuple[int, ...] = ()):
        self.tied_layers = tied_layers
        self._lock = threading.Lock()
        self._records: dict[tuple[int, int], EpochRecord] = {}
        self._facts: dict[tuple[int, int], PlanFacts] = {}
        self._starting: dict[tuple[int, int], tuple[EpochRecord, EpochRecord]] = {}

    def record(self, value: bytes) -> EpochRecord:
        key = (len(value), hash(value))
        with self._lock:
            found = self._records.get(key)
        if found is None:
            found = EpochRecord.from_json(value)
            with self._lock:
                found = self._records.setdefault(key, found)
        return found

    def starting_at(self, record: EpochRecord, first: int) -> EpochRecord:
        """`record` (a prepared one, parsed once: `record`) with its plan starting at `first`,
        made once for every worker that asks: each worker's own copy of a plan derived its
        rank table afresh (8,192 ranks, for each of 8,192 workers, all through the one
        lock of a `cached_property` in this Python), which held a join at 1,024 nodes for
        minutes."""
        key = (id(record), first)
        with self._lock:
            found = self._starting.get(key)
        if found is None:
            made = replace(record, plan=replace(record.plan, first_iteration=first))
            with self._lock:
                found = self._starting.setdefault(key, (record, made))  # (holds `record`: its id stays its)
        return found[1]

    def facts(self, epoch: int, plan: Plan) -> PlanFacts:
        """The facts of `epoch`'s plan (a prepared record's plan, whose first iteration each
        worker sets, has the same ranks and groups)."""
        key = (epoch, plan.world_size)
        with self._lock:
            found = self._facts.get(key)
        if found is None:
            found = PlanFacts(plan.rank_of_worker(), creation_order(plan, self.tied_layers), len(plan.nodes()))
            with self._lock:
                found = self._facts.setdefault(key, found)
        return found


class SharedRecordCoordinator(StoreCoordinator):
    """A simulated worker's `StoreCoordinator`: the same requests, one shared parse."""

    def __init__(self, *args, records: SharedRecords, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = records

    def parse_record(self, value: bytes) -> EpochRecord:
        return self.records.record(value)
