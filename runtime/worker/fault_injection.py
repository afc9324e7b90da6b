"""Deterministic fault injection: a worker kills itself with SIGKILL at a chosen phase.

Tests and the chaos harness need failures at precise moments (during a forward, a
backward, the gradient sync, just after a commit, during a state transfer), which a
signal sent from outside cannot hit reliably. A worker started with

    PLANARIA_FAULTS="node1.0:backward@3#2,node2.0:transfer@*"

SIGKILLs itself (no cleanup, no Python exit handlers: exactly as if the node vanished)
on the 2nd backward call of iteration 3, and `node2.0` at its first state transfer
whatever the iteration. A trailing `!error` raises a RuntimeError instead, as a
collective that fails on this worker alone would (the worker lives on); `!hang` stops
the process with SIGSTOP (it neither dies nor answers); `!stall` waits forever where it
is, the process running (a kernel that never returns, a deadlock: only its progress
shows it, `progress_watch`); `!slow=S` sleeps S seconds
every time it matches (a straggler: with `@*`, every iteration is S seconds slower).
Phases are the engine's (`planaria.runtime.parallel.engine`): begin (a step's start),
forward, backward (counted per layer, microbatch and chunk), sync, commit, committed (the commit
all-reduce completed, the step not yet taken), step, transfer; and start, once, before the
worker announces itself (`node4.0:start@0!slow=30`: a worker whose start-up takes 30 s
more, as a GPU worker's device context, NCCL and compilation do); and connect, once, as a
joiner starts connecting a join's next epoch's groups ahead of the stop
(`connect_ahead`; `node4.0:connect@0` dies there, `!slow=10` connects 10 s late). A fault fires once: a
worker that comes back under the same name is a new process without it (the harness
clears the variable when it restarts a node).
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time
from dataclasses import dataclass

PHASES = ("begin", "forward", "backward", "sync", "commit", "committed", "step", "transfer", "start", "connect")
_SPEC = re.compile(r"^(?P<worker>[^:]+):(?P<phase>\w+)@(?P<iteration>\d+|\*)(?:#(?P<count>\d+))?"
                   r"(?P<action>!error|!hang|!stall|!slow=(?P<delay>\d+(?:\.\d*)?))?$")


@dataclass(frozen=True)
class Fault:
    worker: str
    """"<node>.<local rank>"."""
    phase: str
    iteration: int | None
    """None: any iteration."""
    count: int = 1
    """Fire on this call of the phase within the iteration (forward and backward are
    called once per layer, microbatch and chunk)."""
    action: str = "kill"
    """"kill": SIGKILL. "error": raise a RuntimeError instead, as a collective that fails
    on this worker alone does (with "committed": the commit all-reduce completed on the
    others but failed here, which the exactly-once rule rolls forward). "hang": SIGSTOP,
    a worker that stops answering without dying. "stall": wait forever, running.
    "slow": sleep `delay_s`, every time."""
    delay_s: float = 0.0


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _SPEC.match(item)
        if not match or match["phase"] not in PHASES:
            raise ValueError(f"bad fault {item!r}: expected NODE.LOCAL:PHASE@ITERATION[#COUNT]"
                             f"[!error|!hang|!stall|!slow=SECONDS] with "
                             f"PHASE one of {', '.join(PHASES)} and ITERATION a number or *")
        iteration = None if match["iteration"] == "*" else int(match["iteration"])
        action = (match["action"] or "!kill")[1:].partition("=")[0]
        faults.append(Fault(match["worker"], match["phase"], iteration, int(match["count"] or 1),
                            action=action, delay_s=float(match["delay"] or 0)))
    return faults


class FaultInjector:
    """The engine's `phase` callback for one worker: kills the process when a fault matches."""

    def __init__(self, worker: str, faults: list[Fault]):
        self.faults = [f for f in faults if f.worker == worker]
        self._calls: dict[tuple[str, int], int] = {}

    @classmethod
    def from_env(cls, worker: str) -> "FaultInjector | None":
        faults = parse_faults(os.environ.get("PLANARIA_FAULTS", ""))
        mine = cls(worker, faults)
        return mine if mine.faults else None

    def __call__(self, phase: str, iteration: int) -> None:
        key = (phase, iteration)
        self._calls[key] = calls = self._calls.get(key, 0) + 1
        for fault in self.faults:
            if fault.phase == phase and fault.iteration in (None, iteration) and fault.count == calls:
                if fault.action == "slow":
                    time.sleep(fault.delay_s)
                    continue
                if fault.action == "stall":
                    threading.Event().wait()  # never set: stuck here, the process running
                if fault.action == "error":
                    self.faults.remove(fault)  # once: the worker lives on
                    raise RuntimeError(f"injected fault: {phase} of iteration {iteration} failed "
                                       "on this worker")
                os.kill(os.getpid(), signal.SIGSTOP if fault.action == "hang" else signal.SIGKILL)


def corruption_after_step(worker: str) -> int | None:
    """`PLANARIA_CORRUPT="node2.0@3"`: the iteration after whose step this worker flips a
    bit of its state (silent data corruption, for the replica audit), or None."""
    for item in filter(None, (p.strip() for p in os.environ.get("PLANARIA_CORRUPT", "").split(","))):
        name, _, iteration = item.partition("@")
        if not iteration.isdigit():
            raise ValueError(f"bad PLANARIA_CORRUPT item {item!r}: expected NODE.LOCAL@ITERATION")
        if name == worker:
            return int(iteration)
    return None


def writes_late(worker: str) -> bool:
    """`PLANARIA_LATE_WRITER="node1.0,..."`: when an epoch fails on this worker, it writes
    its layers as the next checkpoint's and reports them, as a worker that does not know
    the job went on without it might (for the test of checkpoints' fencing)."""
    return worker in {p.strip() for p in os.environ.get("PLANARIA_LATE_WRITER", "").split(",")}


def flip_a_bit(tensor) -> None:
    """Flip the lowest bit of the first element, in place (as a memory fault would)."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    tensor.detach().reshape(-1)[:1].view(ints).bitwise_xor_(1)
