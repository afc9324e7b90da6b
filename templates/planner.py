"""Pipeline templates with f+1 replicas, and their instantiation into a Plan for N nodes.

A template is a pipeline shape for `n` nodes: the layers cut into `n` stages (one node
each, its `G` workers splitting the stage by tensor parallelism) by the cost-optimal
partition. `n0` is the fewest nodes that hold one replica within device memory.

Which sizes. Templates of the consecutive sizes `n0 .. 2·n0−1` cover every node count:
any N ≥ n0 is q·n0 + r with 0 ≤ r < n0, that is q−1 pipelines of n0 nodes and one of
n0 + r. So every N ≥ (f+1)·n0 has a plan with at least f+1 pipelines, hence f+1
replicas of every layer. A pipeline of 2·n0 nodes or more is never needed for
coverage: it can be split into two pipelines of the set, which adds a replica. Larger
templates are built on demand only when the batch has too few microbatches to feed
that many pipelines. Below (f+1)·n0 nodes the job keeps training with fewer replicas,
and the plan says so.

Instantiation (`instantiate`) picks, for N nodes, the multiset of templates and the
integer microbatch split minimising the iteration time: pipeline p with m microbatches
takes T_p(m) (linear in m, from its partition), the iteration takes the slowest
pipeline plus the gradient sync across pipelines. For a target time T each template
size can run a known number of microbatches; a knapsack over node counts finds whether
sizes summing to N (at least f+1 of them) can run the whole batch within T, and a
binary search finds the smallest such T. The split for the chosen multiset is then made
exactly: each microbatch goes to the pipeline that would finish it first (optimal for
linear per-pipeline times).
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field, replace

from planaria.templates.costs import CostModel
from planaria.templates.partition import InfeasiblePartition, StagePartition, partition_layers
from planaria.templates.placement import moved_bytes, place_nodes
from planaria.templates.plan import PipelinePlan, Plan, StagePlan
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

    @property
    def total_microbatches(self) -> int:
        return self.global_batch // self.micro_batch


@dataclass
class Planner:
    """Templates for one job; `instantiate(N)` gives the plan for N live nodes."""

    costs: CostModel
    settings: PlannerSettings
    templates: dict[int, Template] = field(default_factory=dict)
    n0: int = 0
    _deadlines: dict[tuple[int, ...], list[float]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.n0 = self._smallest_feasible_size()
        most = self.costs.num_layers // self.settings.virtual_stages  # a stage needs a layer
        for size in range(self.n0, min(2 * self.n0, most + 1)):
            self._feasible(size)  # build the templates up front; sizes that do not fit are skipped

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

    # ---------------------------------------------------------- instantiate
    def instantiate(self, num_nodes: int, node_ids: list[str] | None = None, *,
                    current: Plan | None = None, epoch: int = 0, first_iteration: int = 0,
                    tolerance: float = 0.03) -> "PlanChoice":
        """The fastest plan using all `num_nodes` nodes; f+1 pipelines whenever N allows.

        With `current` (the running plan), the choice is the plan that moves the least
        layer state among those within `tolerance` of the fastest estimated iteration:
        the fastest multiset of templates, and the current pipelines' own shapes after
        the change (shrunk by lost nodes, merged where they fell below n0, grown by new
        nodes). Either way, nodes are placed to keep the layers they hold
        (`planaria.templates.placement`), and the choice reports the bytes moved.
        """
        started = time.perf_counter()
        if num_nodes < self.n0:
            raise ValueError(
                f"{num_nodes} nodes cannot hold one replica of the model: the smallest pipeline "
                f"needs n0={self.n0} nodes of {self.costs.hardware.name}; add nodes, or raise "
                "tensor parallelism or recomputation"
            )
        node_ids = node_ids or [f"node{i}" for i in range(num_nodes)]
        if len(node_ids) != num_nodes or len(set(node_ids)) != num_nodes:
            raise ValueError(f"need {num_nodes} distinct node ids, got {node_ids}")
        best_sizes, _ = self._best_multiset(num_nodes)
        candidates = [self._evaluate(best_sizes, node_ids, current, epoch, first_iteration)]
        kept_shape = self._kept_shape(current, node_ids) if current is not None else None
        if kept_shape is not None and sorted(kept_shape) != sorted(best_sizes):
            try:
                candidates.append(self._evaluate(kept_shape, node_ids, current, epoch, first_iteration))
            except ValueError:
                pass  # the kept shape has no split the schedule accepts: the fastest stands
        fastest = min(c.iteration_time_s for c in candidates)
        within = [c for c in candidates if c.iteration_time_s <= fastest * (1 + tolerance)]
        choice = min(within, key=lambda c: (c.moved_bytes, c.iteration_time_s))
        return replace(choice, planning_time_s=time.perf_counter() - started)

    def _evaluate(self, sizes, node_ids, current, epoch, first_iteration) -> "PlanChoice":
        counts = self._split(sizes)
        plan = self._build_plan(sizes, counts, node_ids, current, epoch, first_iteration)
        times = [self.template(s).iteration_time(m) for s, m in zip(sizes, counts)]
        moved = moved_bytes(current, plan, self._layer_bytes) if current is not None else 0
        return PlanChoice(plan=plan, iteration_time_s=max(times) + self._sync_time(sizes),
                          pipeline_times_s=tuple(times), replicas=len(sizes),
                          degraded=len(sizes) < self.settings.fault_tolerance + 1,
                          planning_time_s=0.0, moved_bytes=moved)

    def _kept_shape(self, current: Plan, node_ids: list[str]) -> list[int] | None:
        """The current pipelines' sizes after the change, if that is a valid multiset here.

        Survivors stay in their pipelines; a pipeline that fell below n0 merges with the
        next smallest (Oobleck's "merge"); new nodes join the smallest pipelines. None
        when the result needs a template size that does not exist or fit.
        """
        alive = set(node_ids)
        sizes = sorted(n for n in (sum(s.node in alive for s in p.stages) for p in current.pipelines) if n)
        while len(sizes) > 1 and sizes[0] < self.n0:
            merged = sizes.pop(0) + sizes.pop(0)
            sizes = sorted(sizes + [merged])
        if not sizes:
            return None  # none of the current plan's nodes is left: nothing to keep
        known = {s.node for p in current.pipelines for s in p.stages}
        for _ in range(sum(node not in known for node in node_ids)):
            sizes[0] += 1
            sizes.sort()
        feasible = set(self._sizes_for(len(node_ids)))
        if not sizes or any(size not in feasible for size in sizes):
            return None
        if len(sizes) < self._target_pipelines(len(node_ids)):
            return None
        return sorted(sizes, reverse=True)

    def _layer_bytes(self, layer: int) -> int:
        return self.costs.layers[layer].state_bytes

    def _target_pipelines(self, num_nodes: int) -> int:
        return min(self.settings.fault_tolerance + 1, num_nodes // self.n0)

    def _best_multiset(self, num_nodes: int) -> tuple[list[int], float]:
        """The multiset of template sizes with the smallest iteration time, gradient sync included.

        The sync across pipelines costs most for the largest stage in use, which the
        smallest template holds; so the search runs once for each smallest allowed size
        (sizes below it left out) and keeps the best total. Within one run the slowest
        pipeline is minimised exactly; the sync then depends only on that size class
        and on the pipeline count, which varies little (its factor is 2(k-1)/k).
        """
        total = self.settings.total_microbatches
        want = self._target_pipelines(num_nodes)
        if want > total:
            raise ValueError(
                f"f+1 = {want} pipelines need at least {want} microbatches, but "
                f"train.global_batch / train.micro_batch = {total}: raise the global batch or "
                "lower the micro batch"
            )
        sizes = self._sizes_for(num_nodes)
        interleaved = self.settings.schedule == "interleaved"
        # The packing search assumes a pipeline runs any count; the interleaved schedule
        # accepts only some (`_make_schedulable`), so there each packing is judged by its
        # real split, and packings of a few more pipelines are tried too (shallower
        # pipelines accept more counts: 64 microbatches on [3, 3] split 60/4 at best).
        extra = range(3) if interleaved else range(1)
        best: tuple[float, list[int], float] | None = None
        unsplittable: ValueError | None = None
        for smallest, more in ((s, k) for s in sizes for k in extra):
            if want + more > min(total, num_nodes // smallest):
                continue
            found = self._fastest_packing(num_nodes, [s for s in sizes if s >= smallest], want + more)
            if found is not None:
                packing, deadline = found
                if interleaved:
                    try:
                        counts = self._split(packing)
                    except ValueError as err:
                        unsplittable = err
                        continue
                    deadline = max(self.template(s).iteration_time(m) for s, m in zip(packing, counts))
                estimate = deadline + self._sync_time(packing)
                if best is None or estimate < best[0]:
                    best = (estimate, packing, deadline)
        if best is None and unsplittable is not None:
            raise unsplittable  # the schedule's rounds are what no set of pipelines satisfied
        if best is None:
            most = total * max(sizes, default=0)
            if num_nodes > most:  # every pipeline needs a microbatch
                raise ValueError(
                    f"{num_nodes} nodes are more than this job can use: {total} microbatches make "
                    f"at most {total} pipelines of at most {max(sizes)} stages ({most} nodes); "
                    "raise train.global_batch (or lower train.micro_batch) to use more nodes")
            raise ValueError(
                f"no set of pipelines uses all {num_nodes} nodes: the template sizes that fit in "
                f"memory are {sizes}; add or remove a node, or lower the memory per stage "
                "(tensor parallelism, recomputation, a smaller micro batch)")
        return best[1], best[2]

    def _fastest_packing(self, num_nodes: int, sizes: list[int],
                         want: int) -> tuple[list[int], float] | None:
        """Sizes (from `sizes`) minimising the slowest pipeline, and that pipeline's time."""
        total = self.settings.total_microbatches
        # The best deadline is the finishing time of some pipeline: T_s(m) for a size s
        # and a count m. Binary search over those candidates is exact.
        key = tuple(sizes)
        if key not in self._deadlines:
            self._deadlines[key] = sorted({self.template(s).iteration_time(m)
                                           for s in sizes for m in range(1, total + 1)})
        candidates = self._deadlines[key]
        lo, hi = 0, len(candidates) - 1
        best = self._pack(num_nodes, candidates[hi], want, sizes)
        if best is None:
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            packed = self._pack(num_nodes, candidates[mid], want, sizes)
            if packed is None:
                lo = mid + 1
            else:
                hi, best = mid, packed
        return best, candidates[hi]

    def _sizes_for(self, num_nodes: int) -> list[int]:
        """Template sizes to consider: n0..2n0−1, or any size when the batch is short.

        When there are fewer microbatches than pipelines of size n0 could use, the count
        of pipelines is bounded by the batch instead, and pipelines of any size may be
        needed. Sizes that do not fit in memory or exceed the layers are left out.
        """
        total = self.settings.total_microbatches
        most = self.costs.num_layers // self.settings.virtual_stages
        upper = 2 * self.n0 - 1 if num_nodes // self.n0 <= total else num_nodes
        return [s for s in range(self.n0, min(upper, num_nodes, most) + 1) if self._feasible(s)]

    def _feasible(self, size: int) -> bool:
        try:
            self.template(size)
        except InfeasiblePartition:
            return False  # deeper pipelines hold more microbatches in flight on stage 0
        return True

    def _pack(self, num_nodes: int, deadline: float, min_pipelines: int,
              sizes: list[int]) -> list[int] | None:
        """Sizes summing to num_nodes, ≥ min_pipelines of them, that run the whole batch by `deadline`.

        Unbounded knapsack over node counts: best[n][k] = most microbatches that sizes
        summing to n finish by the deadline, where k counts the pipelines. The count is
        exact up to the number of microbatches when the batch bounds it (each pipeline
        needs one), and otherwise capped at min_pipelines, which is all that matters.
        """
        total = self.settings.total_microbatches
        if not sizes:
            return None
        capacity = {s: self.template(s).max_microbatches(deadline, total) for s in sizes}
        bounded = num_nodes // min(sizes) > total
        cap = total if bounded else max(1, min_pipelines)
        best = [[-1] * (cap + 1) for _ in range(num_nodes + 1)]
        choice: list[list[tuple[int, int] | None]] = [[None] * (cap + 1) for _ in range(num_nodes + 1)]
        best[0][0] = 0
        for n in range(1, num_nodes + 1):
            for size in sizes:
                if size > n or capacity[size] == 0:
                    continue
                for k, value in enumerate(best[n - size]):
                    if value < 0 or (bounded and k == cap):
                        continue
                    k2 = min(k + 1, cap)
                    if value + capacity[size] > best[n][k2]:
                        best[n][k2], choice[n][k2] = value + capacity[size], (size, k)
        finals = [k for k in range(max(1, min_pipelines), cap + 1) if best[num_nodes][k] >= total]
        if not finals:
            return None
        result, n, k = [], num_nodes, finals[0]
        while n:
            size, k = choice[n][k]
            result.append(size)
            n -= size
        return sorted(result, reverse=True)

    def _split(self, sizes: list[int]) -> list[int]:
        """Exact integer split: each microbatch to the pipeline that finishes it first."""
        counts = [1] * len(sizes)  # every pipeline gets at least one microbatch
        heap = [(self.template(s).iteration_time(2), p) for p, s in enumerate(sizes)]
        heapq.heapify(heap)
        for _ in range(self.settings.total_microbatches - len(sizes)):
            _, p = heapq.heappop(heap)
            counts[p] += 1
            heapq.heappush(heap, (self.template(sizes[p]).iteration_time(counts[p] + 1), p))
        return self._make_schedulable(sizes, counts)

    def _make_schedulable(self, sizes: list[int], counts: list[int]) -> list[int]:
        """`counts` if the schedule accepts each; otherwise the split of the batch, among
        the counts it accepts (interleaved: rounds of equal size), whose slowest pipeline
        finishes first. Raises ValueError when these sizes have no such split.

        Exact: a binary search over the candidate finishing times, each checked by a
        subset-sum over the pipelines of the counts that finish by it (reachable totals
        as the bits of an integer). Which counts are accepted has no order that a greedy
        hand-out could follow: it found no split for most node counts of an interleaved
        175B job where one existed.
        """
        if all(self._schedulable(size, m) for size, m in zip(sizes, counts)):
            return list(counts)
        total = self.settings.total_microbatches
        accepted = [[m for m in range(1, total + 1) if self._schedulable(size, m)] for size in sizes]
        deadlines = sorted({self.template(size).iteration_time(m)
                            for size, ms in zip(sizes, accepted) for m in ms})
        found = None
        lo, hi = 0, len(deadlines) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            split = self._split_by(sizes, accepted, deadlines[mid], total)
            if split is None:
                lo = mid + 1
            else:
                found, hi = split, mid - 1
        if found is None:
            raise ValueError(
                f"cannot split {total} microbatches over pipelines of {sizes} stages so that "
                f"every count suits schedule {self.settings.schedule!r}; change "
                "train.global_batch or use schedule '1f1b'")
        return found

    def _split_by(self, sizes: list[int], accepted: list[list[int]], deadline: float,
                  total: int) -> list[int] | None:
        """Accepted counts, one per pipeline, each finishing by `deadline`, summing to
        `total`; None if there are none."""
        options = [[m for m in ms if self.template(size).iteration_time(m) <= deadline]
                   for size, ms in zip(sizes, accepted)]
        mask = (1 << (total + 1)) - 1
        reach = [1]  # reach[p]: bit t set when the first p pipelines can take t microbatches
        for ms in options:
            nxt = 0
            for m in ms:
                nxt |= reach[-1] << m
            reach.append(nxt & mask)
        if not reach[-1] >> total & 1:
            return None
        counts, left = [], total
        for p in range(len(sizes) - 1, -1, -1):
            m = next(m for m in options[p] if left >= m and reach[p] >> (left - m) & 1)
            counts.append(m)
            left -= m
        return counts[::-1]

    def _sync_time(self, sizes: list[int]) -> float:
        """Ring all-reduce of the largest stage's gradients across the pipelines."""
        k = len(sizes)
        if k == 1:
            return 0.0
        hw = self.costs.hardware
        worst = 0.0
        for s in set(sizes):
            for start, stop in self.template(s).partition.model_stages:
                grad_bytes = self.costs.state_bytes(start, stop) / 4  # fp32 grads: 4 of 16 B/param
                worst = max(worst, grad_bytes)
        return 2 * (k - 1) / k * worst / hw.inter_node_bandwidth

    def _build_plan(self, sizes, counts, node_ids, current, epoch, first_iteration) -> Plan:
        gpus = self.costs.tp
        chunks = [self.template(size).partition.stage_chunks(s) for size in sizes for s in range(size)]
        stage_layers = [frozenset(i for a, b in c for i in range(a, b)) for c in chunks]
        nodes = iter(place_nodes(stage_layers, node_ids, current, self._layer_bytes))
        chunk_iter = iter(chunks)
        pipelines, rank, offset = [], 0, 0
        for size, count in zip(sizes, counts):
            stages = []
            for _ in range(size):
                stages.append(StagePlan(node=next(nodes), ranks=tuple(range(rank, rank + gpus)),
                                        chunks=next(chunk_iter)))
                rank += gpus
            pipelines.append(PipelinePlan(template_id=f"{size}-node", stages=tuple(stages),
                                          num_microbatches=count, sample_offset=offset))
            offset += count * self.settings.micro_batch
        return Plan(epoch=epoch, first_iteration=first_iteration, num_layers=self.costs.num_layers,
                    tp=gpus, schedule=self.settings.schedule,
                    virtual_stages=self.settings.virtual_stages,
                    global_batch=self.settings.global_batch, micro_batch=self.settings.micro_batch,
                    pipelines=tuple(pipelines))


@dataclass(frozen=True)
class PlanChoice:
    """A plan and what the cost model expects of it."""

    plan: Plan
    iteration_time_s: float
    pipeline_times_s: tuple[float, ...]
    replicas: int
    degraded: bool
    """True when N < (f+1)·n0: fewer than f+1 replicas of some layer."""
    planning_time_s: float
    moved_bytes: int = 0
    """Layer state the move from the current plan sends (0 without a current plan)."""
