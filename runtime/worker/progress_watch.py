"""A worker's progress within its steps, for its agent's stuck check (issue 45).

A worker alive but stuck (a kernel that never returns, a deadlock in a data loader or
an operator, an infinite wait) keeps its heartbeat: its heartbeat thread beats on
(runtime/contract/heartbeat.py), and its process is running, not stopped. What it does
not do is progress. `ProgressWatch` follows that from the engine's phases (each layer's
forward and backward, the gradient sync, the commit, the optimizer step: the marks of
`Engine.phase`) and says, at each beat, how long the worker has been *stalled*: without
a mark, inside a step, and not waiting in a collective. The agent kills a worker
stalled longer than its bound (`elastic.worker_supervisor`), which turns the stuck
worker into a dead one, the failure every survivor already recovers from.

- Peers are not stuck. The workers blocked on a stuck one also make no mark, but they
  wait in a collective: the main thread's innermost frame is `torch.distributed`'s
  (gloo's collectives and the pipeline's sends and receives block there), or between the sync
  and the commit's end (the gradient all-reduce and the commit all-reduce, whose NCCL
  kernels a GPU's host waits for just after). Such a wait is never counted: only the
  stuck worker's stall grows, and once it is killed its peers' collectives fail.
- The bound is the worker's own: `comm.stuck_factor` times the median of its recent
  steps, at least `comm.stuck_floor_s`. A step 3x slower than the median, once, is
  nowhere near it (10x by default), and the gaps between marks are a fraction of a step.
- Allowed for: nothing is watched before an epoch's `WARMUP_STEPS` steps have run on
  this worker (compilation, allocator warm-up, the first pipeline fill), nor outside
  steps (evaluations, checkpoint writes, peer snapshots, rendezvous and copies have their
  own timeouts), nor while the engine evaluates (its phases are silent then).
- Its marks are the step's phases (begin, sync, commit, committed, step), not each
  layer's (those hooks are registered only for fault injection): a stall is measured
  from the last of them, and the bound, ten steps, is far above a step's forward and
  backward.

What it sees is the host's thread. On CPUs (gloo) that is where a stuck kernel or a
deadlock holds it. On GPUs with NCCL the host runs ahead of the device and waits for
it at synchronisation points, the commit's read among them, which counts as a wait in a
collective: a kernel that never returns there is left to NCCL's own watchdog and the
collective timeout; a host stuck elsewhere (a data loader, a deadlock) is seen. Written by hand: no library watches a PyTorch step's progress from
within (NVIDIA's Resiliency Extension does it from its own monitor process and section
API, which would be a dependency on its launcher).
"""
from __future__ import annotations

import collections
import statistics
import sys
import threading
import time
from dataclasses import dataclass

WARMUP_STEPS = 3
"""Steps of each epoch run before the watch is armed (compilation, the first fill)."""
_COMM_PHASES = ("sync", "commit")
"""After these marks the worker waits in the step's all-reduces until the next mark."""
_COLLECTIVES = ("/torch/distributed/", "\\torch\\distributed\\")


@dataclass(frozen=True)
class Stall:
    """What a worker's heartbeat says of its progress: stalled `stalled_s` seconds, its
    bound `bound_s` (the agent kills it past the bound)."""

    stalled_s: float
    bound_s: float


class ProgressWatch:
    """Marks from the main thread (`mark`, `step_done`, `epoch_started`); `stall()` from
    the heartbeat's thread. Thread-safe by construction: each field is replaced whole."""

    def __init__(self, factor: float, floor_s: float, main: threading.Thread | None = None):
        self.factor, self.floor_s = factor, floor_s
        self._main_id = (main or threading.main_thread()).ident
        self._step_times: collections.deque[float] = collections.deque(maxlen=20)
        self._steps_in_epoch = 0
        self._armed = False
        self._in_comm = False
        self._last_mark = time.monotonic()

    # -------------------------------------------------------- main thread
    def epoch_started(self) -> None:
        self._steps_in_epoch, self._armed = 0, False

    def mark(self, phase: str, iteration: int) -> None:
        """The engine's phase callback: progress. A step's `begin` arms the watch (past the
        epoch's warm-up steps); no other mark does (a copy's `transfer` is no step's)."""
        self._last_mark = time.monotonic()
        self._in_comm = phase in _COMM_PHASES
        if phase == "begin" and self._steps_in_epoch >= WARMUP_STEPS and self._step_times:
            self._armed = True

    def disarm(self) -> None:
        """The epoch is over on this worker (a failure, a stop, the end): nothing is watched
        until the next epoch's steps are past their warm-up."""
        self._armed, self._steps_in_epoch = False, 0

    def step_done(self, step_time_s: float) -> None:
        """A step returned (committed, its optimizer step taken): disarmed until the next."""
        self._armed = False
        self._steps_in_epoch += 1
        self._step_times.append(step_time_s)

    # --------------------------------------------------- heartbeat thread
    def bound_s(self) -> float:
        times = list(self._step_times)
        return max(self.floor_s, self.factor * statistics.median(times)) if times else self.floor_s

    def stall(self, now: float | None = None) -> Stall:
        """Seconds without progress within a step, outside a collective (0 when not
        watched), and the bound."""
        if not self._armed or self._in_comm or self._in_collective():
            return Stall(0.0, self.bound_s())
        return Stall(max(0.0, (now or time.monotonic()) - self._last_mark), self.bound_s())

    def _in_collective(self) -> bool:
        """The main thread waits in torch.distributed: its innermost Python frame is
        torch.distributed's (a collective's or a pipeline send's or receive's wait is a
        call into c10d from there). Only the innermost: a layer's forward is called from
        within the pipeline's schedule, and a stall in it is no wait on a peer."""
        frame = sys._current_frames().get(self._main_id)
        return frame is not None and any(part in frame.f_code.co_filename for part in _COLLECTIVES)
