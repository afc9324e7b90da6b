"""The environment a Planaria launcher gives its workers: variable names, in one place.

An agent (`planaria.elastic.agent`), the local launcher (`planaria.elastic.local_job`) and
the chaos harness set them; the worker (`planaria.runtime.worker.elastic_worker`, the fault
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
NODE_ADDRESS = "PLANARIA_NODE_ADDRESS"
"""The address the other nodes reach the worker's node at (its agent's `--local-addr`, its
gloo interface's, or its route to etcd): where the worker hosts an epoch's bootstrap store
as the plan's rank 0 (`planaria.runtime.worker.epoch_store`)."""
DIE_WITH_AGENT = "PLANARIA_DIE_WITH_AGENT"
""""1": the worker asks the kernel to SIGKILL it when its agent dies."""
HEARTBEAT_FILE = "PLANARIA_HEARTBEAT_FILE"
"""The file the worker's heartbeat thread touches every second (`heartbeat`)."""
FAULTS = "PLANARIA_FAULTS"
"""Faults to inject at phases of an iteration (`planaria.runtime.worker.fault_injection`), for tests and chaos."""
CORRUPT = "PLANARIA_CORRUPT"
"""A bit to flip after a step ("node.local@iteration"), for the replica audit's tests."""
DEBUG = "PLANARIA_DEBUG"
""""1": keep torch's full logs of a failed schedule (off: one line per failure)."""
STORE_TRACE = "PLANARIA_STORE_TRACE"
"""A directory: the worker appends every request it makes to the job's store to
`<dir>/<node>.<local>.jsonl` (`planaria.runtime.worker.store_trace`), a diagnostic."""
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
ETCD_MAX_REQUEST_BYTES = "PLANARIA_ETCD_MAX_REQUEST_BYTES"
ETCD_MAX_TXN_OPS = "PLANARIA_ETCD_MAX_TXN_OPS"
"""etcd's `--max-request-bytes` and `--max-txn-ops`, for an etcd started with other values
than its defaults: the client checks every request against them before sending it."""


NCCL_RECOVERY = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
}
"""torch's NCCL settings under which a failed or aborted collective never takes the
process down, so that a survivor keeps its layers (docs/gpu.md):

- `TORCH_NCCL_ASYNC_ERROR_HANDLING=2` ("clean up only"): a collective that fails or
  times out aborts its communicators and raises in the worker; torch's default (3)
  tears the whole process down, and 1 aborts and tears down.
- `TORCH_NCCL_ENABLE_MONITORING=0`: no heartbeat monitor that kills the process when
  torch's watchdog thread is stuck (in an abort, say); a frozen worker is the agent's
  to kill (its own heartbeat), and which worker dies is the control plane's decision.

The elastic worker sets them when its backend is nccl (`nccl_recovery`), the agent for
every worker it starts; a value the user set is kept, with a warning where it defeats
recovery."""


def nccl_recovery(environ, timeout_s: float) -> list[str]:
    """Give `environ` (a mapping: os.environ, or a child's environment) the NCCL settings
    of `NCCL_RECOVERY`, and `TORCH_NCCL_NONBLOCKING_TIMEOUT` (how long a non-blocking
    communicator may take to connect or abort) of `timeout_s`, where the user set none.
    Returns a warning for each setting the user gave that lets NCCL take a survivor down."""
    for name, value in NCCL_RECOVERY.items():
        environ.setdefault(name, value)
    environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(max(1, round(timeout_s))))
    warnings = []
    if environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] not in ("0", "2"):
        warnings.append(f"TORCH_NCCL_ASYNC_ERROR_HANDLING={environ['TORCH_NCCL_ASYNC_ERROR_HANDLING']} "
                        "makes torch end a worker whose collective fails or times out, and its layers "
                        "with it; unset it (Planaria uses 2) to recover in place")
    if environ["TORCH_NCCL_ENABLE_MONITORING"] not in ("0", "false", "False"):
        warnings.append("TORCH_NCCL_ENABLE_MONITORING is on: torch's monitor may kill a worker whose "
                        "watchdog is stuck in an abort; unset it (Planaria uses 0) to recover in place")
    return warnings


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
