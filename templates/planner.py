"""The planner: the job's pipeline templates (`templates/job_templates.py`) with f+1
replicas, instantiated into a Plan for N nodes.

Which N get a plan on all their nodes. Every N ≥ n0 when every size n0..2n0−1 fits in
memory, the batch has a microbatch for every pipeline (N ≤ microbatches × the largest
template) and, for the interleaved schedule, the batch splits into the rounds each
pipeline accepts. Every N ≥ (f+1)·n0 then has at least f+1 pipelines, hence f+1
replicas of every layer. Otherwise, when no set of pipelines uses all N nodes (a
deeper template does not fit: 1F1B's first stage holds more microbatches in flight
the deeper the pipeline, and n0 may be the only size that fits), the plan uses as many
of them as any plan can, the fastest such, and names the others (`PlanChoice.idle_nodes`):
they wait, and are planned in at the next change. When n0 nodes fit, fewer than n0
nodes are idle (⌊N/n0⌋ pipelines of n0 always pack) unless the batch is what runs out,
so a job of N ≥ (f+1)·n0 nodes still keeps f+1 replicas. Below (f+1)·n0 nodes the job
keeps training with fewer replicas, and the plan says so (`degraded`).

Instantiation (`instantiate`) picks, for N nodes, the multiset of templates and the
integer microbatch split minimising the iteration time: pipeline p with m microbatches
takes T_p(m) (linear in m, from its partition), the iteration takes the slowest
pipeline plus the gradient sync across pipelines. For a target time T each template
size can run a known number of microbatches; a knapsack over node counts
(`planaria.templates.packing`) finds whether sizes summing to N (at least f+1 of them)
can run the whole batch within T, and a binary search finds the smallest such T. The
sync depends on the largest stage in use, so the search runs once per smallest size
allowed, and the best total wins. The split for the chosen multiset is then made
exactly: each microbatch goes to the pipeline that would finish it first (optimal for
linear per-pipeline times).
"""
from __future__ import annotations

import bisect
import heapq
import time
from dataclasses import dataclass, field, replace

from planaria.templates.job_templates import JobTemplates
from planaria.templates.packing import most_microbatches, pack, pack_short_batch
from planaria.templates.placement import moved_bytes, place_nodes
from planaria.templates.plan import PipelinePlan, Plan, StagePlan


class NoPlanForAllNodes(ValueError):
    """No set of pipelines uses every one of the nodes; the message says why and what
    would use them all. `Planner.instantiate` then plans over fewer."""


@dataclass
class Planner(JobTemplates):
    """Templates for one job; `instantiate(N)` gives the plan for N live nodes."""

    _deadlines: dict[tuple[int, ...], list[float]] = field(default_factory=dict, repr=False)

    # ---------------------------------------------------------- instantiate
    def instantiate(self, num_nodes: int, node_ids: list[str] | None = None, *,
                    current: Plan | None = None, epoch: int = 0, first_iteration: int = 0,
                    tolerance: float = 0.03) -> "PlanChoice":
        """The fastest plan using all `num_nodes` nodes; f+1 pipelines whenever N allows.

        When no set of pipelines uses them all, the fastest plan over as many of them as
        any plan can use, with the others named in `PlanChoice.idle_nodes` and the reason
        in `PlanChoice.idle_reason` (module docstring: which N this happens for).

        With `current` (the running plan), the choice is the plan that moves the least
        layer state among those within `tolerance` of the fastest estimated iteration:
        the fastest multiset of templates, and the current pipelines' own shapes after
        the change (shrunk by lost nodes, merged where they fell below n0, grown by new
        nodes). Either way, nodes are placed to keep the layers they hold
        (`planaria.templates.placement`), and the choice reports the bytes moved; the
        idle ones are those whose layers the plan needs least (new nodes first).
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
        best_sizes, idle_reason = self._best_over_most_nodes(num_nodes)
        candidates = [self._evaluate(best_sizes, node_ids, current, epoch, first_iteration)]
        kept_shape = self._kept_shape(current, node_ids) if current is not None and not idle_reason else None
        if kept_shape is not None and sorted(kept_shape) != sorted(best_sizes):
            try:
                candidates.append(self._evaluate(kept_shape, node_ids, current, epoch, first_iteration))
            except ValueError:
                pass  # the kept shape has no split the schedule accepts: the fastest stands
        fastest = min(c.iteration_time_s for c in candidates)
        within = [c for c in candidates if c.iteration_time_s <= fastest * (1 + tolerance)]
        choice = min(within, key=lambda c: (c.moved_bytes, c.iteration_time_s))
        return replace(choice, planning_time_s=time.perf_counter() - started, idle_reason=idle_reason)

    def _best_over_most_nodes(self, num_nodes: int) -> tuple[list[int], str]:
        """(the fastest multiset of sizes over the most of `num_nodes` nodes that any set
        of pipelines uses, why not all of them: "" when it uses them all).

        Fewest idle nodes first, then speed: node counts are tried from N down. A count
        that no set of pipelines fills fails at its loosest deadline, one knapsack per
        size class, so a failed try costs little. When n0 fits, fewer than n0 tries fail
        (⌊N/n0⌋ pipelines of n0 nodes always pack) unless the batch runs out first, and
        then the count starts at the most nodes the batch can feed."""
        try:
            return self._best_multiset(num_nodes)[0], ""
        except NoPlanForAllNodes as err:
            reason = str(err)
        most = self.settings.total_microbatches * max(self._sizes_for(num_nodes), default=self.n0)
        for usable in range(min(num_nodes - 1, most), self.n0 - 1, -1):
            try:
                return self._best_multiset(usable)[0], reason
            except NoPlanForAllNodes:
                continue
        raise ValueError(f"no set of pipelines uses {self.n0} to {num_nodes} nodes: {reason}")

    def _evaluate(self, sizes, node_ids, current, epoch, first_iteration) -> "PlanChoice":
        """The plan of `sizes` over as many of `node_ids` as they take (the rest idle)."""
        counts = self._split(sizes)
        plan = self._build_plan(sizes, counts, node_ids, current, epoch, first_iteration)
        times = [self.template(s).iteration_time(m) for s, m in zip(sizes, counts)]
        moved = moved_bytes(current, plan, self._layer_bytes) if current is not None else 0
        used = set(plan.nodes())
        return PlanChoice(plan=plan, iteration_time_s=max(times) + self._sync_time(sizes),
                          pipeline_times_s=tuple(times), replicas=len(sizes),
                          degraded=len(sizes) < self.settings.fault_tolerance + 1,
                          planning_time_s=0.0, moved_bytes=moved,
                          idle_nodes=tuple(node for node in node_ids if node not in used))

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
        return self.costs.layers[layer].held_bytes

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
        floor = dict.fromkeys(extra, 0.0)  # fewer sizes never pack by an earlier deadline
        for smallest, more in ((s, k) for s in sizes for k in extra):
            if want + more > min(total, num_nodes // smallest):
                continue
            found = self._fastest_packing(num_nodes, [s for s in sizes if s >= smallest], want + more,
                                          at_least=floor[more], among=sizes)
            if found is not None:
                packing, deadline = found
                floor[more] = deadline
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
            # the schedule's rounds are what no set of pipelines satisfied
            raise NoPlanForAllNodes(str(unsplittable))
        if best is None:
            most = total * max(sizes, default=0)
            if num_nodes > most:  # every pipeline needs a microbatch
                raise NoPlanForAllNodes(
                    f"{num_nodes} nodes are more than this job can use: {total} microbatches make "
                    f"at most {total} pipelines of at most {max(sizes)} stages ({most} nodes); "
                    "raise train.global_batch (or lower train.micro_batch) to use more nodes")
            raise NoPlanForAllNodes(
                f"no set of pipelines uses all {num_nodes} nodes: the template sizes that fit in "
                f"memory are {sizes}; lower the memory per stage (tensor parallelism, "
                "recomputation, a smaller micro batch) to use them all")
        return best[1], best[2]

    def _fastest_packing(self, num_nodes: int, sizes: list[int], want: int, at_least: float = 0.0,
                         among: list[int] | None = None) -> tuple[list[int], float] | None:
        """Sizes (from `sizes`) minimising the slowest pipeline, and that pipeline's time.

        `at_least`: a time no packing of these sizes beats (a search over more sizes
        found it), where the binary search may start. `among`: sizes whose finishing
        times are the candidates (a superset of `sizes`: one sorted list serves every
        size class of a search)."""
        total = self.settings.total_microbatches
        # The best deadline is the finishing time of some pipeline: T_s(m) for a size s
        # and a count m. Binary search over those candidates (or more) is exact.
        key = tuple(among or sizes)
        if key not in self._deadlines:
            self._deadlines[key] = sorted({self.template(s).iteration_time(m)
                                           for s in key for m in range(1, total + 1)})
        candidates = self._deadlines[key]
        lo, hi = bisect.bisect_left(candidates, at_least), len(candidates) - 1
        if not self._packs(num_nodes, candidates[hi], want, sizes):
            return None
        lo = min(lo, hi)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._packs(num_nodes, candidates[mid], want, sizes):
                hi = mid
            else:
                lo = mid + 1
        return self._pack(num_nodes, candidates[hi], want, sizes), candidates[hi]

    def _pack(self, num_nodes: int, deadline: float, min_pipelines: int,
              sizes: list[int]) -> list[int] | None:
        """Sizes summing to num_nodes, ≥ min_pipelines of them, that run the whole batch by
        `deadline` (`planaria.templates.packing`); None when there are none."""
        total = self.settings.total_microbatches
        items = self._capacities(deadline, sizes)
        if not items:
            return None
        if num_nodes // min(sizes) > total:  # the batch bounds the pipeline count
            return pack_short_batch(num_nodes, items, min_pipelines, total)
        return pack(num_nodes, items, min_pipelines, total)

    def _packs(self, num_nodes: int, deadline: float, min_pipelines: int, sizes: list[int]) -> bool:
        """Whether `_pack` finds sizes (the binary search's test: no sizes retraced)."""
        total = self.settings.total_microbatches
        if num_nodes // min(sizes) > total:
            return self._pack(num_nodes, deadline, min_pipelines, sizes) is not None
        items = self._capacities(deadline, sizes)
        return bool(items) and most_microbatches(num_nodes, items, min_pipelines) >= total

    def _capacities(self, deadline: float, sizes: list[int]) -> list[tuple[int, int]]:
        """(size, microbatches it finishes by `deadline`) for the sizes that finish any."""
        total = self.settings.total_microbatches
        items = [(s, self.template(s).max_microbatches(deadline, total)) for s in sizes]
        return [(s, c) for s, c in items if c > 0]

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

    def stage_gradient_bytes(self, sizes: list[int]) -> float:
        """The gradient bytes of the largest stage of pipelines of `sizes`, in the dtype
        they are summed in (`_gradient_bytes`)."""
        return max(self._gradient_bytes(s) for s in set(sizes))

    def sync_bytes(self, sizes: list[int]) -> float:
        """Bytes a worker of the largest stage sends in a step's ring all-reduce of its
        gradients across `sizes`' pipelines (received alike): 2(k−1)/k of them."""
        k = len(sizes)
        return 0.0 if k == 1 else 2 * (k - 1) / k * self.stage_gradient_bytes(sizes)

    def _sync_time(self, sizes: list[int]) -> float:
        """Ring all-reduce of the largest stage's gradients across the pipelines."""
        return self.sync_bytes(sizes) / self.costs.hardware.inter_node_bandwidth

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
    """True when fewer than f+1 pipelines run (fewer than (f+1)·n0 nodes are used):
    fewer than f+1 replicas of some layer."""
    planning_time_s: float
    moved_bytes: int = 0
    """Layer state the move from the current plan sends (0 without a current plan)."""
    idle_nodes: tuple[str, ...] = ()
    """Nodes given that the plan leaves out, because no set of pipelines uses them all
    (`Planner.instantiate`); they wait for the next change of membership."""
    idle_reason: str = ""
    """Why some nodes are idle, and what would use them ("" when none is)."""
