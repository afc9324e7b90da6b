"""The pipeline templates of one job: which sizes exist, and each one's stage partition.

A template is a pipeline shape for `n` nodes: the layers cut into `n` stages (one node
each, its `G` workers splitting the stage by tensor parallelism) by the cost-optimal
partition. `n0` is the fewest nodes that hold one replica within device memory.

Which sizes. Templates of the consecutive sizes `n0 .. 2·n0−1` cover node counts: any
N ≥ n0 is q·n0 + r with 0 ≤ r < n0, that is q−1 pipelines of n0 nodes and one of
n0 + r. Deeper templates, of `2·n0 .. depth·n0−1` nodes (`PlannerSettings.depth`, 4 by
default), are there to be fast: a pipeline of more stages holds fewer layers per
stage, so the gradient all-reduce across pipelines, whose size is the largest stage's,
is smaller (GPT-3 6.7B on 200 A100 nodes: 2.90 s -> 2.35 s per iteration). That is all
a deeper pipeline offers over two shallower ones on the same nodes, which have less
bubble and add a replica; so a deeper size is built only when its largest stage holds
strictly fewer gradient bytes than that of every shallower template, and the sync it
saves can exceed the fill and drain it adds (`_deeper_sizes`). The bound 4·n0−1: the
cost of planning grows with the number of sizes (each is partitioned once, and each
is a size class of the instantiation search of `templates/planner.py`), and the sync
of an s-stage pipeline falls as 1/s, so past 4·n0 at most the sync of a 4·n0-stage
pipeline (a quarter of an n0-stage one's) is left to save, less the bubble it adds.
With it, instantiating a 175B plan for any N up to 1,024 takes well under a second.
Larger templates are also built on demand when the batch has too few microbatches to
feed pipelines of n0 nodes.

`Planner` (`templates/planner.py`) instantiates these templates into a Plan for N nodes.
No torch import: templates are planned anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from planaria.templates.costs import CostModel
from planaria.templates.partition import partition_layers
from planaria.templates.partition_cost import InfeasiblePartition, StagePartition
from planaria.templates.schedules import check_schedule_shape


@dataclass(frozen=True)
class Template:
    """A pipeline shape for `num_nodes` nodes."""

    num_nodes: int
    partition: StagePartition
    _times: dict[int, float] = field(default_factory=dict, compare=False, repr=False)
    """Memo of iteration_time: instantiation asks for the same counts again and again
    (every candidate deadline, every event of a simulated trace)."""

    def iteration_time(self, num_microbatches: int) -> float:
        time_s = self._times.get(num_microbatches)
        if time_s is None:
            time_s = self._times[num_microbatches] = self.partition.iteration_time(num_microbatches)
        return time_s

    def max_microbatches(self, deadline: float, limit: int) -> int:
        """Most microbatches (≤ limit) this pipeline finishes within `deadline`."""
        lo, hi = 0, limit
        while lo < hi:  # iteration_time is increasing in m
            mid = (lo + hi + 1) // 2
            if self.iteration_time(mid) <= deadline:
                lo = mid
            else:
                hi = mid - 1
        return lo


@dataclass(frozen=True)
class PlannerSettings:
    """What the planner needs besides the cost model."""

    fault_tolerance: int
    """f: failures to survive without a checkpoint; plans keep f+1 replicas when N allows."""
    global_batch: int
    micro_batch: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    min_stages: int = 1
    """Every template has at least this many stages (parallel.min_stages)."""
    depth: int = 4
    """Templates have up to depth·n0 − 1 stages (module docstring); 2 keeps only the
    sizes needed to cover every node count."""

    def __post_init__(self) -> None:
        if self.fault_tolerance < 0:
            raise ValueError(f"fault tolerance f must be 0 or more, got {self.fault_tolerance}")
        if self.global_batch < 1 or self.micro_batch < 1:
            raise ValueError("train.global_batch and train.micro_batch must be at least 1")
        if self.global_batch % self.micro_batch:
            raise ValueError(f"train.global_batch={self.global_batch} is not a multiple of "
                             f"train.micro_batch={self.micro_batch}")
        if self.min_stages < 1:
            raise ValueError(f"parallel.min_stages must be at least 1, got {self.min_stages}")
        if self.depth < 2:
            raise ValueError(f"template depth must be at least 2 (sizes n0..2·n0−1 cover every node "
                             f"count), got {self.depth}")

    @property
    def total_microbatches(self) -> int:
        return self.global_batch // self.micro_batch


@dataclass
class JobTemplates:
    """The templates for one job: `template(n)` is the pipeline shape for n nodes."""

    costs: CostModel
    settings: PlannerSettings
    templates: dict[int, Template] = field(default_factory=dict)
    n0: int = 0
    standing_sizes: list[int] = field(default_factory=list)
    """The template sizes instantiation chooses among when the batch feeds pipelines of
    n0 nodes: n0..2n0−1 where they fit, and the deeper sizes that can win."""

    def __post_init__(self) -> None:
        self.n0 = self._smallest_feasible_size()
        most = self.costs.num_layers // self.settings.virtual_stages  # a stage needs a layer
        covering = [size for size in range(self.n0, min(2 * self.n0, most + 1)) if self._feasible(size)]
        self.standing_sizes = covering + self._deeper_sizes(covering, most)

    def _deeper_sizes(self, covering: list[int], most: int) -> list[int]:
        """Sizes 2·n0 .. depth·n0−1 that can win (module docstring), shallowest first.

        A deeper template t is kept when its largest stage holds strictly fewer gradient
        bytes than the best kept so far, a, and the sync it saves at most (the ring
        all-reduce of that difference, 2·Δbytes / bandwidth, its limit for many
        pipelines) exceeds the time it adds to every pipeline of its size beyond the
        microbatches themselves (fill and drain, sends, the optimizer step): for pipelines
        of one size over the same nodes that is the whole difference, since the
        microbatches' own time is the batch's work spread over the same nodes either way.
        """
        best = min(covering, key=lambda size: (self._gradient_bytes(size), size))
        deeper = []
        for size in range(2 * self.n0, min(self.settings.depth * self.n0 - 1, most) + 1):
            if not self._feasible(size):
                continue  # deeper pipelines hold more microbatches in flight on stage 0
            saved = 2 * (self._gradient_bytes(best) - self._gradient_bytes(size)) \
                / self.costs.hardware.inter_node_bandwidth
            if saved > 0 and saved > self._fill_time(size) - self._fill_time(best):
                deeper.append(size)
                best = size
            else:
                del self.templates[size]  # never chosen: not offered, nor reported
        return deeper

    def _gradient_bytes(self, size: int) -> float:
        """Gradient bytes of the template's largest model stage: what the sync across
        pipelines all-reduces (`CostModel.gradient_bytes`: float64 with wide sums)."""
        return max(self.costs.gradient_bytes(start, stop)
                   for start, stop in self.template(size).partition.model_stages)

    def _fill_time(self, size: int) -> float:
        """A pipeline's time beyond its microbatches' own, m × its slowest stage: the same
        for every m its schedule runs at full length (the whole batch, here)."""
        template = self.template(size)
        m = self._reference_microbatches(size)
        return template.iteration_time(m) - m * max(template.partition.stage_times)

    # ------------------------------------------------------------- templates
    def _reference_microbatches(self, num_nodes: int) -> int:
        """Microbatches a template is partitioned (and its memory checked) for.

        The whole batch: a pipeline never runs more, so its activations in flight never
        exceed what the partition counted, whatever split instantiation picks later.
        """
        share = self.settings.total_microbatches
        while not self._schedulable(num_nodes, share):
            share -= 1  # one round (share < num_nodes) is always schedulable
        return share

    def _worst_memory_microbatches(self, num_nodes: int) -> tuple[int, ...]:
        """Counts a pipeline may be given whose activations in flight exceed the whole
        batch's: its memory is checked for them too.

        1F1B and GPipe hold at most as many microbatches as they run, so the whole batch
        bounds every smaller share. The interleaved schedule holds a round's worth per
        chunk, and a round is largest (2S − 1 microbatches) for a share of 2S − 1 run as
        one round, however large the batch: a pipeline given that share after a failure
        would hold more than its template was checked for.
        """
        if self.settings.schedule != "interleaved":
            return ()
        worst = min(self.settings.total_microbatches, 2 * num_nodes - 1)
        return () if worst == self._reference_microbatches(num_nodes) else (worst,)

    def _schedulable(self, num_nodes: int, num_microbatches: int) -> bool:
        try:
            check_schedule_shape(self.settings.schedule, num_nodes, self.settings.virtual_stages,
                                 num_microbatches)
        except ValueError:
            return False
        return True

    def template(self, num_nodes: int) -> Template:
        if num_nodes not in self.templates:
            partition = partition_layers(
                self.costs, num_nodes, num_microbatches=self._reference_microbatches(num_nodes),
                schedule=self.settings.schedule, virtual_stages=self.settings.virtual_stages,
                also_fits=self._worst_memory_microbatches(num_nodes))
            self.templates[num_nodes] = Template(num_nodes, partition)
        return self.templates[num_nodes]

    def _smallest_feasible_size(self) -> int:
        v = self.settings.virtual_stages
        most = self.costs.num_layers // v
        first = max(1, self.settings.min_stages)
        if first > most:
            raise ValueError(
                f"parallel.min_stages={first} needs at least {first * v} layers but the model has "
                f"{self.costs.num_layers}: lower parallel.min_stages"
            )
        shortfall = None
        for size in range(first, most + 1):
            try:
                self.template(size)
                return size
            except InfeasiblePartition as err:
                shortfall = err
        raise InfeasiblePartition(
            f"the model does not fit even with one layer per stage ({most} stages): {shortfall}",
            getattr(shortfall, "shortfall_bytes", 0),
        )

    def _sizes_for(self, num_nodes: int) -> list[int]:
        """Template sizes to consider: the standing sizes, or any size when the batch is short.

        When there are fewer microbatches than pipelines of size n0 could use, the count
        of pipelines is bounded by the batch instead, and pipelines of any size may be
        needed. Sizes that do not fit in memory or exceed the layers are left out.
        """
        if num_nodes // self.n0 <= self.settings.total_microbatches:
            return [s for s in self.standing_sizes if s <= num_nodes]
        most = self.costs.num_layers // self.settings.virtual_stages
        return [s for s in range(self.n0, min(num_nodes, most) + 1) if self._feasible(s)]

    def _feasible(self, size: int) -> bool:
        try:
            self.template(size)
        except InfeasiblePartition:
            return False  # deeper pipelines hold more microbatches in flight on stage 0
        return True
