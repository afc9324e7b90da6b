"""The one training loop, and the components plugged into it.

Both kinds of job run their steps here: the torchrun trainer (one epoch, rank 0 writes
metrics.jsonl, checkpoints saved in the step) and the elastic worker (one call per
epoch, every worker logs its commits and evaluations, checkpoints written in the
background, the replica audit). What differs between them is the list of components,
not the loop: each is called after every committed step, in the order given, with the
engine and the step's `StepContext`, as torchtitan's trainer calls its checkpointer
and its fault-tolerance manager around one loop.

A component that evaluates (`Evaluation`) sets the context's `val_loss`; the ones after
it (a metrics log) read it. Order matters where a failure can strike between two
components: the elastic worker logs a step's commit before it evaluates, so that a
failure during the evaluation never hides a committed step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from planaria.runtime.parallel.engine import Engine, StepResult


@dataclass
class StepContext:
    """One committed step, as the components see it."""

    result: StepResult
    steps: int
    """The job's train.steps."""
    val_loss: float | None = None
    """The validation loss after this step, once an `Evaluation` component ran it."""

    @property
    def step(self) -> int:
        return self.result.iteration

    @property
    def last(self) -> bool:
        return self.step == self.steps - 1


class StepComponent(Protocol):
    def after_step(self, engine: Engine, ctx: StepContext) -> None:
        """Called after each committed step, in the loop's order."""


def run_steps(engine: Engine, dataset, data_seed: int, first: int, steps: int,
              components: Sequence[StepComponent], request: Callable[[], bool] | None = None,
              busy: Callable[[], bool] | None = None) -> bool:
    """Train steps `first .. steps-1`, calling every component after each. Returns False
    when the commit of a step before the last agreed to stop (`request`: the control
    plane wants a new epoch), True when the last step ran. `busy`: see
    `Engine.train_step`."""
    for iteration in range(first, steps):
        result = engine.train_step(iteration, dataset, data_seed, request=request, busy=busy)
        ctx = StepContext(result, steps)
        for component in components:
            component.after_step(engine, ctx)
        if result.stop_requested and not ctx.last:
            return False
    return True


class Evaluation:
    """The validation loss after the steps `eval.every` names (collective), handed to
    `report(step, val_loss)` and left in the context for the components after it."""

    def __init__(self, val_dataset, data_seed: int, batches: int, due: Callable[[int, int], bool],
                 report: Callable[[int, float], None] = lambda step, val_loss: None):
        self.val_dataset, self.data_seed, self.batches = val_dataset, data_seed, batches
        self.due, self.report = due, report

    def after_step(self, engine: Engine, ctx: StepContext) -> None:
        if self.due(ctx.step, ctx.steps):
            ctx.val_loss = self.run(engine, ctx.step)

    def run(self, engine: Engine, step: int) -> float:
        val_loss = engine.evaluate(self.val_dataset, self.data_seed, self.batches)
        self.report(step, val_loss)
        return val_loss


class Every:
    """Calls `action(engine, step)` after every `every`-th step (none when every is 0);
    `before_last`: not after the job's last step (a checkpoint the final save makes moot)."""

    def __init__(self, every: int, action: Callable[[Engine, int], None], before_last: bool = False):
        self.every, self.action, self.before_last = every, action, before_last

    def after_step(self, engine: Engine, ctx: StepContext) -> None:
        if self.every and (ctx.step + 1) % self.every == 0 and not (self.before_last and ctx.last):
            self.action(engine, ctx.step)


class Call:
    """A component from a plain function of (engine, ctx)."""

    def __init__(self, fn: Callable[[Engine, StepContext], None]):
        self.fn = fn

    def after_step(self, engine: Engine, ctx: StepContext) -> None:
        self.fn(engine, ctx)
