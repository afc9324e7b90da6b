"""Who takes part in a job: the records of workers, nodes and the job itself in the store."""
from __future__ import annotations

from dataclasses import dataclass

from planaria.runtime.contract.record import JsonRecord


@dataclass(frozen=True)
class Announcement(JsonRecord):
    """A worker's "I am here" (`keys.member`); the chaos harness finds its process by it."""

    pid: int


@dataclass(frozen=True)
class NodeRegistration(JsonRecord):
    """A node's entry (`keys.node_registration`), bound to its agent's lease."""

    gpus: int
    """Workers the node runs."""
    agent: str
    """The agent's own id: two agents under one node name are told apart by it."""


@dataclass(frozen=True)
class JobSpec(JsonRecord):
    """What a job runs (`keys.JOB`): the first agent records it, and an agent given
    another is refused, so that two jobs never mix their workers under one run id."""

    config: str
    """The config file's path as the agent was given it."""
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class LeaveNotice(JsonRecord):
    """A node that will be gone at `deadline` (`keys.notice`, bound to its agent's lease):
    its cloud or scheduler said so (`planaria.elastic.preemption`). The leader plans the
    job without it while it still trains, and it hands its layers over before it exits."""

    source: str
    """Who said so: "signal SIGTERM", "aws", "gcp", "azure"."""
    deadline: float
    """When the node will be gone (seconds since the epoch, wall clock)."""
    posted: float
    """When its agent wrote the notice."""


@dataclass(frozen=True)
class Waiting(JsonRecord):
    """The job, below one replica's nodes, waits for nodes (`keys.WAITING`;
    `planaria.elastic.node_wait`)."""

    since: float
    """When it began to wait (wall clock)."""
    nodes: int
    """The nodes it has."""
    needs: int
    """The nodes one replica of the model needs (n0)."""
    limit_s: float
