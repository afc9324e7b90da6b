"""The job store's key layout: one function per key, used by every reader and writer.

Keys are relative to the store's prefix (a `torch.distributed.PrefixStore`, or the run's
prefix in etcd, `/planaria/<run id>/`):

    members/<node>.<local>          a worker's `Announcement`
    ready/<node>.<local>            the newest epoch that a worker saw it was not in: it is
                                    in none (written once it has left its last one)
    epoch                           the newest epoch whose record is complete
    epoch/<e>/record                `EpochRecord`, written before `epoch` moves to e
    epoch/<e>/status/<node>.<local> `WorkerStatus`, once the worker left epoch e (after a
                                    stop at a step boundary: before its groups are torn down)
    epoch/<e>/reconfigure           the epoch is over: "join" or "leave" (stop after the
                                    current iteration) or "failure" (release every collective now)
    epoch/<e>/trained               epoch e committed a step: when its first one was (wall clock)
    epoch/<e>/pg_store              "host:port" of the epoch's own bootstrap store, a TCPStore
                                    its plan's rank 0 hosts (a job store in etcd), where the
                                    epoch's process groups rendezvous
    epoch/<e>/pg/...                the epoch's process-group rendezvous, in a job store that
                                    is a TCPStore itself (the local launcher's, a test's)
    epoch/<e>/timing/<node>.<local> `EpochTiming`
    epoch/<e>/event                 `EpochEvent`: the controller's account of the change
    epoch/<e>/handed/<node>.<local> present: a leaving worker handed its layers over in e
    checkpoint/<i>/<e>/shards       shard files of the checkpoint of iteration i that the
                                    workers of epoch e (which committed it) have on disk (a count)
    checkpoint/<i>/<e>/commit       that iteration's `CommitRecord`
    done                            the job is over: "ok", or "failed: <reason>"
    progress                        `Progress`: the last committed step and the step time
    spares                          the live nodes no plan uses now, waiting to replace a
                                    failed one (JSON list; beyond `--nnodes`' maximum, or
                                    that no plan can use)
    waiting                         present while the job, below one replica's nodes,
                                    waits for nodes (`NodeWait`: since when, how many)

The agents' own keys in etcd lie beside these, under the same prefix:

    job                             the job's config and overrides (`JobSpec`)
    nodes/<node>                    a node's registration (`NodeRegistration`), on its lease
    alive/<node>.<local>            present while the worker's process runs, on its lease
    leader                          the node whose agent leads, on its lease
    probe/<node>                    host:port its agent answers reachability probes on, on its lease
    unreachable/<node>              the nodes it cannot reach now (JSON list), on its lease
    notice/<node>                   the node will be gone soon (`LeaveNotice`), on its lease
"""
from __future__ import annotations

from planaria.templates.plan import Worker

EPOCH = "epoch"
DONE = "done"
PROGRESS = "progress"
SPARES = "spares"
WAITING = "waiting"
MEMBERS = "members/"
JOB = "config"
LEADER = "leader"
NODES = "nodes/"
ALIVE = "alive/"
PROBE = "probe/"
UNREACHABLE = "unreachable/"
NOTICE = "notice/"
JOB_OK = "ok"
JOB_FAILED = "failed: "
"""`done`'s value for a failed job starts so, the reason follows."""


def run_prefix(run_id: str) -> str:
    """Everything of one job in etcd lies under this."""
    return f"/planaria/{run_id}/"


def node_registration(node: str) -> str:
    return f"{NODES}{node}"


def alive(worker: Worker) -> str:
    return f"{ALIVE}{worker_key(worker)}"


def kill_request(worker: Worker) -> str:
    """Set by the leader's controller: the worker's agent SIGKILLs it (a hung worker)."""
    return f"kill/{worker_key(worker)}"


def kill_requests_of(node: str) -> str:
    """A prefix of the kill requests of `node`'s workers, under either of the names they
    have ("<node>.<local>", and "<node>~<restart>.<local>" once restarted): what its agent
    follows, where a watch on the whole `kill/` would bring every agent every node's
    requests. It may hold another node's too (node1's holds node10's): a reader matches
    each worker's own key."""
    return f"kill/{node}"


def worker_key(worker: Worker) -> str:
    """A worker's name in keys and logs: "node.local"."""
    return f"{worker[0]}.{worker[1]}"


def parse_worker_key(key: str) -> Worker:
    """The inverse of `worker_key` (node names may contain dots: the local rank is last)."""
    node, _, local = key.rpartition(".")
    if not node or not local.isdigit():
        raise ValueError(f"{key!r} is not a worker name (node.local_rank)")
    return node, int(local)


def notice(node: str) -> str:
    """A node's preemption notice (`membership.LeaveNotice`): the leader plans it out."""
    return f"{NOTICE}{node}"


def ready(worker: Worker) -> str:
    """A worker out of every epoch, waiting for one after the value (`EpochHistory.out_of_their_epochs`)."""
    return f"ready/{worker_key(worker)}"


def member(worker: Worker) -> str:
    return f"{MEMBERS}{worker_key(worker)}"


def _epoch(epoch: int) -> str:
    return f"epoch/{epoch}/"


def epoch_record(epoch: int) -> str:
    return _epoch(epoch) + "record"


def epoch_prepared(epoch: int) -> str:
    """The next epoch's record, prepared by the controller while `epoch` still trains,
    before it asks it to stop for a planned leave. Its plan's `first_iteration` is a
    placeholder: a worker that stopped at the agreed step boundary enters it from the
    step after that one, without waiting for the controller; the controller then
    publishes it as the next epoch's record (docs/spot.md)."""
    return _epoch(epoch) + "prepared"


def epoch_status(epoch: int, worker: Worker) -> str:
    return epoch_statuses(epoch) + worker_key(worker)


def epoch_statuses(epoch: int) -> str:
    """The prefix under which every worker's status of `epoch` lies."""
    return _epoch(epoch) + "status/"


def epoch_timing(epoch: int, worker: Worker) -> str:
    return _epoch(epoch) + f"timing/{worker_key(worker)}"


def epoch_timings(epoch: int) -> str:
    """The prefix under which every worker's timing of `epoch` lies."""
    return _epoch(epoch) + "timing/"


def epoch_reconfigure(epoch: int) -> str:
    """The controller's word that `epoch` is over; its value is the reason (below)."""
    return _epoch(epoch) + "reconfigure"


JOIN = "join"
"""Nodes join: every worker stops after the same iteration (the commit carries the request)."""
LEAVE = "leave"
"""Nodes leave with notice (a preemption announced): every worker stops after the same
iteration, as for a join; the leaving nodes then hand their layers over and exit."""
FAILURE = "failure"
"""A worker failed: the epoch's collectives are released at once on every survivor
(`planaria.runtime.parallel.release`), however the failed peer behaves."""


def epoch_trained(epoch: int) -> str:
    return _epoch(epoch) + "trained"


def epoch_handed_off(epoch: int, worker: Worker) -> str:
    """A leaving worker's word that every copy it was the source of in `epoch` landed."""
    return _epoch(epoch) + f"handed/{worker_key(worker)}"


def epoch_event(epoch: int) -> str:
    return _epoch(epoch) + "event"


def epoch_rendezvous(epoch: int) -> str:
    """The prefix of the epoch's process-group rendezvous in a job store that is a
    TCPStore (over etcd, the epoch has a store of its own: `epoch_pg_store`)."""
    return _epoch(epoch) + "pg/"


def epoch_pg_store(epoch: int) -> str:
    """Where the epoch's bootstrap store serves, "host:port": written by the plan's rank 0,
    which hosts it (`planaria.runtime.worker.epoch_store`)."""
    return _epoch(epoch) + "pg_store"


def checkpoint_shards(iteration: int, epoch: int) -> str:
    return f"checkpoint/{iteration}/{epoch}/shards"


def checkpoint_commit(iteration: int, epoch: int) -> str:
    return f"checkpoint/{iteration}/{epoch}/commit"


def epoch_report(key: str) -> tuple[int, str] | None:
    """(epoch, "status" or "timing") when `key` is a worker's status or timing of an epoch
    (`epoch_status`, `epoch_timing`); None for any other key."""
    parts = key.split("/")
    if len(parts) == 4 and parts[0] == "epoch" and parts[1].isdigit() and parts[2] in ("status", "timing"):
        return int(parts[1]), parts[2]
    return None


def reconfigure_epoch(key: str) -> int | None:
    """The epoch whose end `key` is (`epoch_reconfigure`), or None."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == "epoch" and parts[1].isdigit() and parts[2] == "reconfigure":
        return int(parts[1])
    return None


def written_once(key: str) -> bool:
    """Whether `key` is written once and never changed or deleted while the job runs: an
    epoch's record (created if absent), a planned leave's prepared record (the same), and
    the address of an epoch's bootstrap store (its one host writes it once). A reader may
    keep such a value once it has seen it (a node's relay reads each once for all its
    workers: `planaria.elastic.node_relay`)."""
    if not key.startswith("epoch/"):
        return False
    return key.endswith(("/record", "/prepared", "/pg_store")) and key.count("/") == 2
