"""Plans from an explicit layout: `parallel.layout`, or `pp` x `dp` homogeneous pipelines.

A layout lists, for each pipeline, the number of transformer blocks in each of its
model stages. The embedding goes with each pipeline's first model stage and the head
with its last. With `virtual_stages = v`, a pipeline's list has `S*v` entries (its
model stages, in model order) and the pipeline has `S` stages; model stage `j` sits
on stage `j % S`, which is the looped placement the interleaved schedule needs.

Nodes are numbered in rank order: node `i` runs ranks `[i*tp, (i+1)*tp)`.
"""
from __future__ import annotations

from typing import Sequence

from planaria.templates.plan import PipelinePlan, Plan, StagePlan


def even_layout(n_blocks: int, num_model_stages: int) -> list[int]:
    """Split `n_blocks` blocks into `num_model_stages` near-equal runs.

    Extra blocks go to the earliest stages: the last one also carries the head, whose
    vocabulary projection is the heaviest single layer. The planner replaces this
    with a cost-based cut.
    """
    if num_model_stages > n_blocks:
        raise ValueError(
            f"cannot cut {n_blocks} transformer blocks into {num_model_stages} model stages "
            "(parallel.pp * parallel.virtual_stages): every model stage needs at least one "
            "block; lower parallel.pp or parallel.virtual_stages, or raise model.n_layers"
        )
    base, extra = divmod(n_blocks, num_model_stages)
    return [base + (1 if j < extra else 0) for j in range(num_model_stages)]


def homogeneous_layout(n_blocks: int, pp: int, dp: int, virtual_stages: int) -> list[list[int]]:
    return [even_layout(n_blocks, pp * virtual_stages) for _ in range(dp)]


def even_microbatches(total: int, num_pipelines: int) -> list[int]:
    if total < num_pipelines:
        raise ValueError(
            f"global_batch / micro_batch = {total} microbatches cannot feed {num_pipelines} "
            "pipelines: raise train.global_batch or lower train.micro_batch"
        )
    base, extra = divmod(total, num_pipelines)
    return [base + (1 if p < extra else 0) for p in range(num_pipelines)]


def plan_from_layout(
    layout: Sequence[Sequence[int]],
    *,
    n_blocks: int,
    tp: int,
    schedule: str,
    virtual_stages: int,
    global_batch: int,
    micro_batch: int,
    microbatches: Sequence[int] | None = None,
    epoch: int = 0,
    first_iteration: int = 0,
) -> Plan:
    """Build (and thereby validate) the Plan for an explicit layout."""
    check_layout(layout, n_blocks=n_blocks, virtual_stages=virtual_stages)
    total = global_batch // micro_batch
    counts = list(microbatches) if microbatches is not None else even_microbatches(total, len(layout))
    if len(counts) != len(layout):
        raise ValueError(
            f"parallel.microbatches has {len(counts)} entries but the job has {len(layout)} "
            "pipeline(s) (parallel.layout, or the processes over tp x pp): give one count per pipeline"
        )
    pipelines = []
    next_rank = 0
    offset = 0
    for p, blocks in enumerate(layout):
        model_stages = _model_stage_ranges(blocks)
        num_stages = len(blocks) // virtual_stages
        stages = []
        for s in range(num_stages):
            node = next_rank // tp
            stages.append(StagePlan(
                node=f"node{node}",
                ranks=tuple(range(next_rank, next_rank + tp)),
                chunks=tuple(model_stages[c * num_stages + s] for c in range(virtual_stages)),
            ))
            next_rank += tp
        pipelines.append(PipelinePlan(
            template_id=f"layout{list(blocks)}",
            stages=tuple(stages),
            num_microbatches=int(counts[p]),
            sample_offset=offset,
        ))
        offset += int(counts[p]) * micro_batch
    return Plan(
        epoch=epoch, first_iteration=first_iteration, num_layers=n_blocks + 2, tp=tp,
        schedule=schedule, virtual_stages=virtual_stages, global_batch=global_batch,
        micro_batch=micro_batch, pipelines=tuple(pipelines),
    )


def check_layout(layout: Sequence[Sequence[int]], *, n_blocks: int, virtual_stages: int) -> None:
    if not isinstance(layout, (list, tuple)) or not all(isinstance(b, (list, tuple)) for b in layout):
        raise ValueError(
            f"parallel.layout must be a list of pipelines, each a list of blocks per stage, "
            f"e.g. [[4], [2, 2]]; got {layout!r}"
        )
    if not layout or any(not blocks for blocks in layout):
        raise ValueError("parallel.layout must list at least one pipeline, each with at least one stage")
    for p, blocks in enumerate(layout):
        if any((not isinstance(b, int)) or b < 1 for b in blocks):
            raise ValueError(
                f"parallel.layout pipeline {p} is {list(blocks)}: every model stage needs a "
                "positive whole number of transformer blocks"
            )
        if sum(blocks) != n_blocks:
            raise ValueError(
                f"parallel.layout pipeline {p} is {list(blocks)}, which adds up to {sum(blocks)} "
                f"blocks, but model.n_layers = {n_blocks}: make each pipeline's list add up to "
                "model.n_layers"
            )
        if len(blocks) % virtual_stages:
            raise ValueError(
                f"parallel.layout pipeline {p} has {len(blocks)} model stages, not a multiple of "
                f"parallel.virtual_stages = {virtual_stages}: with virtual stages, list the "
                "blocks of every chunk (stages x virtual_stages entries)"
            )


def _model_stage_ranges(blocks: Sequence[int]) -> list[tuple[int, int]]:
    """Layer ranges of the model stages: the embedding joins the first, the head the last."""
    ranges = []
    start = 0
    for j, count in enumerate(blocks):
        stop = start + count + (1 if j == 0 else 0) + (1 if j == len(blocks) - 1 else 0)
        ranges.append((start, stop))
        start = stop
    return ranges
