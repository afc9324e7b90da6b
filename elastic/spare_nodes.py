"""Nodes alive that no plan uses: they wait as spares, their workers started, and are
tried again at the next failure (docs/control_plane.md, `--nnodes MIN[:MAX]`).

A node waits when the job is at its maximum of nodes (`--nnodes MIN:MAX`: the plan's own
nodes first, then by name), when no set of pipelines uses it (the batch has too few
microbatches for more pipelines, a deeper template does not fit in memory), or when the
planner has no plan that takes it. `keys.SPARES` says which, for `planaria status`.
Which nodes are alive, reachable and planned is the controller's: it asks here which of
them a plan may use. Loaded by an agent, through the controller: no torch.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable

from planaria.runtime.contract import keys

if TYPE_CHECKING:
    import torch.distributed as dist


class Spares:
    """The nodes of a job that wait (module docstring)."""

    def __init__(self, store: dist.Store, max_nodes: int | None = None, log: Callable[[str], None] = print):
        self.store = store
        self.max_nodes = max_nodes
        """The most nodes a plan uses (torchrun's `--nnodes MIN:MAX`); None: every node.
        Live nodes beyond it wait as spares, their workers started, and take a failed
        node's place at the next failure without a cold start (`cap`)."""
        self.log = log
        self.nodes: set[str] = set()
        """Nodes alive that no plan could use or that are beyond `max_nodes`: they wait,
        and are tried again at the next failure."""
        self._said: dict[str, list[str]] = {}
        """What was last said of the spares and of the idle nodes (each once per set)."""

    def set_nodes(self, nodes: set[str]) -> None:
        """The nodes that wait as spares; `keys.SPARES` says which (for `planaria status`)."""
        if nodes != self.nodes or not self.store.check([keys.SPARES]):
            self.store.set(keys.SPARES, json.dumps(sorted(nodes)))
        self.nodes = set(nodes)

    def keep_alive(self, alive: set[str]) -> None:
        """Only the spares among the `alive` nodes: a spare that died is no spare."""
        if self.nodes - alive:
            self.set_nodes(self.nodes & alive)

    def cap(self, nodes: list[str], planned: list[str]) -> list[str]:
        """`nodes`, at most `max_nodes` of them: those of `planned` (the plan in force)
        first (a spare never takes the place of a node that trains), then the others in
        name order. The rest wait as spares (said once per set)."""
        if self.max_nodes is None or len(nodes) <= self.max_nodes:
            return nodes
        ordered = [n for n in planned if n in nodes] + sorted(n for n in nodes if n not in planned)
        kept, spares = ordered[:self.max_nodes], ordered[self.max_nodes:]
        self.set_nodes((self.nodes - set(kept)) | set(spares))
        self._say_once("spares", sorted(spares), f"the job is at its maximum of {self.max_nodes} nodes; "
                       f"{sorted(spares)} wait as spares, their workers started, for a node to fail")
        return kept

    def if_full(self, joiners: set[str], planned: list[str]) -> set[str]:
        """`joiners`, or none when the plan in force (its nodes: `planned`) already has
        `max_nodes` nodes: they wait as spares rather than end the epoch for a plan that
        could not take them."""
        if not joiners or self.max_nodes is None or len(planned) < self.max_nodes:
            return joiners
        self.set_nodes(self.nodes | joiners)
        self._say_once("spares", sorted(self.nodes), f"the job is at its maximum of {self.max_nodes} "
                       f"nodes; {sorted(joiners)} wait as spares, their workers started, for a node to fail")
        return set()

    def idle_at_start(self, idle: list[str], used: int, alive: int) -> None:
        """`idle` (sorted), which epoch 0's plan of `used` of the `alive` nodes leaves out,
        wait (said, and not said again by `leave_idle` for the same set)."""
        self.set_nodes(self.nodes | set(idle))
        self._said["idle"] = idle
        self.log(f"controller: epoch 0 uses {used} of {alive} nodes; {idle} wait until a node fails")

    def leave_idle(self, choice, nodes: list[str]) -> None:
        """The nodes of `nodes` that `choice` leaves idle wait: alive, not in the plan,
        their workers waiting for an epoch that names them (as they do for any epoch
        without them), and planned again at the next failure. Said once per set of idle
        nodes."""
        idle = set(choice.idle_nodes)
        self.set_nodes((self.nodes - set(nodes)) | idle)
        if idle and self._said.get("idle") != sorted(idle):
            self.log(f"controller: no plan uses {len(nodes)} nodes ({choice.idle_reason}); "
                     f"{sorted(idle)} wait until a node fails")
        self._said["idle"] = sorted(idle)

    def _say_once(self, key: str, value: list[str], message: str) -> None:
        if self._said.get(key) != value:
            self._said[key] = value
            self.log(f"controller: {message}")
