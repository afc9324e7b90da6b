"""The scale harness's simulated workers make the requests real workers make.

A real job (`LocalCluster`: agents on etcd, one worker process each, training
configs/tiny.yaml on gloo) and the scale harness (the real agents, simulated workers)
run one after the other, the same config, plan and faults, every worker's store
requests traced (`PLANARIA_STORE_TRACE`; the harness's `trace_dir`, through the same
`TracingStore`). Four nodes start; node3 is SIGKILLed once the first epoch trains;
node1 is told it will be preempted once the second does, and leaves, handing over the
layers only it holds (a planned leave, its next epoch prepared before the stop); a
fifth node is added once the third epoch trains; the job trains to its end. Then,
worker by worker and key by key, the operations must be the same
(`planaria.chaos.scale.traffic`: consecutive repeats collapsed, since how often a poll
asks is how long it waits; a read of an epoch's end set aside, since whether a
worker's watcher sees that word before its epoch ends on its own is timing).

A rendezvous value's size (gloo's address) is the plan's and is compared exactly; the
size of a record's value (a status, a timing, the progress, an announcement: JSON of
losses, times, error messages and pids, which no two runs share) within a factor of
1.5 (`RECORD_SIZE_FACTOR` says why).

The job writes TensorBoard metrics, so that its rank 0's reads for them are compared too.
What the harness does to be comparable, not a normalisation: a real worker asks nothing
for the seconds it takes to import torch and load its data, so the harness gives its
workers that start-up too (`worker_start_s`). A joiner announces itself once started,
and is planned in only then (`EpochHistory.out_of_their_epochs`): in both runs its
first look finds the epoch in force, which it is not in (a read of that epoch's record,
its `ready/` key), then the join's.

Not covered here: NCCL's bootstrap (no GPU: the harness's replay of NCCL's unique ids is
unchecked), checkpoints (the harness turns them off, `checkpoint.every=0`: a real
worker's `report_checkpoint` has no simulated counterpart), and W&B (no store request).

node0 starts alone and leads both runs, so the nodes the faults strike are the same in
both and lead in neither. Each fault waits until the epoch in force is under way alike
in both runs: a step committed, the job's progress published in it (by its rank 0's
watcher, within 0.2 s of its first commit: a fault sooner would leave that put out of
one run only), and a few more steps committed (`SETTLE_STEPS`), in which its peer
snapshots' group connects (on a thread of its own at idle priority, on the epoch's own
TCPStore: not the job's store, so not in the traces).

The epoch's process groups bootstrap on a TCPStore of their own (the plan's rank 0
hosts it; `planaria.runtime.worker.epoch_store`): what the job's store sees of it is
the host's put of its address and the others' follow of that key, compared here.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from planaria.chaos.cluster import LocalCluster
from planaria.chaos.scale.scale_run import ScaleHarness
from planaria.chaos.scale.traffic import differences, per_key, read_traces, size_differences
from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.runtime.contract import env, keys
from planaria.runtime.contract.epochs import Progress
from tests.launch import TINY
from tests.runtime.test_recovery import JOB

NODES = 4
OVERRIDES = [*JOB, "fault_tolerance.f=1", "train.steps=300", "logging.tensorboard.enabled=true"]
"""Steps enough for three faults on a busy machine: each waits for the epoch in force to
settle (a publication of the progress, about a second) and for its recovery, the last one
(a join) for a new agent's start too (0.5 to 2 s), while a real step takes 0.05 to 0.1 s
and a simulated one `STEP_S`."""
KILLED, LEAVING, JOINING = "node3", "node1", "node4"
NOTICE_S = 8.0
"""The leaving node's notice: inside the leader's window for a planned leave (`leave_window_s`,
ten seconds beyond what a leave needs), so that it is acted on at once."""
STEP_S = 0.05
SETTLE_STEPS = 6
"""Steps an epoch trains past the point where it is under way before the next fault: a
real worker takes peer snapshots once their group has connected everywhere and no
exchange is under way (the commit says), which takes a step or two; a status after a
failure sooner lists none (221 bytes instead of 380 to 526: the simulated worker takes
them from its first step)."""
WORKER_START_S = 2.0
"""A simulated worker's start-up (module docstring): longer than the controller takes
to plan a join in (one step, the statuses, the record), shorter than a real worker's."""


@dataclass
class Run:
    """One of the two runs, as the test drives it: its job's keys in etcd, its traces,
    and its faults (on nodes by name)."""

    name: str
    client: EtcdClient
    prefix: str
    trace_dir: Path
    add_node: Callable[[], object]
    kill: Callable[[str], None]
    notice: Callable[[str], None]
    logs: Callable[[], str]

    def value(self, key: str) -> bytes | None:
        return self.client.get(self.prefix + key)[0]

    def leader(self) -> str | None:
        value = self.value(keys.LEADER)
        return value.decode() if value else None

    def outcome(self) -> str | None:
        value = self.value(keys.DONE)
        return value.decode() if value else None

    def progress(self) -> Progress | None:
        value = self.value(keys.PROGRESS)
        return Progress.from_json(value) if value else None

    def under_way(self, epoch: int) -> bool:
        """Epoch `epoch` committed a step, its rank 0 published the job's progress in it,
        and every worker's peer-snapshot group of it connected (module docstring)."""
        record, progress = self.value(keys.epoch_record(epoch)), self.progress()
        if record is None or progress is None or self.value(keys.epoch_trained(epoch)) is None:
            return False
        # (The peer snapshots' group connects on its epoch's own TCPStore, which is not the
        # job's store and not traced: the steps after this point, `SETTLE_STEPS`, give it
        # the time it takes, a step or two.)
        return progress.epoch >= epoch


def index(node: str) -> int:
    return int(node.removeprefix("node"))


def real_run(tmp_path: Path, closing: list) -> Run:
    """The real job, node0 started (the others: `Run.add_node`)."""
    trace_dir = tmp_path / "real-traces"
    cluster = LocalCluster(TINY, [*OVERRIDES, f"output.dir={tmp_path / 'real'}"], nodes=1, min_nodes=NODES,
                           nproc=1, out_dir=tmp_path / "real", run_id=f"traffic-{uuid.uuid4().hex[:8]}",
                           env={env.STORE_TRACE: str(trace_dir)})
    closing.append(cluster.close)

    def notice(node: str) -> None:
        cluster.preempt(index(node), NOTICE_S)  # (its agent reads it from the local cloud)

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(cluster.log_dir.glob("agent-*.log")))
    return Run("real", cluster.client, cluster.prefix, trace_dir, cluster.add_node,
               kill=lambda node: cluster.kill_node(index(node)), notice=notice, logs=logs)


def simulated_run(tmp_path: Path, closing: list) -> Run:
    """The scale harness's job, node0 started (the others: `Run.add_node`)."""
    trace_dir = tmp_path / "simulated-traces"
    harness = ScaleHarness(nodes=NODES, gpus_per_node=1, config=str(TINY),
                           overrides=[*OVERRIDES, f"output.dir={tmp_path / 'simulated'}"], step_s=STEP_S,
                           backend="gloo", lease_ttl_s=3, etcd_members=1, log_dir=tmp_path / "simulated-logs",
                           trace_dir=trace_dir, worker_start_s=WORKER_START_S, log=lambda line: None)
    harness.__enter__()
    closing.append(harness.close)
    harness.add_node()
    client = EtcdClient(EtcdSettings(endpoint=harness.etcd.endpoint))
    closing.append(client.close)

    def logs() -> str:
        return "\n".join(f"--- {a.node}\n" + "\n".join(a.lines[-20:]) for a in harness.agents)
    return Run("simulated", client, keys.run_prefix(harness.run_id), trace_dir, harness.add_node,
               kill=lambda node: harness.kill_node(index(node)),
               notice=lambda node: harness.notice(index(node), NOTICE_S), logs=logs)


def wait_for(run: Run, done: Callable[[], bool], what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if run.outcome() is not None:
            raise AssertionError(f"the {run.name} run ended ({run.outcome()}) before {what}: too few "
                                 f"steps for this machine's pace?\n{run.logs()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"the {run.name} run: no {what} within {timeout_s:.0f} s\n{run.logs()}")
        time.sleep(0.05)


def settle(run: Run, epoch: int, what: str) -> None:
    """Wait until `epoch` is under way, then for a few more steps (`SETTLE_STEPS`)."""
    wait_for(run, lambda: run.under_way(epoch), f"epoch {epoch} under way ({what})")
    step = run.progress().step
    wait_for(run, lambda: run.progress().step >= step + SETTLE_STEPS, f"{SETTLE_STEPS} steps of epoch {epoch}")


def drive(run: Run) -> str:
    """The module docstring's faults, in order; the job's outcome."""
    wait_for(run, lambda: run.leader() == "node0", "leadership of node0")
    for _ in range(NODES - 1):
        run.add_node()
    settle(run, 0, "the start")
    run.kill(KILLED)
    settle(run, 1, f"{KILLED} killed")
    run.notice(LEAVING)
    settle(run, 2, f"{LEAVING} told to leave")
    run.add_node()
    wait_for(run, lambda: run.under_way(3), f"epoch 3 under way after {JOINING} was added")
    deadline = time.monotonic() + 300  # (the rest of the steps: 15 s on an idle machine, minutes on a loaded one)
    while run.outcome() is None:
        assert time.monotonic() < deadline, f"the {run.name} run did not end\n{run.logs()}"
        time.sleep(0.05)
    return run.outcome()


def traced_run(make: Callable[[Path, list], Run], tmp_path: Path) -> dict[str, list[dict]]:
    closing: list[Callable[[], None]] = []
    try:
        run = make(tmp_path, closing)
        outcome = drive(run)
        assert outcome == "ok", f"the {run.name} run ended {outcome}\n{run.logs()}"
    finally:
        for close in reversed(closing):
            close()
    return read_traces(run.trace_dir)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)  # about 60 s on 2 idle cores
def test_simulated_workers_make_the_requests_of_real_workers(tmp_path):
    real = traced_run(real_run, tmp_path)
    simulated = traced_run(simulated_run, tmp_path)
    assert set(real) == {f"node{i}.0" for i in range(NODES + 1)}, sorted(real)
    # The leave handed layers over (the plan of three nodes after the kill keeps one copy of each).
    # The handoff's group meets on the epoch's own TCPStore; in the job's store it shows as
    # the leaving worker's word that its copies landed.
    assert any("/handed/" in key for key in per_key(real[f"{LEAVING}.0"])), "no handoff: the test lost its leave"
    found = differences(real, simulated)
    assert not found, (f"the simulated workers' requests differ from the real workers' ({KILLED} killed, "
                       f"{LEAVING} left, {JOINING} joined); first differences:\n" + "\n".join(found))
    sizes = size_differences(real, simulated)
    assert not sizes, "the simulated workers' records are not the size of the real workers':\n" + "\n".join(sizes)


# ------------------------------------------------------------- the normalisation
def op(name: str, key: str, **more) -> dict:
    """A trace's line (`TracingStore`): `check` and `wait` name a list of keys."""
    if name in ("check", "wait"):
        return {"op": name, "keys": [key], **more}
    return {"op": name, "key": key, **more}


def test_a_poll_is_its_kinds_of_request_in_order_however_many_times_it_asked():
    polls = [op("check", "epoch/0/pg//0//cpu//0/1")] * 5 + [op("get", "epoch/0/pg//0//cpu//0/1")]
    progress = [op("set", "progress", bytes=80 + i) for i in range(4)]
    assert per_key([op("set", "epoch/0/pg//0//cpu//0/1", bytes=186), *polls, *progress]) == {
        "epoch/0/pg//0//cpu//0/1": ["set(186)", "check", "get"], "progress": ["set"]}


def test_a_rendezvous_value_of_another_size_differs_a_records_does_not():
    real = {"node0.0": [op("set", "epoch/1/pg//0//cpu//0/0", bytes=178), op("set", "epoch/1/status/node0.0", bytes=400)]}
    simulated = {"node0.0": [op("set", "epoch/1/pg//0//cpu//0/0", bytes=186),
                             op("set", "epoch/1/status/node0.0", bytes=200)]}
    assert differences(real, simulated) == [
        "node0.0 epoch/1/pg//0//cpu//0/0: real set(178) != simulated set(186)"]


def test_whether_a_watcher_read_the_end_of_its_epoch_is_set_aside_and_nothing_else():
    seen = [op("check", "epoch/0/reconfigure"), op("get", "epoch/0/reconfigure"), op("check", "epoch/0/reconfigure")]
    assert per_key(seen) == per_key([op("check", "epoch/0/reconfigure")]) == {"epoch/0/reconfigure": ["check"]}
    assert per_key([op("get", "epoch/0/record")]) == {"epoch/0/record": ["get"]}


def test_whether_a_leaving_worker_waited_out_its_linger_is_set_aside():
    handed = [op("set", "epoch/2/handed/node1.0"), op("get", "epoch/2/trained")]
    lingered = [*handed, op("check", "epoch/2/reconfigure")]
    assert per_key(lingered) == per_key(handed) == {"epoch/2/handed/node1.0": ["set"], "epoch/2/trained": ["get"]}
    # (before the word, the check is the failed handoff's, and counts)
    assert per_key([op("check", "epoch/2/reconfigure")]) == {"epoch/2/reconfigure": ["check"]}
    assert per_key([*handed, op("check", "epoch/3/reconfigure")])["epoch/3/reconfigure"] == ["check"]


def test_differences_name_the_workers_and_keys_of_one_run_only():
    real = {"node0.0": [op("get", "epoch/0/record")], "node1.0": []}
    simulated = {"node0.0": [op("get", "epoch/0/record"), op("set", "ready/node0.0")], "node2.0": []}
    assert differences(real, simulated) == [
        "worker node1.0: only in the real run", "worker node2.0: only in the simulated run",
        "node0.0 ready/node0.0: real (never used) != simulated set"]


def test_a_records_size_is_compared_within_a_factor_the_largest_write_of_each():
    real = {"node0.0": [op("set", "progress", bytes=80), op("set", "progress", bytes=86),
                        op("set", "epoch/0/status/node0.0", bytes=520), op("set", "members/node0.0", bytes=14)]}
    simulated = {"node0.0": [op("set", "progress", bytes=70), op("set", "epoch/0/status/node0.0", bytes=200),
                             op("set", "members/node0.0", bytes=13)]}
    assert size_differences(real, simulated) == ["node0.0 epoch/0/status/node0.0: real 520 bytes, simulated 200"]


def test_a_failed_request_differs_from_one_answered():
    assert per_key([op("get", "done", error="DistStoreError")]) == {"done": ["get!DistStoreError"]}
