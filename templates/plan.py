"""The plan contract: what a job runs in one epoch.

A `Plan` is produced by the planner (or built from an explicit layout), consumed by
the runtime and stored by the control plane as JSON. It is a frozen dataclass with
no torch import, it round-trips through JSON exactly, and it refuses to exist in an
invalid state: `Plan.__post_init__` checks every contract the runtime relies on and
names what is wrong.

Layers are numbered `0 .. num_layers-1`: layer 0 is the embedding, the last layer
is the final norm plus head, the ones between are transformer blocks. Layer ranges
are half-open `(start, stop)`.

Derived views (not stored): rank -> (pipeline, stage, tp rank), layer -> replica
groups, and `transfers(old, new)`: who sends which layer to whom when the job moves
from one plan to the next. Workers are identified across epochs by
`(node, local_rank)`, because global ranks are renumbered at every epoch.
"""
from __future__ import annotations

import heapq

import json
from dataclasses import asdict, dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Iterable, Iterator, Literal, Mapping, get_args

ScheduleName = Literal["gpipe", "1f1b", "interleaved", "zb1f1b"]
"""The pipeline schedules (`planaria.templates.schedules` builds each)."""
SCHEDULE_NAMES: tuple[str, ...] = get_args(ScheduleName)

LayerRange = tuple[int, int]
Worker = tuple[str, int]  # (node id, local rank on that node)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: a node whose `tp` workers split the stage's chunks."""

    node: str
    """Id of the node that runs this stage."""
    ranks: tuple[int, ...]
    """Global ranks of the stage's workers, in tensor-parallel rank order."""
    chunks: tuple[LayerRange, ...]
    """Layer range of each local chunk (virtual stage), in local chunk order."""

    def layers(self) -> Iterator[int]:
        for start, stop in self.chunks:
            yield from range(start, stop)


@dataclass(frozen=True)
class PipelinePlan:
    """One pipeline: a template placed on real nodes, with its share of the batch."""

    template_id: str
    """Which template this pipeline instantiates (free text for explicit layouts)."""
    stages: tuple[StagePlan, ...]
    """Stages in pipeline order, one per node."""
    num_microbatches: int
    """Microbatches this pipeline runs per iteration."""
    sample_offset: int
    """Offset, in sequences, of this pipeline's first sample inside the global batch."""

    def model_stages(self, virtual_stages: int) -> list[LayerRange]:
        """Layer ranges of the pipeline's model stages in model order.

        Model stage `j` is local chunk `j // S` of stage `j % S` (S = number of stages),
        the looped placement that the interleaved schedule expects.
        """
        num_stages = len(self.stages)
        return [
            self.stages[j % num_stages].chunks[j // num_stages]
            for j in range(num_stages * virtual_stages)
        ]


@dataclass(frozen=True)
class RankInfo:
    """Where one global rank sits in a plan."""

    pipeline: int
    stage: int
    tp_rank: int
    node: str


@dataclass(frozen=True)
class Transfer:
    """One (layer, tp shard) that `dst` needs in the new plan and `src` holds in the old."""

    layer: int
    tp_rank: int
    src: Worker
    dst: Worker


@dataclass(frozen=True)
class Plan:
    """Everything a job runs in one epoch. See the module docstring."""

    epoch: int
    """Reconfiguration counter; each epoch has one plan and one set of process groups."""
    first_iteration: int
    """The iteration this plan starts with."""
    num_layers: int
    """Layers the planner places: embedding + transformer blocks + final norm and head."""
    tp: int
    """Workers per stage (tensor-parallel degree)."""
    schedule: str
    """Pipeline schedule: one of SCHEDULE_NAMES."""
    virtual_stages: int
    """Chunks per stage; above 1 only with the interleaved schedule."""
    global_batch: int
    """Sequences per iteration, all pipelines together."""
    micro_batch: int
    """Sequences per microbatch."""
    pipelines: tuple[PipelinePlan, ...]
    """The pipelines; together they hold `len(pipelines)` replicas of every layer."""

    def __post_init__(self) -> None:
        _validate(self)

    @cached_property
    def _rank_index(self) -> dict[int, RankInfo]:
        # Not a field: derived, never stored, never compared.
        return {
            rank: RankInfo(p, s, t, stage.node)
            for p, pipeline in enumerate(self.pipelines)
            for s, stage in enumerate(pipeline.stages)
            for t, rank in enumerate(stage.ranks)
        }

    # ------------------------------------------------------------------ views
    @property
    def world_size(self) -> int:
        return len(self._rank_index)

    @property
    def total_microbatches(self) -> int:
        return sum(p.num_microbatches for p in self.pipelines)

    def rank_info(self, rank: int) -> RankInfo:
        try:
            return self._rank_index[rank]
        except KeyError:
            raise ValueError(
                f"rank {rank} is not in the plan of epoch {self.epoch}, whose ranks are "
                f"0..{self.world_size - 1}"
            ) from None

    def stage_of(self, rank: int) -> StagePlan:
        info = self.rank_info(rank)
        return self.pipelines[info.pipeline].stages[info.stage]

    def worker(self, rank: int) -> Worker:
        info = self.rank_info(rank)
        return (info.node, info.tp_rank)

    def nodes(self) -> list[str]:
        """The nodes the plan uses, in rank order."""
        return list(dict.fromkeys(stage.node for p in self.pipelines for stage in p.stages))

    @cached_property
    def _worker_index(self) -> dict[Worker, int]:
        # Derived once per plan, as `_rank_index`: every worker asks for it at each epoch
        # (and the scale harness's thousands of simulated workers, sharing one plan,
        # made it O(N^2) when each call built it again: 8,192 ranks for each of 8,192).
        return {(info.node, info.tp_rank): rank for rank, info in self._rank_index.items()}

    def rank_of_worker(self) -> Mapping[Worker, int]:
        """Worker -> its global rank (a read-only view of one table per plan)."""
        return MappingProxyType(self._worker_index)

    def layers_of(self, rank: int) -> list[int]:
        return list(self.stage_of(rank).layers())

    def replica_groups(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """(layer, tp rank) -> sorted global ranks holding that shard, one per pipeline."""
        groups: dict[tuple[int, int], list[int]] = {}
        for pipeline in self.pipelines:
            for stage in pipeline.stages:
                for layer in stage.layers():
                    for t, rank in enumerate(stage.ranks):
                        groups.setdefault((layer, t), []).append(rank)
        return {key: tuple(sorted(ranks)) for key, ranks in sorted(groups.items())}

    def pipeline_groups(self) -> list[tuple[int, ...]]:
        """For each pipeline and tp rank, the ranks that pass activations along it."""
        return [
            tuple(stage.ranks[t] for stage in pipeline.stages)
            for pipeline in self.pipelines
            for t in range(self.tp)
        ]

    def tensor_parallel_groups(self) -> list[tuple[int, ...]]:
        return [stage.ranks for pipeline in self.pipelines for stage in pipeline.stages]

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        try:
            pipelines = tuple(
                PipelinePlan(
                    template_id=str(p["template_id"]),
                    stages=tuple(
                        StagePlan(
                            node=str(s["node"]),
                            ranks=tuple(int(r) for r in s["ranks"]),
                            chunks=tuple((int(a), int(b)) for a, b in s["chunks"]),
                        )
                        for s in p["stages"]
                    ),
                    num_microbatches=int(p["num_microbatches"]),
                    sample_offset=int(p["sample_offset"]),
                )
                for p in data["pipelines"]
            )
            scalars = {
                k: data[k]
                for k in ("epoch", "first_iteration", "num_layers", "tp",
                          "virtual_stages", "global_batch", "micro_batch")
            }
            return cls(schedule=str(data["schedule"]), pipelines=pipelines,
                       **{k: int(v) for k, v in scalars.items()})
        except KeyError as missing:
            raise ValueError(f"plan JSON lacks the field {missing}") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


class PlanError(ValueError):
    """A plan that breaks the contract; the message names what and where."""


def _validate(plan: Plan) -> None:
    for name in ("num_layers", "tp", "virtual_stages", "global_batch", "micro_batch"):
        if getattr(plan, name) < 1:
            raise PlanError(f"plan.{name} must be at least 1, got {getattr(plan, name)}")
    if plan.epoch < 0 or plan.first_iteration < 0:
        raise PlanError("plan.epoch and plan.first_iteration must not be negative")
    if plan.schedule not in SCHEDULE_NAMES:
        raise PlanError(f"plan.schedule {plan.schedule!r} is unknown; use one of {SCHEDULE_NAMES}")
    if plan.virtual_stages > 1 and plan.schedule != "interleaved":
        raise PlanError(
            f"plan.virtual_stages={plan.virtual_stages} needs schedule 'interleaved', "
            f"not {plan.schedule!r}"
        )
    if not plan.pipelines:
        raise PlanError("a plan needs at least one pipeline")
    if plan.global_batch % plan.micro_batch:
        raise PlanError(
            f"global_batch {plan.global_batch} is not a multiple of micro_batch {plan.micro_batch}"
        )
    _validate_batch_split(plan)
    _validate_ranks_and_nodes(plan)
    for p, pipeline in enumerate(plan.pipelines):
        _validate_pipeline_layers(plan, p, pipeline)


def _validate_batch_split(plan: Plan) -> None:
    expected = plan.global_batch // plan.micro_batch
    counts = [p.num_microbatches for p in plan.pipelines]
    if any(c < 1 for c in counts):
        raise PlanError(f"every pipeline needs at least one microbatch, got {counts}")
    if sum(counts) != expected:
        raise PlanError(
            f"pipelines' microbatches {counts} add up to {sum(counts)}, but global_batch "
            f"{plan.global_batch} / micro_batch {plan.micro_batch} = {expected}"
        )
    offset = 0
    for p, pipeline in enumerate(plan.pipelines):
        if pipeline.sample_offset != offset:
            raise PlanError(
                f"pipeline {p} starts at sample {pipeline.sample_offset}, expected {offset}: "
                "pipelines take consecutive slices of the global batch in order"
            )
        offset += pipeline.num_microbatches * plan.micro_batch


def _validate_ranks_and_nodes(plan: Plan) -> None:
    seen_ranks: list[int] = []
    seen_nodes: set[str] = set()
    for p, pipeline in enumerate(plan.pipelines):
        if not pipeline.stages:
            raise PlanError(f"pipeline {p} has no stages")
        for s, stage in enumerate(pipeline.stages):
            where = f"pipeline {p} stage {s}"
            if len(stage.ranks) != plan.tp:
                raise PlanError(f"{where} has {len(stage.ranks)} ranks, but tp={plan.tp}")
            if stage.node in seen_nodes:
                raise PlanError(f"{where}: node {stage.node!r} is used by more than one stage")
            seen_nodes.add(stage.node)
            seen_ranks.extend(stage.ranks)
    if sorted(seen_ranks) != list(range(len(seen_ranks))):
        duplicates = sorted({r for r in seen_ranks if seen_ranks.count(r) > 1})
        raise PlanError(
            f"ranks must be 0..{len(seen_ranks) - 1}, each used once; got {sorted(seen_ranks)}"
            + (f" (repeated: {duplicates})" if duplicates else "")
        )
    # The runtime maps stage s to the s-th rank of the pipeline's group and a tp shard to
    # its rank's place in the tp group; process groups order their ranks, so the plan must
    # list them in order too (swapped stages crashed the pipeline runtime).
    for p, pipeline in enumerate(plan.pipelines):
        ranks = [r for stage in pipeline.stages for r in stage.ranks]
        if ranks != sorted(ranks):
            raise PlanError(f"pipeline {p}'s ranks must increase from stage to stage and within "
                            f"each stage; got {[list(stage.ranks) for stage in pipeline.stages]}")


def _validate_pipeline_layers(plan: Plan, p: int, pipeline: PipelinePlan) -> None:
    for s, stage in enumerate(pipeline.stages):
        if len(stage.chunks) != plan.virtual_stages:
            raise PlanError(
                f"pipeline {p} stage {s} has {len(stage.chunks)} chunks, "
                f"but virtual_stages={plan.virtual_stages}"
            )
    expected_start = 0
    for j, (start, stop) in enumerate(pipeline.model_stages(plan.virtual_stages)):
        if start != expected_start or stop <= start:
            raise PlanError(
                f"pipeline {p}: model stage {j} covers layers [{start}, {stop}) but must start "
                f"at layer {expected_start} and be non-empty; every layer must appear exactly "
                "once, in order"
            )
        expected_start = stop
    if expected_start != plan.num_layers:
        raise PlanError(
            f"pipeline {p} covers layers [0, {expected_start}) but the model has "
            f"{plan.num_layers} layers"
        )


def transfers(old: Plan, new: Plan) -> list[Transfer]:
    """Layer shards each worker of `new` lacks, and which surviving worker sends each.

    A worker that appears in `new` is alive. Shards with no surviving holder are left
    out; `missing_layers` reports them. See `transfers_from`.
    """
    if new.tp != old.tp or new.num_layers != old.num_layers:
        raise PlanError("plans with different tp or num_layers cannot exchange layer state")
    return transfers_from(holders(old), new)


def transfers_from(held: Mapping[tuple[int, int], Iterable[Worker]], new: Plan,
                   leaving: Iterable[Worker] = ()) -> list[Transfer]:
    """Transfers that give every worker of `new` the shards it lacks, from `held`:
    (layer, tp rank) -> the workers holding that shard's committed state now.

    This is what recovery uses: what workers hold is the old plan's layers, unless a
    reconfiguration was interrupted (then they still hold those and may hold more).
    Only holders that appear in `new` (alive) send, and `leaving` workers (outside
    `new`: a planned leave) for the shards no worker of `new` holds. Sources are
    spread: each shard goes from the holder with the fewest transfers so far (ties: the
    lowest worker).
    """
    alive, leaving = set(new.rank_of_worker()), set(leaving)
    held = {key: set(workers) for key, workers in held.items()}
    load: dict[Worker, int] = {}
    result = []
    for key, wanted_by in sorted(holders(new).items()):
        sources = ([w for w in held.get(key, ()) if w in alive]
                   or [w for w in held.get(key, ()) if w in leaving])
        # The shard's holders by (transfers so far, worker), least first: a heap, since a
        # re-cut at 1,024 nodes gives thousands of transfers, each of a shard with
        # hundreds of holders (a `min` over them took 2 of the leader's 2.7 CPU-s).
        # Within one shard only the holder just taken changes its count, so the heap
        # stays true as each is pushed back with its new count.
        queue = [(load.get(w, 0), w) for w in sources]
        heapq.heapify(queue)
        for dst in sorted(wanted_by):
            if dst in held.get(key, ()) or not queue:
                continue
            _, src = heapq.heappop(queue)
            load[src] = load.get(src, 0) + 1
            heapq.heappush(queue, (load[src], src))
            result.append(Transfer(layer=key[0], tp_rank=key[1], src=src, dst=dst))
    return result


def missing_layers(old: Plan, new: Plan) -> list[tuple[int, int]]:
    """(layer, tp rank) shards that no surviving worker of `old` holds."""
    return missing_from(holders(old), new)


def missing_from(held: Mapping[tuple[int, int], Iterable[Worker]], new: Plan,
                 leaving: Iterable[Worker] = ()) -> list[tuple[int, int]]:
    """(layer, tp rank) shards of the model that no worker of `new`, nor of `leaving`
    (they hand theirs over before they go), holds in `held`."""
    alive = set(new.rank_of_worker()) | set(leaving)
    return [(layer, t) for layer in range(new.num_layers) for t in range(new.tp)
            if not any(w in alive for w in held.get((layer, t), ()))]


def holders(plan: Plan) -> dict[tuple[int, int], set[Worker]]:
    """(layer, tp rank) -> the workers that hold that shard in `plan`."""
    result: dict[tuple[int, int], set[Worker]] = {}
    for (layer, t), ranks in plan.replica_groups().items():
        result[(layer, t)] = {plan.worker(r) for r in ranks}
    return result
