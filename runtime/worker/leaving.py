"""A worker of a node that leaves with notice (docs/spot.md): the layers the next plan
takes from it handed over to their receivers (it may hold their only copies), its
checkpoint shards under way completed, then its exit, out of the way of the workers
that train on.

When the control plane gives the next epoch up before the layers are across (a
receiver failed), the worker keeps them and waits for the next epoch's word instead.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable

from planaria.runtime.contract.epochs import EpochRecord
from planaria.runtime.contract.exits import EXIT_LEFT
from planaria.runtime.contract.logs import error_line
from planaria.runtime.parallel.engine import Engine
from planaria.runtime.state.checkpoints import AsyncCheckpointer
from planaria.runtime.state.transfer import Handoff, exchange_handoff
from planaria.runtime.worker.coordination import StoreCoordinator
from planaria.templates.plan import Worker

LEAVE_LINGER_S = 1.0
"""How long a leaving worker waits at most for the next epoch's first step before it
exits: its leave was planned at least `PlannedLeaves.overhead_s` (3 s) before its
deadline, and the step takes a fraction of a second where nodes share a host."""


def lowest_priority() -> None:
    """Every thread of this process at the lowest CPU priority (nice 19). On Linux a
    priority is a thread's own, so each thread listed in /proc is set; elsewhere, or
    where it is not allowed, nothing changes."""
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
            os.setpriority(os.PRIO_PROCESS, tid, 19)


def leave(engine: Engine | None, handoff: Handoff | None, epoch: int, record: EpochRecord, *, me: Worker,
          coordinator: StoreCoordinator, checkpointer: AsyncCheckpointer, steps: int,
          log: Callable[[str], None]) -> int | None:
    """Send the layers `handoff` takes from worker `me` to epoch `epoch`'s receivers, then
    exit (the exit code: `EXIT_LEFT`, or 1 when the handoff failed and the epoch stands).
    None when the control plane gave the epoch up first: `me` still holds its layers."""
    if handoff is not None and any(t.src == me for t in handoff.transfers):
        try:
            stats = exchange_handoff(engine, handoff, me, stepped=engine.last_stepped >= 0)
        except (RuntimeError, TimeoutError) as err:
            log(f"epoch {epoch}: handing layers over failed: {error_line(err, 300)}")
            if coordinator.reconfigure_requested(epoch):
                log(f"epoch {epoch} was given up by the control plane; this node still holds its "
                    "layers and waits for the next epoch")
                return None
            return 1  # the leader sees it gone without its word
        coordinator.handed_off(epoch)  # before it exits: it is not a failure of the epoch
        log(f"epoch {epoch}: handed {stats.layers_sent} layer shard(s) over "
            f"({stats.bytes_sent / 2**20:.2f} MiB in {stats.seconds:.2f} s)")
    try:  # its shards of a checkpoint under way complete that checkpoint
        checkpointer.flush()
    except OSError as err:  # the checkpoint is passed over, as after any failed write
        log(f"epoch {epoch}: a checkpoint write failed while leaving: {err}")
    log(f"epoch {epoch}: this node leaves the job, as its notice asked")
    # What is left (dropping the layers, the interpreter's exit) is of use to no one: on
    # a host it shares with workers of the job (a test's cluster, or several nodes'
    # workers on one machine) it must not take their CPU while they train the next
    # epoch's first step. So it waits for that step first (its exit had made the step
    # 0.03-0.05 s slower, two cores, four workers), then drops to the lowest priority.
    # On a host of its own neither changes anything.
    if record.plan.first_iteration < steps:  # (else no step is left to train)
        trained = coordinator.wait_until_trained(epoch, LEAVE_LINGER_S)
        if not trained and coordinator.reconfigure_requested(epoch):
            # Given up before it trained (a worker it needed failed): the next plan may
            # need this worker's layers after all.
            log(f"epoch {epoch} was given up by the control plane before it trained; this node "
                "still holds its layers and waits for the next epoch")
            return None
    lowest_priority()
    if engine is not None:
        engine.destroy()
    return EXIT_LEFT
