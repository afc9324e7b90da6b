"""Below the minimum, the job waits for nodes (issue 45), as torchrun's rendezvous waits
for `--nnodes`' minimum (`join_timeout`) instead of failing.

When fewer nodes are left than one replica of the model needs (`n0`), the controller
publishes no epoch: the survivors stay out of the failed epoch, holding what they hold
(their layers, their peer snapshots), and the job waits for nodes, up to `limit_s`
(the agents' `--join-timeout`, 600 s by default). A node that arrives meanwhile is
planned in with them, and the job resumes from the newest state any live node or store
has: the survivors' layers first, then the peer snapshots, then the disk
(`EpochPlanner`). Past the limit the job fails, as it did at once before, with the
same message.

While it waits, `waiting` in the job's store says since when and for how many nodes
(`Waiting`): `planaria status` shows it, the agents' metrics export it, and the workers
waiting for their next epoch wait on past their own limit (`StoreCoordinator`).
Loaded by an agent: no torch.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from planaria.runtime.contract import keys
from planaria.runtime.contract.membership import Waiting

if TYPE_CHECKING:
    import torch.distributed as dist

LIMIT_S = 600.0
"""torchrun's `join_timeout`: how long a job below its minimum waits for nodes."""


class NodeWait:
    """The controller's wait for nodes below the minimum (module docstring)."""

    def __init__(self, store: dist.Store, limit_s: float = LIMIT_S, log: Callable[[str], None] = print):
        self.store, self.limit_s, self.log = store, limit_s, log
        self.since: float | None = None
        self._written: tuple[int, int] | None = None
        self.detected = 0.0
        """When the controller detected the change it waits to plan (its first try)."""

    def wait(self, nodes: int, needs: int, detected: float) -> bool:
        """True while the job may wait for nodes (the first call says so and writes
        `waiting`, written again only when the count changes: the controller asks at
        every poll); False once it waited `limit_s` in vain (`waiting` is then gone)."""
        now = time.time()
        if self.since is None:
            self.since, self.detected = now, detected
            self.log(f"controller: {nodes} node(s) left, but one replica of the model needs n0={needs}; the "
                     f"survivors keep what they hold, and the job waits up to {self.limit_s:g} s "
                     f"(--join-timeout) for {needs - nodes} more node(s)")
        if self._written != (nodes, needs):
            self._written = (nodes, needs)
            self.store.set(keys.WAITING, Waiting(self.since, nodes, needs, self.limit_s).to_json())
        if now - self.since < self.limit_s:
            return True
        self._forget()
        return False

    def resume(self) -> None:
        """A new leader takes over a wait its predecessor began (`waiting` in the store)."""
        value = self.store.get(keys.WAITING) if self.store.check([keys.WAITING]) else None
        if value:
            waiting = Waiting.from_json(value)
            self.since, self.detected = waiting.since, waiting.since

    def over(self) -> None:
        """Nodes came (or the job went on otherwise): the wait is over."""
        if self.since is not None:
            self.log(f"controller: nodes came after {time.time() - self.since:.1f} s of waiting; the job goes on")
            self._forget()

    def _forget(self) -> None:
        self.since, self._written = None, None
        self.store.delete_key(keys.WAITING)
