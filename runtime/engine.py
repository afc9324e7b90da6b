"""The training engine of one worker for one epoch's Plan.

Owns the worker's layers (each with its own optimizer), the pipeline stages and
schedule, and the iteration: pipelined forward/backward, layer-wise gradient sync
over replica groups, the commit all-reduce, clipping, and the optimizer step.

Everything that depends on the plan (process groups, stages, schedule) is built in
`_build_epoch` from the plan alone, so a later reconfiguration can tear it down and
build the next epoch's in the same process while keeping the layers it still owns.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from planaria.runtime.groups import EpochGroups
from planaria.runtime.model import LayerModel
from planaria.runtime.optim import OptimizerSettings, build_optimizer, learning_rate, set_learning_rate
from planaria.runtime.pipeline import PlanSchedule, build_stages
from planaria.templates.plan import Plan


@dataclass
class LayerState:
    """One layer's tp shard on this worker: parameters and their optimizer state."""

    index: int
    module: nn.Module
    optimizer: torch.optim.Optimizer
    shard_dims: dict[str, int]


@dataclass(frozen=True)
class StepResult:
    iteration: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    step_time_s: float


class Engine:
    """Runs iterations of one Plan on one worker. Process groups are passed, never global."""

    def __init__(self, plan: Plan, model: LayerModel, optim: OptimizerSettings, *, rank: int,
                 device: torch.device, param_dtype: torch.dtype,
                 autocast_dtype: torch.dtype | None = None, grad_clip: float = 1.0,
                 world: dist.ProcessGroup | None = None, collective_timeout: timedelta | None = None):
        self.model = model
        self.optim = optim
        self.rank = rank
        self.device = device
        self.param_dtype = param_dtype
        self.autocast_dtype = autocast_dtype
        self.grad_clip = grad_clip
        self.collective_timeout = collective_timeout
        self.layers: dict[int, LayerState] = {}
        self._build_epoch(plan, world)

    # ----------------------------------------------------------- epoch set-up
    def _build_epoch(self, plan: Plan, world: dist.ProcessGroup | None) -> None:
        self.plan = plan
        self.info = plan.rank_info(self.rank)
        self.pipeline = plan.pipelines[self.info.pipeline]
        self.groups = EpochGroups.build(plan, self.rank, world, timeout=self.collective_timeout)
        tp = self.groups.tensor_parallel
        for index in plan.layers_of(self.rank):
            if index not in self.layers:
                self.layers[index] = self._new_layer(index)
        self._grad_norm_owner = set(self.owned_shards())
        self.schedule, self.stages = self._build_schedule(tp)

    def _new_layer(self, index: int) -> LayerState:
        module = self.model.build_layer(index, self.groups.tensor_parallel, self.param_dtype, self.device)
        return LayerState(index, module, build_optimizer(module, self.optim), self.model.shard_dims(index))

    def _build_schedule(self, tp):
        stage = self.plan.stage_of(self.rank)
        num_stages = len(self.pipeline.stages)
        chunks = [
            (c * num_stages + self.info.stage,
             nn.Sequential(*(self.layers[i].module for i in range(start, stop))))
            for c, (start, stop) in enumerate(stage.chunks)
        ]
        stages = build_stages(chunks, num_stages * self.plan.virtual_stages,
                              self.groups.pipeline, self.device)
        total = self.plan.total_microbatches

        def loss_fn(logits_local: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # Scaled by the iteration's total microbatches, all pipelines together, so
            # the summed gradient is the full batch's mean whatever the split.
            return self.model.loss(logits_local, target, tp) / total

        schedule = PlanSchedule(stages, self.plan.schedule, self.pipeline.num_microbatches, loss_fn)
        return schedule, stages

    def destroy(self) -> None:
        self.groups.destroy()

    # ------------------------------------------------------------- iteration
    def train_step(self, iteration: int, dataset, data_seed: int) -> StepResult:
        start = time.perf_counter()
        plan = self.plan
        count = self.pipeline.num_microbatches * plan.micro_batch
        inputs, targets = dataset.batch(iteration, plan.global_batch, data_seed,
                                        start=self.pipeline.sample_offset, count=count)
        losses = self._forward_backward(inputs.to(self.device), targets.to(self.device))
        self._sync_gradients()
        loss, grad_norm = self._commit(losses)
        lr = learning_rate(iteration, self.optim)
        self._clip_and_step(grad_norm, lr)
        tokens = plan.global_batch * inputs.shape[1]
        return StepResult(iteration, loss, grad_norm, lr, tokens, time.perf_counter() - start)

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        for state in self.layers.values():
            state.optimizer.zero_grad(set_to_none=True)
        is_first = any(s.is_first for s in self.stages)
        is_last = any(s.is_last for s in self.stages)
        args = (inputs,) if is_first else ()
        losses: list[torch.Tensor] = []
        with self._autocast():
            self.schedule.step(*args, target=targets if is_last else None,
                               losses=losses if is_last else None, return_outputs=False)
        return losses

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _local_grads(self, layer: int) -> list[torch.Tensor]:
        grads = []
        for p in self.layers[layer].module.parameters():
            if p.grad is None:  # a parameter this iteration did not reach
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        return grads

    def _sync_gradients(self) -> None:
        """Sum each layer's gradient over its replica group, one bucket per distinct group."""
        for bucket in self.groups.buckets:
            if bucket.group is None:
                continue
            grads = [g for layer in bucket.layers for g in self._local_grads(layer)]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=bucket.group)
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)

    def _commit(self, losses: list[torch.Tensor]) -> tuple[float, float]:
        """World all-reduce of [squared grad norm, loss]; every rank gets the same values.

        Each layer's norm is counted once (its replica group's first rank); replicated
        (non-sharded) tensors are counted by tp rank 0 only. The loss comes from tp rank 0
        of each pipeline's last stage. Completing this all-reduce is the commit point.
        """
        counted = [p.grad for layer in self._grad_norm_owner
                   for name, p in self.layers[layer].module.named_parameters()
                   if name in self.layers[layer].shard_dims or self.info.tp_rank == 0]
        squared = torch.zeros((), dtype=torch.float64, device=self.device)
        if counted:
            squared = torch.nn.utils.get_total_norm(counted, foreach=True).double().pow(2)
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        if losses and self.info.tp_rank == 0:
            loss = torch.stack([l.detach().double() for l in losses]).sum()
        vector = torch.stack([squared, loss])
        dist.all_reduce(vector, group=self.groups.world)
        return float(vector[1]), math.sqrt(float(vector[0]))

    def _clip_and_step(self, grad_norm: float, lr: float) -> None:
        if self.grad_clip > 0:
            # clip_grad_norm_'s formula, applied with the global norm every rank agreed on.
            params = [p for state in self.layers.values() for p in state.module.parameters()]
            total = torch.tensor(grad_norm, dtype=self.param_dtype, device=self.device)
            torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, total, foreach=True)
        for state in self.layers.values():
            set_learning_rate(state.optimizer, lr)
            state.optimizer.step()

    # ---------------------------------------------------------------- state
    def owned_shards(self) -> list[int]:
        """Layers this rank speaks for (grad norm, saving): it is first in their replica group."""
        tp_rank = self.info.tp_rank
        return sorted(layer for (layer, t), ranks in self.plan.replica_groups().items()
                      if t == tp_rank and ranks[0] == self.rank)
