"""Execute one pipeline's schedule with `torch.distributed.pipelining`: a rank's stages
over its layers, and the schedule that runs them (`stage_schedule`).

Planaria's schedules are data (`planaria.templates.schedules`): per-rank lists of
compute actions, checked by a simulator before anything runs. Here they are handed
to torch's `_PipelineScheduleRuntime`, which inserts the sends and receives and runs
them against `PipelineStage`s. torch's own schedule classes compute the same kind of
list, but only from live stages; building the list ourselves is what lets the planner
and the tests check a schedule without processes.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (_Action, _add_send_recv, _ComputationType,
                                                   _PipelineScheduleRuntime)

from planaria.templates.plan import Plan
from planaria.templates.schedules import build_schedule

if TYPE_CHECKING:
    from planaria.runtime.models.llama import LayerModel
    from planaria.runtime.models.tensor_parallel import TensorParallel

MIN_TORCH = (2, 10)
"""The oldest torch whose schedule runtime Planaria's pipelines are tested on (pyproject.toml)."""
if tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < MIN_TORCH:
    raise ImportError(f"Planaria's pipelines need torch {'.'.join(map(str, MIN_TORCH))} or later, found "
                      f"{torch.__version__}: the private schedule runtime they run on changed before it "
                      f"(pip install 'torch>={'.'.join(map(str, MIN_TORCH))}')")

_KINDS = {
    "F": _ComputationType.FORWARD,
    "B": _ComputationType.FULL_BACKWARD,
    "I": _ComputationType.BACKWARD_INPUT,
    "W": _ComputationType.BACKWARD_WEIGHT,
}


class PlanSchedule(_PipelineScheduleRuntime):
    """torch's schedule runtime, loaded with an action list from Planaria's generator."""

    def __init__(self, stages: list[PipelineStage], schedule: str, num_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], forward_only: bool = False):
        """`forward_only`: the schedule's forward actions alone, in their order (removing
        the backward actions removes dependencies, never adds one), run with `eval`."""
        # Gradients are scaled by the loss function (1 / total microbatches of the
        # iteration, all pipelines together), so the runtime must not scale again.
        super().__init__(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)
        num_ranks = stages[0].group_size
        virtual_stages = len(stages)
        actions = build_schedule(schedule, num_ranks, virtual_stages, num_microbatches)
        self.pipeline_order = {
            rank: [_Action(a.stage, _KINDS[a.kind], a.microbatch) for a in rank_actions
                   if a.kind == "F" or not forward_only]
            for rank, rank_actions in actions.items()
        }
        if forward_only:
            self._prepare_forward_only(self.pipeline_order)
        else:
            self._prepare_schedule_with_comms(self.pipeline_order)

    def _prepare_forward_only(self, actions: dict[int, list[_Action]]) -> None:
        """`_prepare_schedule_with_comms` for a list of forward actions: torch's version
        first checks that every microbatch has its backward, which this list lacks by
        design (the full schedule it comes from passed Planaria's simulator)."""
        mapping = {a.stage_index: rank for rank, rank_actions in actions.items() for a in rank_actions}
        self.stage_index_to_group_rank = mapping
        for stage in self._stages:
            stage.stage_index_to_group_rank = mapping
        self.pipeline_order_with_comms = _add_send_recv(
            {rank: list(rank_actions) for rank, rank_actions in actions.items()},
            stage_to_rank=lambda s: mapping[s], num_stages=self._num_stages)


def build_stages(chunks: list[tuple[int, nn.Module]], num_model_stages: int,
                 group: dist.ProcessGroup, device: torch.device,
                 examples: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> list[PipelineStage]:
    """One `PipelineStage` per local chunk, given as (model stage index, module).

    `examples`: per chunk, an (input, output) of one microbatch, any device (the meta
    device will do): torch's static metadata. Without it a stage infers its metadata
    at its first step: a forward and a backward of one microbatch on empty tensors,
    stage after stage across the pipeline, each sending the next its pickled
    metadata; every new epoch's first step paid that
    (benchmarks/pipeline_first_step.py). torch trusts static metadata blindly (a
    wrong shape corrupts what the next stage receives), so a forward hook on each
    chunk's module checks its real output against the example before it is sent
    (the engine makes new chunk modules for each schedule it builds)."""
    if examples is None:
        return [PipelineStage(module, stage_index, num_model_stages, device, group=group)
                for stage_index, module in chunks]
    if len(examples) != len(chunks):
        raise ValueError(f"{len(examples)} examples for {len(chunks)} chunks")
    stages = []
    for (stage_index, module), (inputs, outputs) in zip(chunks, examples):
        module.register_forward_hook(_check_output(stage_index, outputs))
        stages.append(PipelineStage(module, stage_index, num_model_stages, device, input_args=inputs,
                                    output_args=outputs, group=group))
    return stages


def stage_schedule(plan: Plan, rank: int, layers: Mapping[int, nn.Module], model: LayerModel, tp: TensorParallel,
                   group: dist.ProcessGroup, device: torch.device, *,
                   examples: list[tuple[torch.Tensor, torch.Tensor]] | None, forward_only: bool = False,
                   ) -> tuple[PlanSchedule, list[PipelineStage]]:
    """The stages of `rank` in its pipeline of `plan` and their schedule: one stage per
    chunk of its layers' modules (`layers`: index -> module), with the chunks' static
    metadata `examples` (None: torch infers it), and the loss of the model's last layer
    scaled by the iteration's total microbatches, all pipelines together, so that the
    summed gradient is the full batch's mean whatever the split."""
    info = plan.rank_info(rank)
    pipeline = plan.pipelines[info.pipeline]
    num_stages = len(pipeline.stages)
    chunks = [(c * num_stages + info.stage, nn.Sequential(*(layers[i] for i in range(start, stop))))
              for c, (start, stop) in enumerate(plan.stage_of(rank).chunks)]
    stages = build_stages(chunks, num_stages * plan.virtual_stages, group, device, examples=examples)
    total = plan.total_microbatches
    head = layers.get(model.num_layers - 1)  # only the last stage's loss runs

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return model.loss(output, target, tp, head=head) / total

    schedule = PlanSchedule(stages, plan.schedule, pipeline.num_microbatches, loss_fn, forward_only=forward_only)
    return schedule, stages


def _check_output(stage_index: int, example: torch.Tensor):
    """A forward hook raising unless a chunk's output has the example's shape, dtype and
    strides: the receiving stage's buffer is made from the same metadata, so a mismatch
    fails here instead of arriving as wrong numbers (or a hang) on the next rank."""
    expected = (example.shape, example.dtype, example.stride())

    def check(module: nn.Module, args, output) -> None:
        got = (output.shape, output.dtype, output.stride()) if isinstance(output, torch.Tensor) else type(output)
        if got != expected:
            raise RuntimeError(f"pipeline stage {stage_index} produced {got}; its static metadata "
                               f"says {expected}: `LayerModel.stage_examples` does not describe this "
                               "model's layers; report it with the job's config")

    return check
