"""The training engine of one worker for one epoch's Plan.

Owns the worker's layers (each with its own optimizer), the pipeline stages and
schedule, and the iteration: pipelined forward/backward, layer-wise gradient sync
over replica groups, the commit all-reduce, clipping, and the optimizer step.

Everything that depends on the plan (process groups, stages, schedule) is built in
`_build_epoch` from the plan alone, so `enter_epoch` can tear it down and build the
next epoch's in the same process while keeping the layers it still owns, with their
optimizer state untouched; the others come from a `LayerSource` (received from their
replicas, loaded from a checkpoint, restored from peer snapshots: the kinds are
`planaria.runtime.state.layer_sources`, which this room never imports). How the engine
computes (dtypes, clipping, wide gradient sums, timeouts) is fixed for its life by its
`EngineSettings`.

The engine also keeps what the exactly-once rule needs (`planaria.runtime.contract.exactly_once`):
the last iteration it stepped with its commit record, and whether the gradients of the
next one are synced. A `phase` callback, when given, is called as each phase of an
iteration starts (forward and backward once per microbatch and chunk, then "sync",
"commit", "committed", "step"); fault injection and progress tracking hook in there.

One class over one epoch's state, a little over 500 lines: what stands apart from that
state is elsewhere (the gradient sync: `grad_sync`; a stage's schedule: `pipeline`; where
layers come from: `planaria.runtime.state.layer_sources`).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn

from planaria.runtime.contract.exactly_once import INCOMPLETE, SYNCED, CommitRecord, WorkerStatus
from planaria.runtime.models.llama import LayerModel
from planaria.runtime.parallel.grad_sync import accumulate_wide, sync_gradients
from planaria.runtime.parallel.precision import compute_params
from planaria.runtime.parallel.groups import EpochGroups
from planaria.runtime.parallel.optim import OptimizerSettings, build_optimizer, learning_rate, set_learning_rate
from planaria.runtime.parallel.pipeline import PlanSchedule, stage_schedule
from planaria.templates.plan import Plan


@dataclass
class LayerState:
    """One layer's tp shard on this worker: parameters and their optimizer state."""

    index: int
    module: nn.Module
    optimizer: torch.optim.Optimizer
    norm_names: frozenset[str]
    """Parameters this tp rank counts in the global gradient norm (`LayerModel.counts_in_norm`)."""


class TornStep(RuntimeError):
    """An optimizer step failed part-way on this worker (an error after the gradients were
    clipped in place, or between two layers' updates): its layers hold neither the state
    before the step nor the one after, and a roll forward would clip or step them twice.
    The worker must leave the job; its layers are recovered from their replicas."""

    def __init__(self, iteration: int, cause: BaseException):
        super().__init__(f"the optimizer step of iteration {iteration} failed part-way ({cause}); "
                         "this worker's layers hold neither step's state")
        self.iteration = iteration


@dataclass(frozen=True)
class StepResult:
    iteration: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    step_time_s: float
    stop_requested: bool = False
    busy: int = 0
    """Workers that said `busy` before this step's commit (their peer snapshot exchange
    was still going on): the same on every worker."""


@dataclass(frozen=True)
class EngineSettings:
    """How an engine computes and communicates, fixed for its life (`build_engine`
    makes them from the config, so that every kind of job runs the same numerics)."""

    device: torch.device
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None = None
    """Mixed precision: the forward runs under autocast to this dtype (None: off)."""
    compute_dtype: torch.dtype | None = None
    """Mixed precision: the forward reads copies of the parameters in this dtype, made
    once per step (`precision.compute_params`; None: the parameters themselves)."""
    grad_clip: float = 1.0
    """The global gradient norm is clipped to this (0: no clipping)."""
    grad_accum_dtype: torch.dtype | None = None
    """float64 (`train.exact_reduction`): gradients are summed over microbatches and
    replicas in this dtype, in `main_grad`, and rounded to the parameters' dtype once,
    after the sync, so that the sum does not depend on the plan's split of the batch.
    None, or the parameters' own dtype: summed in `grad`."""
    fetch_ahead: bool | None = None
    """Read the next iteration's batch and start its copy to the device while this one's
    computation runs (`Engine._fetch_ahead`); None: on GPUs, whose kernels run while the
    host is free; on a CPU the read would only take the step's own cores."""
    collective_timeout: timedelta | None = None
    connect_timeout: timedelta | None = None
    """How long an epoch's process groups may take to connect (None: `collective_timeout`)."""

    @property
    def read_dtype(self) -> torch.dtype:
        """The dtype of the parameters the forward reads."""
        return self.compute_dtype or self.param_dtype

    @property
    def wide_sums(self) -> torch.dtype | None:
        """The dtype gradients are summed in apart from the parameters', or None."""
        return self.grad_accum_dtype if self.grad_accum_dtype != self.param_dtype else None


class LayerSource(Protocol):
    """Where an epoch's layers come from besides those this worker keeps: `enter_epoch`
    calls `fill` once the epoch's groups are built (`planaria.runtime.state.layer_sources`
    has the kinds: replicas, a checkpoint, peer snapshots)."""

    restores: bool
    """The layers come as they were after an earlier step (a checkpoint, a peer
    snapshot): the engine holds none of its own until they are in, and `fill` says
    which step they are of (`Engine.resume_at`)."""

    def fill(self, engine: "Engine") -> None:
        """Install the plan's layers this rank lacks (`Engine.install_shards`); collective
        with every other worker's `fill` of the same plan."""


class Engine:
    """Runs iterations of one Plan on one worker. Process groups are passed, never global.

    Built empty (no plan, no layers, no communication); `enter_epoch` is the one way
    into an epoch, the first and every later one."""

    _eval_schedule: PlanSchedule | None = None
    _evaluating = False
    _ahead: tuple | None = None
    """The next iteration's batch, fetched ahead (`_fetch_ahead`): (dataset, which batch, tensors)."""

    def __init__(self, model: LayerModel, optim: OptimizerSettings, settings: EngineSettings, *,
                 phase: Callable[[str, int], None] | None = None, layer_phases: bool | None = None):
        """`phase`: called with each phase of an iteration (fault injection, progress);
        `layer_phases`: also each layer's forward and backward (hooks on every layer;
        default: whenever there is a `phase`)."""
        self.model = model
        self.optim = optim
        self.settings = settings
        self.device = settings.device
        self.grad_accum_dtype = settings.wide_sums
        self._phase = phase or (lambda name, iteration: None)
        self._has_phase_hooks = phase is not None if layer_phases is None else layer_phases
        self.plan: Plan | None = None
        self.rank = -1
        self.groups: EpochGroups | None = None
        self.schedule, self.stages = None, []
        self.iteration = 0
        self.last_stepped: int | None = None
        """The last iteration this worker stepped; None until its first epoch says."""
        self.last_commit: CommitRecord | None = None
        self.synced = False
        """The gradients of iteration last_stepped + 1 are fully synced."""
        self.agreed_s: float | None = None
        """When this epoch's ranks were found to start it at the same iteration (wall
        clock; `_check_agreed_start`): every rank was in the epoch then."""
        self._shards: dict[int, LayerState] = {}
        self.tp = None  # one TensorParallel for the engine's life: layers keep it
        self._tied = dict(model.tied_parameters())
        """Layer -> the name of its copy of the tied weight (tied embeddings)."""

    @property
    def tied_layers(self) -> tuple[int, ...]:
        """The layers holding copies of one tied weight, as the epoch's groups are built
        for them (`EpochGroups.build`)."""
        return tuple(self._tied)

    def enter_epoch(self, plan: Plan, rank: int, world: dist.ProcessGroup | None = None, *,
                    layers: LayerSource | None = None) -> None:
        """Move to `plan` as `rank` of `world` (None: the default group), from wherever
        this engine is (new, or at the end of an epoch that finished or failed): the
        epoch's groups built; then the layers this rank lacks filled by `layers`
        (received from their holders, loaded from a checkpoint, restored from peer
        snapshots), or, with no source, only a new job's layers built from their seeds.

        After a source filled them, a barrier; only then are the layers the plan no
        longer gives this rank dropped: once the barrier completed anywhere, every worker
        had its layers, so a failure at any earlier point leaves every layer with the
        holders it had (`held()` says which). When no rank drops a layer (a join that
        only adds replicas) and nothing is restored, there is nothing for it to guard,
        and it is left out: every rank learns whether any drops in the agreed-start
        check, so all decide alike. Layers still missing are built from their seeds,
        which is allowed only before the first step."""
        restoring = layers is not None and layers.restores
        self.agreed_s = None
        if not restoring:
            self._check_continues(plan)
        self.abandon_epoch()
        self._drop_gradients()  # of an interrupted iteration: it runs again from scratch
        self.rank = rank
        if restoring:
            # Holding nothing until the restore is in: a failure meanwhile reports no
            # layers (never a mix of the old step's and the restored one's).
            self._shards.clear()
        self._build_epoch(plan, world)
        kept = set(plan.layers_of(rank))
        dropped = [i for i in self._shards if i not in kept]  # (a source fills only layers of the plan)
        guarded = self._check_agreed_start(plan, guard=bool(dropped) or restoring)
        if layers is not None:
            layers.fill(self)
            if guarded:
                dist.barrier(group=self.groups.world)
        for index in dropped:
            self.drop_shard(index)
        self._add_fresh_layers()
        self.iteration, self.synced = plan.first_iteration, False
        self._build_pipeline()

    def _check_agreed_start(self, plan: Plan, guard: bool) -> bool:
        """Every rank of the epoch starts it at the same iteration, checked before any
        layer moves: ranks whose plans disagree on it would otherwise train on, their
        collectives lining up step for step, each on its own iteration's data (a
        joiner told a wrong first iteration did: docs/recovery.md). The sum of the
        iteration and of its square over the ranks equals the world's size times this
        rank's only if every rank has the same (taken modulo 2^16, exact in float64 up
        to millions of ranks). The same all-reduce counts the ranks that want the
        barrier after the copy (`guard`): True if any does."""
        first = float(plan.first_iteration % 65536)
        found = torch.tensor([first, first * first, float(guard)], dtype=torch.float64, device=self.device)
        dist.all_reduce(found, group=self.groups.world)
        size = dist.get_world_size(self.groups.world)
        *iterations, guards = found.tolist()
        if iterations != [size * first, size * first * first]:
            raise RuntimeError(f"the ranks of epoch {plan.epoch} disagree on its first iteration (this rank's: "
                               f"{plan.first_iteration}); the epoch is given up before any layer moves")
        self.agreed_s = time.time()
        return guards > 0

    def _check_continues(self, plan: Plan) -> None:
        """A plan must start right after this worker's last step; a new engine (no step
        yet known) takes the plan's word for where the job is (a restore, its own)."""
        if self.last_stepped is None:
            self.last_stepped = plan.first_iteration - 1
        elif plan.first_iteration != self.last_stepped + 1:
            raise RuntimeError(f"the plan of epoch {plan.epoch} starts at iteration "
                               f"{plan.first_iteration}, but this worker last stepped "
                               f"{self.last_stepped}")

    def _add_fresh_layers(self) -> None:
        """Build from their seeds the plan's layers this worker lacks: only right before
        the first step, when every replica still holds exactly that state."""
        missing = [i for i in self.plan.layers_of(self.rank) if i not in self._shards]
        if missing and self.last_stepped >= 0:
            raise RuntimeError(f"layers {missing} were neither held nor received, and iteration "
                               f"{self.last_stepped} was already stepped: their state is lost")
        for index in missing:
            self._shards[index] = self._build_shard(index, pretrained=True)

    # ----------------------------------------------------------- epoch set-up
    def _build_epoch(self, plan: Plan, world: dist.ProcessGroup | None) -> None:
        self.plan = plan
        self.info = plan.rank_info(self.rank)
        self.pipeline = plan.pipelines[self.info.pipeline]
        self.groups = EpochGroups.build(plan, self.rank, world, timeout=self.settings.collective_timeout,
                                        connect_timeout=self.settings.connect_timeout,
                                        tied_layers=self.tied_layers)
        new_tp = self.groups.tensor_parallel
        if self.tp is None:
            self.tp = new_tp
        else:  # the layers built in earlier epochs hold self.tp: point it at the new group
            if (new_tp.rank, new_tp.size) != (self.tp.rank, self.tp.size):
                raise ValueError(f"a worker keeps its tp rank across epochs; got rank "
                                 f"{new_tp.rank} of {new_tp.size}, was {self.tp.rank} of {self.tp.size}")
            self.tp.group = new_tp.group
        self.groups.tensor_parallel = self.tp

    def _build_pipeline(self) -> None:
        self._grad_norm_owner = set(self.owned_shards())
        self.schedule, self.stages = self._build_schedule(self.tp)
        self._eval_schedule = None  # built at the epoch's first evaluation

    def _build_shard(self, index: int, pretrained: bool = False) -> LayerState:
        """A layer's shard with its optimizer. `pretrained`: its initial state, read from
        `model.init_from` when set; otherwise an empty shell that a checkpoint or a
        replica is about to fill (so the Hugging Face checkpoint is not read for it)."""
        module = self.model.build_layer(index, self.tp, self.settings.param_dtype, self.device,
                                        pretrained=pretrained)
        if self._has_phase_hooks:
            module.register_forward_hook(self._phase_hook)
        if self.grad_accum_dtype is not None:
            accumulate_wide(module, self.grad_accum_dtype)
        counted = frozenset(name for name, _ in module.named_parameters()
                            if self.model.counts_in_norm(index, name, self.tp.rank, self.tp.size))
        return LayerState(index, module, build_optimizer(module, self.optim), counted)

    def _phase_hook(self, module, args, output) -> None:
        """Forward hook: report the layer's forward, and its backward when the gradient
        of its output arrives (a tensor hook: module backward hooks would rewrap the
        layer's inputs and outputs in the pipeline runtime's graph)."""
        if self._evaluating:
            return  # not a phase of an iteration: faults and progress ignore it
        self._phase("forward", self.iteration)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self._phase("backward", self.iteration))

    # ----------------------------------------------------- reconfiguration
    def abandon_epoch(self) -> None:
        """Forget this epoch's process groups after a failure (they may be broken).

        Every reference goes (groups, stages, schedule, the tp group the layers share), so
        that the groups' sockets close now: peers blocked on this worker then fail at
        once instead of at their timeout."""
        if self.groups is not None:
            with contextlib.suppress(Exception):
                self.groups.destroy()
        self._forget_epoch()

    def _forget_epoch(self) -> None:
        """Drop the epoch's groups, stages and schedules (training and evaluation): what
        holds sockets, buffers and pending work of the epoch's communication."""
        self.groups, self.schedule, self.stages = None, None, []
        self._eval_schedule, self._eval_stages = None, []
        self._ahead = None
        if self.tp is not None:
            self.tp.group = None

    def roll_forward(self, record: CommitRecord) -> bool:
        """Apply the step of `record` if this worker is one behind with synced gradients
        (the exactly-once rule's roll forward); True if it stepped."""
        if self.last_stepped != record.iteration - 1:
            return False
        if not self.synced:
            raise RuntimeError(f"told to roll forward iteration {record.iteration}, but its "
                               "gradients are not synced on this worker")
        self._step(record)
        return True

    def check_restore(self, step: int, what: str) -> None:
        """A restore of `what` (a checkpoint, a peer snapshot) must be of the step right
        before the plan's first: a `LayerSource` that restores asks before it reads any
        layer (a mismatch is the caller's error, not a torn restore)."""
        if self.plan.first_iteration != step + 1:
            raise RuntimeError(f"the plan of epoch {self.plan.epoch} starts at iteration "
                               f"{self.plan.first_iteration}; {what} is of {step}")

    def resume_at(self, commit: CommitRecord) -> None:
        """The layers just installed are as they were after the step of `commit` (checked
        by `check_restore`): the engine goes on from the step after it. A `LayerSource`
        that restores says so once every layer is in."""
        self.last_stepped, self.iteration, self.synced = commit.iteration, commit.iteration + 1, False
        self.last_commit = commit

    def held(self) -> tuple[tuple[int, int], ...]:
        """(layer, tp rank) shards whose state at `last_stepped` this worker holds."""
        return tuple((index, self.tp.rank) for index in sorted(self._shards))

    def status(self, worker: tuple[str, int], finished: bool = False) -> WorkerStatus:
        return WorkerStatus(worker=worker, last_stepped=self.last_stepped,
                            state=SYNCED if self.synced else INCOMPLETE, commit=self.last_commit,
                            holds=self.held(), finished=finished)

    def _build_schedule(self, tp, forward_only: bool = False):
        """This rank's stages over the layers it holds and their schedule (`stage_schedule`)."""
        chunks = self.plan.stage_of(self.rank).chunks
        return stage_schedule(self.plan, self.rank, {index: state.module for index, state in self._shards.items()},
                              self.model, tp, self.groups.pipeline, self.device,
                              examples=self._stage_examples(chunks, tp, forward_only), forward_only=forward_only)

    def _stage_examples(self, chunks, tp, forward_only: bool):
        """Each chunk's input and output of one microbatch, for `build_stages`'s static
        metadata (`LayerModel.stage_examples`)."""
        return [self.model.stage_examples(start, stop, self.plan.micro_batch, tp.size, self.settings.read_dtype,
                                          self.settings.autocast_dtype, requires_grad=not forward_only)
                for start, stop in chunks]

    def destroy(self) -> None:
        """The end of the job: destroy the epoch's groups and drop every object of the
        epoch, so that no stage or schedule keeps the groups' work alive until the
        interpreter's exit (gloo aborts a process whose work outlives its group)."""
        if self.groups is not None:  # None after abandon_epoch
            self.groups.destroy()
        self._forget_epoch()

    # ------------------------------------------------------------- iteration
    def train_step(self, iteration: int, dataset, data_seed: int,
                   request: Callable[[], bool] | None = None,
                   busy: Callable[[], bool] | None = None) -> StepResult:
        """One iteration. `request`, when given, is asked before the commit whether this
        worker wants the job to stop after this iteration; the commit all-reduce carries
        the answer, so every worker learns the same (`StepResult.stop_requested`).
        `busy`, likewise: whether background work of this worker that all must agree on
        (the peer snapshots' exchange) is still going on; the commit counts them
        (`StepResult.busy`), at no cost beyond one more number in its all-reduce."""
        if iteration != self.last_stepped + 1:
            raise RuntimeError(f"iteration {iteration} cannot run: this worker last stepped "
                               f"{self.last_stepped}")
        start = time.perf_counter()
        plan = self.plan
        self.iteration, self.synced = iteration, False
        self._phase("begin", iteration)
        inputs, targets = self._batch(dataset, iteration, data_seed)
        losses = self._forward_backward(inputs, targets)
        if self._fetches_ahead:
            self._fetch_ahead(dataset, iteration + 1, data_seed)
        self._phase("sync", iteration)
        self._sync_gradients()
        self.synced = True
        self._phase("commit", iteration)
        loss, grad_norm, stop, busy_workers = self._commit(losses, bool(request and request()),
                                                           bool(busy and busy()))
        record = CommitRecord(iteration, loss, grad_norm)
        self._phase("committed", iteration)
        lr = self._step(record)
        tokens = plan.global_batch * inputs.shape[1]
        return StepResult(iteration, loss, grad_norm, lr, tokens, time.perf_counter() - start,
                          stop_requested=stop, busy=busy_workers)

    def evaluate(self, dataset, data_seed: int, batches: int) -> float:
        """The mean loss of `batches` global batches of `dataset` (its iterations 0 ..
        batches-1: the same samples at every evaluation), forward only; collective, every
        rank gets the value. Each pipeline takes its slice of a batch and scales its
        microbatch losses as training does (1 / the batch's microbatches, all pipelines
        together), and the world sums them in float64: the value does not depend on the plan.

        The forward-only schedule has stages of its own over the same layers: torch's
        stages keep buffers for one mode, and the training schedule's stay as they are."""
        if self._eval_schedule is None:
            self._eval_schedule, self._eval_stages = self._build_schedule(self.tp, forward_only=True)
        count = self.pipeline.num_microbatches * self.plan.micro_batch
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        self._evaluating = True
        try:
            for index in range(batches):
                inputs, targets = dataset.batch(index, self.plan.global_batch, data_seed,
                                                start=self.pipeline.sample_offset, count=count)
                with torch.no_grad():
                    losses = self._run_schedule(self._eval_schedule.eval, self._eval_stages,
                                                self._on_device(inputs), self._on_device(targets))
                total += self._local_loss(losses)
        finally:
            self._evaluating = False
        dist.all_reduce(total, group=self.groups.world)
        return float(total) / batches

    @property
    def _fetches_ahead(self) -> bool:
        ahead = self.settings.fetch_ahead
        return self.device.type == "cuda" if ahead is None else ahead

    def _batch_of(self, iteration: int, data_seed: int) -> tuple[int, int, int, int, int]:
        """What identifies `iteration`'s batch for this rank: its pipeline's slice of the
        plan's global batch (`TokenDataset.batch`'s arguments)."""
        count = self.pipeline.num_microbatches * self.plan.micro_batch
        return iteration, self.plan.global_batch, data_seed, self.pipeline.sample_offset, count

    def _read(self, dataset, which: tuple[int, int, int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        iteration, global_batch, seed, start, count = which
        inputs, targets = dataset.batch(iteration, global_batch, seed, start=start, count=count)
        return self._on_device(inputs), self._on_device(targets)

    def _batch(self, dataset, iteration: int, data_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`iteration`'s inputs and targets for this rank, on the device: fetched ahead during
        the step before when they are that batch (the same dataset, plan and slice), else
        read now."""
        which = self._batch_of(iteration, data_seed)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] is dataset and ahead[1] == which:
            return ahead[2]
        return self._read(dataset, which)

    def _fetch_ahead(self, dataset, iteration: int, data_seed: int) -> None:
        """Read `iteration`'s batch and start its copy to the device now, while the kernels
        of this step's forward and backward run: the next step then starts at once after
        the commit, which waits for the device (docs/gpu.md). Dropped unused when the
        next step is not that batch's (the epoch ended; another plan)."""
        which = self._batch_of(iteration, data_seed)
        self._ahead = (dataset, which, self._read(dataset, which))

    def _on_device(self, batch: torch.Tensor) -> torch.Tensor:
        """A batch on the engine's device. On a GPU from pinned memory without blocking: a
        copy from pageable memory holds the host until the stream reaches it, that is
        until the last step's optimizer kernels ran, and only then would the host start
        queueing this step's kernels; a pinned copy queues behind them instead."""
        if self.device.type != "cuda":
            return batch.to(self.device)
        return batch.pin_memory().to(self.device, non_blocking=True)

    def _step(self, record: CommitRecord) -> float:
        lr = learning_rate(record.iteration, self.optim)
        try:
            self._clip_and_step(record.grad_norm, lr)
        except Exception as err:
            # Clipping scales the gradients in place and each layer steps on its own: the
            # state is torn. Undoing either would not be bit-exact (and copying every
            # gradient first would double their memory), so the step is not retried here.
            raise TornStep(record.iteration, err) from err
        self.last_stepped, self.last_commit, self.synced = record.iteration, record, False
        return lr

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        self._drop_gradients()
        return self._run_schedule(self.schedule.step, self.stages, inputs, targets)

    def _drop_gradients(self) -> None:
        """Free every gradient this worker holds (`grad`, and `main_grad` when summed wide)."""
        for state in self._shards.values():
            state.optimizer.zero_grad(set_to_none=True)
            if self.grad_accum_dtype is not None:
                for p in state.module.parameters():
                    p.main_grad = None

    def _run_schedule(self, run: Callable, stages: list, inputs: torch.Tensor,
                      targets: torch.Tensor) -> list[torch.Tensor]:
        """Run a schedule's `step` or `eval` on this rank's `stages` in the job's mixed
        precision (`precision`): the first stage takes the inputs, the last the targets
        and returns its microbatches' losses (empty elsewhere)."""
        is_first = any(s.is_first for s in stages)
        is_last = any(s.is_last for s in stages)
        losses: list[torch.Tensor] = []
        compute = self.settings.compute_dtype
        modules = [self._shards[index].module for index in self.plan.layers_of(self.rank)] if compute else ()
        with self._autocast(), compute_params(modules, compute):
            run(*((inputs,) if is_first else ()), target=targets if is_last else None,
                losses=losses if is_last else None, return_outputs=False)
        return losses

    def _local_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """This rank's share of the world's loss sum, in float64: its microbatches' losses
        on tp rank 0 of a last stage, 0 elsewhere (each loss is counted once)."""
        if losses and self.info.tp_rank == 0:
            return torch.stack([l.detach().double() for l in losses]).sum()
        return torch.zeros((), dtype=torch.float64, device=self.device)

    def _autocast(self):
        if self.settings.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.settings.autocast_dtype)

    def _sync_gradients(self) -> None:
        """Sum this step's gradients over every group that shares a weight (`grad_sync`)."""
        sync_gradients({index: state.module for index, state in self._shards.items()}, self.groups,
                       model=self.model, tp=self.tp, tied=self._tied, wide=self.grad_accum_dtype)

    def _commit(self, losses: list[torch.Tensor], stop: bool = False,
                busy: bool = False) -> tuple[float, float, bool, int]:
        """World all-reduce of [squared grad norm, loss, stop requests, busy workers];
        every rank gets the same values.

        Each layer's norm is counted once (its replica group's first rank), and of its
        tp pieces each distinct one once (`LayerModel.counts_in_norm`: tensors replicated
        across tp ranks by one of them); a tied weight by the owners of its first copy's
        layer only (the embedding's). The loss comes from tp rank 0
        of each pipeline's last stage. Completing this all-reduce is the commit point.
        """
        wide = self.grad_accum_dtype is not None  # the norm of the unrounded sums
        counted = [(p.main_grad if wide else p.grad) for layer in sorted(self._grad_norm_owner)
                   for name, p in self._shards[layer].module.named_parameters()
                   if name in self._shards[layer].norm_names and not self._is_tied_copy(layer, name)]
        squared = torch.zeros((), dtype=torch.float64, device=self.device)
        if counted:
            squared = torch.nn.utils.get_total_norm(counted, foreach=True).double().pow(2)
        loss = self._local_loss(losses)
        flags = torch.tensor([float(stop), float(busy)], dtype=torch.float64, device=self.device)
        vector = torch.cat([squared.view(1), loss.view(1), flags])
        dist.all_reduce(vector, group=self.groups.world)
        return float(vector[1]), math.sqrt(float(vector[0])), bool(vector[2] > 0), int(vector[3])

    def _is_tied_copy(self, layer: int, name: str) -> bool:
        """A tied weight's copy other than its first: its gradient is the first's."""
        return self._tied.get(layer) == name and layer != next(iter(self._tied))

    def _clip_and_step(self, grad_norm: float, lr: float) -> None:
        if self.settings.grad_clip > 0:
            # clip_grad_norm_'s formula, applied with the global norm every rank agreed on.
            params = [p for state in self._shards.values() for p in state.module.parameters()]
            total = torch.tensor(grad_norm, dtype=self.settings.param_dtype, device=self.device)
            torch.nn.utils.clip_grads_with_norm_(params, self.settings.grad_clip, total, foreach=True)
        self._phase("step", self.iteration)
        for state in self._shards.values():
            set_learning_rate(state.optimizer, lr)
            state.optimizer.step()

    # ---------------------------------------------------------------- state
    # The layer state this worker holds, one (layer, tp rank) shard each: a module and
    # its optimizer. Transfers, checkpoints, the audit and tools read and change it only
    # through these methods.
    def held_layers(self) -> list[int]:
        """The layers whose shard this worker holds, in order."""
        return sorted(self._shards)

    def shard(self, layer: int) -> LayerState:
        """The shard of `layer` this worker holds (its module and optimizer), to read or
        to send; a RuntimeError when it holds none."""
        try:
            return self._shards[layer]
        except KeyError:
            raise RuntimeError(f"worker rank {self.rank} holds no shard of layer {layer} "
                               f"(it holds {self.held_layers()})") from None

    def empty_shard(self, layer: int) -> LayerState:
        """A new shard of `layer` for this worker's tp rank, not yet held: a shell for a
        transfer or a checkpoint to fill, then `install_shards`."""
        return self._build_shard(layer)

    def install_shards(self, shards: dict[int, LayerState]) -> None:
        """Hold `shards` (filled shells of `empty_shard`), replacing any of those layers."""
        self._shards.update(shards)

    def drop_shard(self, layer: int) -> None:
        """Stop holding the shard of `layer` (its state is freed)."""
        del self._shards[layer]

    def phase(self, name: str, iteration: int) -> None:
        """Report a phase of an iteration to the engine's hook (fault injection, progress)."""
        self._phase(name, iteration)

    def owned_shards(self) -> list[int]:
        """Layers this rank speaks for (grad norm, saving): it is first in their replica group."""
        tp_rank = self.info.tp_rank
        return sorted(layer for (layer, t), ranks in self.plan.replica_groups().items()
                      if t == tp_rank and ranks[0] == self.rank)
