"""Random valid jobs (a hypothesis strategy for `plan_from_layout`'s arguments) and a known
good plan, shared by the plan contract's tests (`test_plan.py`, `test_plan_transfers.py`)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from planaria.templates.layout import plan_from_layout
from planaria.templates.plan import Plan


def _cut(draw, total: int, parts: int) -> list[int]:
    """`total` split into `parts` positive integers."""
    if parts == 1:
        return [total]
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@st.composite
def layout_args(draw, tp=None, v=None, n_blocks=None, num_stages_total=None):
    """Keyword arguments for `plan_from_layout` describing a random valid job."""
    tp = draw(st.integers(1, 2)) if tp is None else tp
    v = draw(st.integers(1, 2)) if v is None else v
    schedule = "interleaved" if v > 1 else draw(st.sampled_from(["1f1b", "gpipe"]))
    n_blocks = draw(st.integers(v, 12)) if n_blocks is None else n_blocks
    max_stages = min(4, n_blocks) // v  # 1..4 model stages per pipeline
    if num_stages_total is None:
        num_pipelines = draw(st.integers(1, 4))
        stage_counts = [draw(st.integers(1, max_stages)) for _ in range(num_pipelines)]
    else:  # a fixed number of nodes, split among pipelines
        stage_counts, left = [], num_stages_total
        while left:
            stage_counts.append(draw(st.integers(1, min(max_stages, left))))
            left -= stage_counts[-1]
    layout = [_cut(draw, n_blocks, s * v) for s in stage_counts]
    micro_batch = draw(st.integers(1, 4))
    counts = [draw(st.integers(1, 4)) for _ in layout]
    explicit = draw(st.booleans())
    return dict(
        layout=layout,
        n_blocks=n_blocks,
        tp=tp,
        schedule=schedule,
        virtual_stages=v,
        global_batch=sum(counts) * micro_batch,
        micro_batch=micro_batch,
        microbatches=counts if explicit else None,
        epoch=draw(st.integers(0, 5)),
        first_iteration=draw(st.integers(0, 1000)),
    )


def relabel(plan: Plan, names: dict[str, str]) -> Plan:
    """The same plan with stage nodes renamed."""
    return replace(plan, pipelines=tuple(
        replace(p, stages=tuple(replace(s, node=names[s.node]) for s in p.stages))
        for p in plan.pipelines
    ))


def good_plan(**overrides) -> Plan:
    """2 pipelines x 2 stages, tp=2, 4 blocks (6 layers), 4 microbatches."""
    args = dict(n_blocks=4, tp=2, schedule="1f1b", virtual_stages=1,
                global_batch=8, micro_batch=2)
    args.update(overrides)
    return plan_from_layout([[2, 2], [2, 2]], **args)
