"""The harness's nodes spread over several processes, driven as one `NodeHost`.

One Python interpreter carries some 64 simulated nodes of 8 workers: past that its
threads (a few thousand: agents, leases, watch streams, relays, workers) queue for the
interpreter's lock, leases lapse before they are renewed, and the harness measures its
own convoy rather than the control plane (docs/benchmarks.md). `HostedNodes` runs the
nodes in P processes (`node_host.serve`), node `i` in process `i mod P`, and answers
`NodeHost`'s questions for all of them: a question about one node goes to its process,
one about all (who leads, the largest write) to every process, combined. The epochs'
steps meet across processes in a `StepHub` here, and the workers' timing notes come
here as they happen, so the harness's `Observer` sees every worker.
"""
from __future__ import annotations

import multiprocessing
import threading
from typing import Any

from planaria.chaos.scale.node_host import NodeSpec, NodeState, serve
from planaria.chaos.scale.sim_worker import Observer
from planaria.chaos.scale.step_hub import StepHub


class HostFailed(RuntimeError):
    """A node process answered a command with an error, or is gone."""


class _Host:
    """One node process: its command connection (one command at a time) and its events
    connection (the data plane's messages, the observer's notes; read by a thread here)."""

    def __init__(self, number: int, spec: NodeSpec, context):
        self.number = number
        self.commands, child_commands = context.Pipe()
        self.events, child_events = context.Pipe()
        self.process = context.Process(target=serve, args=(child_commands, child_events, spec),
                                       daemon=True, name=f"planaria-nodes-{number}")
        self.process.start()
        child_commands.close()
        child_events.close()
        self._command_lock, self._send_lock = threading.Lock(), threading.Lock()

    def call(self, method: str, *args) -> Any:
        with self._command_lock:
            try:
                self.commands.send((method, args))
                status, value = self.commands.recv()
            except (EOFError, OSError) as err:
                raise HostFailed(f"node process {self.number} (pid {self.process.pid}) is gone: "
                                 f"exit code {self.process.exitcode}") from err
        if status != "ok":
            raise HostFailed(f"node process {self.number}: {method}{args} failed: {value}")
        return value

    def send_event(self, message) -> None:
        with self._send_lock:
            try:
                self.events.send(message)
            except (OSError, EOFError):
                pass  # a process that went away: its calls say so


class HostedNodes:
    """`NodeHost`'s interface over `processes` node processes (module docstring)."""

    def __init__(self, spec: NodeSpec, processes: int, observer: Observer, log=print):
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self.observer, self.hub, self.log = observer, StepHub(), log
        self.hosts = [_Host(n, spec, context) for n in range(processes)]
        self._homes: dict[int, _Host] = {}
        for host in self.hosts:
            threading.Thread(target=self._read_events, args=(host,), daemon=True,
                             name=f"node-process-{host.number}-events").start()

    def _home(self, index: int) -> _Host:
        return self._homes.setdefault(index, self.hosts[index % len(self.hosts)])

    def _read_events(self, host: _Host) -> None:
        while True:
            try:
                message = host.events.recv()
            except (EOFError, OSError):
                return
            try:
                self._take(message)
            except Exception as err:  # noqa: BLE001 - said: this host's ranks would otherwise wait unseen
                self.log(f"node process {host.number}: its message {message[0]!r} failed here: "
                         f"{type(err).__name__}: {err}")

    def _take(self, message: tuple) -> None:
        kind = message[0]
        if kind == "plane":
            decided = self.hub.apply(message[1])
            if decided:
                self._broadcast(decided)
            batches = [message[1]] if isinstance(message[1], dict) else message[1]
            deaths = [(epoch, rank) for batch in batches for epoch, rank, _ in batch.get("dead", [])]
            if deaths:  # the ranks still computing their step fail too (`StepBarrier.work`)
                self._broadcast({"deaths": deaths})
        elif kind == "note":
            self.observer.noted_elsewhere(*message[1:])
        elif kind == "first_step":
            self.observer.first_step_elsewhere(*message[1:])

    def _broadcast(self, decided: list[tuple]) -> None:
        for host in self.hosts:
            host.send_event(decided)

    # ---------------------------------------------------- one node's process
    def add(self, index: int) -> None:
        self._home(index).call("add", index)

    def kill(self, index: int) -> None:
        self._home(index).call("kill", index)

    def notice(self, index: int, grace_s: float) -> None:
        self._home(index).call("notice", index, grace_s)

    def leader_epoch(self, index: int) -> int | None:
        return self._home(index).call("leader_epoch", index)

    def thread_cpu(self, index: int | None) -> float:
        return 0.0 if index is None else self._home(index).call("thread_cpu", index)

    def lines(self, index: int, last: int = 20) -> list[str]:
        return self._home(index).call("lines", index, last)

    # ------------------------------------------------------ every process
    def _all(self, method: str, *args) -> list:
        return [host.call(method, *args) for host in self.hosts]

    def states(self) -> dict[int, NodeState]:
        return {i: state for answer in self._all("states") for i, state in answer.items()}

    def gone(self, node: str) -> None:
        self._all("gone", node)

    def cut(self, inside: list[str], outside: list[str]) -> None:
        self._all("cut", inside, outside)

    def heal(self) -> None:
        self._all("heal")

    def block(self) -> None:
        self._broadcast(self.hub.block_all())

    def leader(self) -> int | None:
        return next((i for i in self._all("leader") if i is not None), None)

    def plan_workers(self, epoch: int) -> frozenset | None:
        return next((w for w in self._all("plan_workers", epoch) if w is not None), None)

    def event(self, epoch: int):
        return next((e for e in self._all("event", epoch) if e is not None), None)

    def largest_write(self, reset: bool = False) -> int:
        return max(self._all("largest_write", reset), default=0)

    def restore_largest(self, largest: int) -> None:
        self._all("restore_largest", largest)

    def cpu(self) -> float:
        """CPU seconds of every node process (the harness's own process not included)."""
        return sum(self._all("cpu"))

    def cpu_by_kind(self) -> dict[str, float]:
        """CPU seconds of every node process by kind of thread, summed (`thread_cpu`)."""
        totals: dict[str, float] = {}
        for answer in self._all("cpu_by_kind"):
            for kind, cpu in answer.items():
                totals[kind] = totals.get(kind, 0.0) + cpu
        return totals

    def last_lines(self) -> dict[int, str]:
        return {i: line for answer in self._all("last_lines") for i, line in answer.items()}

    def close(self) -> None:
        for host in self.hosts:
            try:
                host.call("close")
            except HostFailed:
                pass
        for host in self.hosts:
            host.process.join(30.0)
            if host.process.is_alive():
                host.process.kill()
