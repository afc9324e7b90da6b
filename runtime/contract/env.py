"""The environment a Planaria launcher gives its workers: variable names, in one place.

An agent (`planaria.elastic.agent`), the local launcher (`planaria.elastic.local_job`) and
the chaos harness set them; the worker (`planaria.runtime.elastic_worker`, the fault
injector, the heartbeat, the etcd store) reads them. torchrun's own variables (`RANK`,
`LOCAL_RANK`, `MASTER_ADDR`, ...) are torchrun's and are not repeated here.
"""
from __future__ import annotations

STORE = "PLANARIA_STORE"
"""The job's store: "host:port" of a TCPStore, or "etcd://host:port/prefix"."""
NODE = "PLANARIA_NODE"
"""The worker's node name."""
LOCAL_RANK = "PLANARIA_LOCAL_RANK"
"""The worker's rank on its node (its GPU)."""
DIE_WITH_AGENT = "PLANARIA_DIE_WITH_AGENT"
""""1": the worker asks the kernel to SIGKILL it when its agent dies."""
HEARTBEAT_FILE = "PLANARIA_HEARTBEAT_FILE"
"""The file the worker's heartbeat thread touches every second (`heartbeat`)."""
FAULTS = "PLANARIA_FAULTS"
"""Faults to inject at phases of an iteration (`planaria.runtime.fault_injection`), for tests and chaos."""
CORRUPT = "PLANARIA_CORRUPT"
"""A bit to flip after a step ("node.local@iteration"), for the replica audit's tests."""
DEBUG = "PLANARIA_DEBUG"
""""1": keep torch's full logs of a failed schedule (off: one line per failure)."""
KERNELS = "PLANARIA_KERNELS"
"""Overrides `model.kernels` ("triton" runs the kernels in Triton's interpreter on CPU).
`planaria.kernels` reads it under this name itself: it imports nothing of Planaria's."""
ETCD_CA_CERT = "PLANARIA_ETCD_CA_CERT"
ETCD_CERT = "PLANARIA_ETCD_CERT"
ETCD_KEY = "PLANARIA_ETCD_KEY"
ETCD_USER = "PLANARIA_ETCD_USER"
ETCD_PASSWORD = "PLANARIA_ETCD_PASSWORD"
"""etcd's TLS files and credentials, for workers that reach the store in etcd (never on
the command line, where `ps` shows them)."""


def elastic_worker(environ) -> tuple[str, str, int] | None:
    """(store address, node, local rank) when `environ` is a worker's started by a
    Planaria control plane, else None; a partial set is an error naming what is missing."""
    if STORE not in environ:
        return None
    missing = [k for k in (NODE, LOCAL_RANK) if k not in environ]
    if missing:
        raise RuntimeError(f"{STORE} is set but {', '.join(missing)} is not; the launcher must set all three")
    return environ[STORE], environ[NODE], int(environ[LOCAL_RANK])


def for_worker(store_url: str, worker: tuple[str, int], **extra: str) -> dict[str, str]:
    """The variables a launcher sets for `worker` (more, such as FAULTS, in `extra`)."""
    return {STORE: store_url, NODE: worker[0], LOCAL_RANK: str(worker[1]), **extra}
