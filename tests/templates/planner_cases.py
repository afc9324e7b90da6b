"""Shared by the planner's tests: cost models of made-up layers, the peak memory of the
best partition and of a plan's stages, the check every plan must pass, and hypothesis
strategies for random planner instances (`instances`, `memory_limited`)."""
from __future__ import annotations

import dataclasses

from hypothesis import assume
from hypothesis import strategies as st

from planaria.templates.costs import CostModel, Hardware, LayerCost, ModelShape
from planaria.templates.partition import partition_layers
from planaria.templates.partition_cost import InfeasiblePartition, in_flight_microbatches
from planaria.templates.plan import Plan


def cost_model(layers, memory, gpus_per_node=1, inter_node_bandwidth=1e9):
    """A CostModel of the given LayerCosts on a made-up node of `gpus_per_node` devices."""
    hw = Hardware(name="test", device_memory_bytes=memory, peak_flops=1e12,
                  gpus_per_node=gpus_per_node, intra_node_bandwidth=1e10,
                  inter_node_bandwidth=inter_node_bandwidth)
    shape = ModelShape(n_layers=len(layers) - 2, d_model=8, n_heads=1, vocab_size=8, seq_len=8)
    return CostModel(shape, hw, gpus_per_node, 1, tuple(layers))


def uniform(num_layers, memory, state, act, seconds=1.0):
    """num_layers identical layers with no sends."""
    layer = LayerCost(seconds / 3, 2 * seconds / 3, state, act, 0)
    return cost_model([layer] * num_layers, memory)


def min_peak(costs, stages, microbatches, schedule="1f1b"):
    """Smallest peak memory any partition into `stages` stages reaches (exact for v = 1)."""
    try:
        partition_layers(costs, stages, num_microbatches=microbatches, memory_bytes=0, schedule=schedule)
    except InfeasiblePartition as err:
        return err.shortfall_bytes
    return 0


def true_peaks(costs, plan, schedule):
    """Per stage of every pipeline, its peak memory for the microbatches it actually runs."""
    peaks = []
    for pipeline in plan.pipelines:
        num_stages, m = len(pipeline.stages), pipeline.num_microbatches
        for s, stage in enumerate(pipeline.stages):
            (start, stop), = stage.chunks
            held = in_flight_microbatches(schedule, s, num_stages, m)
            peaks.append(costs.state_bytes(start, stop) + held * costs.activation_bytes(start, stop))
    return peaks


def check_plan(planner, choice, num_nodes, node_ids):
    """Everything a PlanChoice for N nodes must satisfy, whatever the instance."""
    plan, costs, cfg = choice.plan, planner.costs, planner.settings
    assert isinstance(plan, Plan)
    Plan.from_json(plan.to_json())  # validates again
    assert plan.world_size == num_nodes * costs.tp
    used = [stage.node for p in plan.pipelines for stage in p.stages]
    assert sorted(used) == sorted(node_ids)  # every node exactly once
    assert plan.total_microbatches == cfg.global_batch // cfg.micro_batch
    assert all(p.num_microbatches >= 1 for p in plan.pipelines)
    assert choice.replicas == len(plan.pipelines)
    assert len(choice.pipeline_times_s) == len(plan.pipelines)
    assert choice.iteration_time_s >= max(choice.pipeline_times_s)
    limit = costs.hardware.device_memory_bytes
    for pipeline, seconds in zip(plan.pipelines, choice.pipeline_times_s):
        size = len(pipeline.stages)
        template = planner.template(size)
        assert pipeline.template_id == f"{size}-node"
        assert template.num_nodes == size == template.partition.num_stages
        assert max(template.partition.peak_memory_bytes) <= limit
        assert [stage.chunks for stage in pipeline.stages] == \
            [template.partition.stage_chunks(s) for s in range(size)]
        assert seconds == template.iteration_time(pipeline.num_microbatches)


@st.composite
def instances(draw, min_layers=7, max_layers=14, min_n0=1, max_n0=4,
              totals=st.integers(40, 64), max_activation_share=32):
    """(costs, f, total microbatches) with n0 between 1 and max_n0.

    The device memory is drawn between the smallest peak a k-stage partition reaches
    and the (k-1)-stage one, for a random k, so n0 is about k. Instances on which a
    template of size n0..2n0-1 does not fit (test_templates_up_to_2n0_fit_when_n0_does)
    are filtered out.
    """
    num_layers = draw(st.integers(min_layers, max_layers))
    gpus = draw(st.integers(1, 2))
    layers = []
    for _ in range(num_layers):
        forward = draw(st.floats(0.1, 2.0))
        state = draw(st.integers(1_000, 10_000))
        layers.append(LayerCost(
            forward_s=forward, backward_s=forward * draw(st.floats(1.0, 3.0)),
            state_bytes=state,
            activation_bytes=draw(st.integers(0, state // max_activation_share)),
            output_bytes=draw(st.integers(0, 10**8))))  # sends up to 0.2 s at 1 GB/s
    costs = cost_model(layers, 1, gpus)
    f = draw(st.integers(0, 2))
    total = draw(totals)
    reference = total  # what Planner partitions its templates for (and checks memory with)
    k = draw(st.integers(min_n0, min(max_n0, num_layers)))
    lo = min_peak(costs, k, reference)
    hi = min_peak(costs, k - 1, reference) - 1 if k > 1 else lo
    memory = max(1, draw(st.integers(lo, max(lo, hi))))
    peaks = [min_peak(costs, s, reference) for s in range(1, num_layers + 1)]
    n0 = next(s for s, p in enumerate(peaks, 1) if p <= memory)
    assume(2 * n0 - 1 <= num_layers and all(p <= memory for p in peaks[n0 - 1:2 * n0 - 1]))
    hw = dataclasses.replace(costs.hardware, device_memory_bytes=memory)
    return dataclasses.replace(costs, hardware=hw), f, total


@st.composite
def memory_limited(draw):
    """(costs, f, total microbatches): random layers, the first one's activations heavy
    at times, and a device memory anywhere from the least a partition needs to twice
    that. 1F1B's first stage holds one microbatch in flight per stage, so a heavy first
    layer can leave deeper templates unfit where n0's fits: then some node counts have
    no plan on all their nodes (N = 8 with n0 = 3, say). The inter-node bandwidth makes
    the gradient sync negligible, comparable to the compute, or dominant, so that deeper
    templates are built too."""
    num_layers = draw(st.integers(4, 10))
    layers = []
    for i in range(num_layers):
        forward = draw(st.floats(0.1, 2.0))
        state = draw(st.integers(1_000, 10_000))
        heavy = i == 0 and draw(st.booleans())
        layers.append(LayerCost(
            forward_s=forward, backward_s=2 * forward, state_bytes=state,
            activation_bytes=draw(st.integers(state // 2, 2 * state) if heavy else st.integers(0, state // 8)),
            output_bytes=draw(st.integers(0, 10**6))))
    bandwidth = draw(st.sampled_from([1e9, 1e4, 1e3]))
    costs = cost_model(layers, 1, draw(st.integers(1, 2)), inter_node_bandwidth=bandwidth)
    f = draw(st.integers(0, 2))
    total = draw(st.integers(max(f + 1, 4), 24))
    schedule = draw(st.sampled_from(["1f1b", "gpipe"]))
    least = min(min_peak(costs, s, total, schedule) for s in range(1, num_layers + 1))
    memory = draw(st.integers(least, 2 * least))
    hw = dataclasses.replace(costs.hardware, device_memory_bytes=memory)
    return dataclasses.replace(costs, hardware=hw), f, total, schedule
