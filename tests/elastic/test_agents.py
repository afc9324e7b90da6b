"""Agents on etcd: one process per node, leases for membership, a leader that runs the
controller. The leader's own node dies (agent and worker SIGKILLed together, as a machine
vanishes); another agent takes over the leadership and the job recovers in place."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.runtime.contract import keys
from tests.launch import TINY, reference_run
from tests.runtime.test_recovery import JOB, check_against_reference


class Job:
    def __init__(self, etcd, tmp_path, nodes: int, overrides: list[str], run_id: str,
                 env: dict[str, dict[str, str]] | None = None, nproc: int = 1,
                 agent_args: tuple[str, ...] = (), node_args: dict[str, tuple[str, ...]] | None = None):
        """`node_args`: more agent options for some nodes ({node: options})."""
        self.overrides = [*overrides, f"output.dir={tmp_path}"]
        self.nproc, self.agent_args, self.node_args = nproc, list(agent_args), node_args or {}
        self.etcd, self.tmp_path, self.run_id, self.min_nodes = etcd, tmp_path, run_id, nodes
        self.agents = {}
        (tmp_path / "logs").mkdir(parents=True, exist_ok=True)
        for i in range(nodes):
            self.add_node(f"node{i}", (env or {}).get(f"node{i}"))
        self.client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint))
        self.prefix = keys.run_prefix(run_id)

    def add_node(self, node: str, env: dict[str, str] | None = None) -> None:
        log = open(self.tmp_path / "logs" / f"agent-{node}.log", "w")
        self.agents[node] = subprocess.Popen(
            [sys.executable, "-m", "planaria.elastic.agent", "--node", node, "--etcd", self.etcd.endpoint,
             "--nproc-per-node", str(self.nproc), *self.agent_args, *self.node_args.get(node, ()),
             "--run-id", self.run_id, "--nnodes", str(self.min_nodes), "--lease-ttl", "3", str(TINY),
             *self.overrides],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
            start_new_session=True)  # a node: the agent and its workers, killed together

    def wait_for_commits(self, count: int, worker: str = "node0.0") -> None:
        log = self.tmp_path / f"commits-{worker}.jsonl"
        deadline = time.monotonic() + 120
        while not (log.exists() and len(log.read_text().splitlines()) >= count):
            assert time.monotonic() < deadline, "training did not get there"
            time.sleep(0.05)

    def logs(self, tail: int | None = None) -> str:
        """The agents' logs, whole, or each one's last `tail` characters (for a failure's
        message: a worker's exit can add kilobytes of its libraries' reports at the end,
        which a tail searched for the agents' lines would let push them out)."""
        return "\n".join(f"--- {p.name}\n{p.read_text()[-tail:] if tail else p.read_text()}"
                         for p in sorted((self.tmp_path / "logs").glob("*.log")))

    def close(self) -> None:
        for agent in self.agents.values():
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)

    def leader(self, timeout=60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value, _ = self.client.get(self.prefix + keys.LEADER)
            if value:
                return value.decode()
            time.sleep(0.1)
        raise AssertionError("no leader elected")

    def imported_torch(self, node: str) -> bool:
        """Whether `node`'s agent process has torch's library mapped (Linux)."""
        return "libtorch" in Path(f"/proc/{self.agents[node].pid}/maps").read_text()

    def kill_node(self, node: str) -> None:
        os.killpg(self.agents[node].pid, signal.SIGKILL)

    def wait(self, timeout=240) -> dict[str, int]:
        return {node: agent.wait(timeout=timeout) for node, agent in self.agents.items()}


def run_until_every_node_ended_ok(job: Job) -> str:
    """Wait for the job's end, every agent "ok"; the agents' logs."""
    try:
        codes = job.wait()
    finally:
        job.close()
    logs = job.logs()
    assert all(code == 0 for code in codes.values()), f"{codes}\n{job.logs(tail=4000)}"
    return logs


def run_until_only_this_node_left(job: Job, node: str) -> None:
    """Wait for the job's end: `node` left it (exit 1), every other agent ended "ok"."""
    try:
        codes = job.wait()
    finally:
        job.close()
    assert codes[node] == 1 and all(c == 0 for n, c in codes.items() if n != node), \
        f"{codes}\n{job.logs(tail=4000)}"


@pytest.fixture(scope="module")
def reference():
    return reference_run(JOB)


OVERRIDES = [*JOB, "fault_tolerance.f=1"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_leader_node_killed_another_agent_leads_and_the_job_recovers(etcd, tmp_path, reference):
    job = Job(etcd, tmp_path, 4, OVERRIDES, run_id="leader-dies")
    try:
        leader = job.leader()
        job.wait_for_commits(2)
        job.kill_node(leader)
        codes = job.wait()
    finally:
        job.close()
    assert all(code == 0 for node, code in codes.items() if node != leader), f"{codes}\n{job.logs(tail=4000)}"
    assert job.leader() != leader
    # (at epoch 0, or at the next one when the dying leader had published it already)
    assert "controller: resumed at epoch" in job.logs()
    check_against_reference(tmp_path, reference, job)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_process_groups_bootstrap_on_their_epochs_store_not_in_etcd(etcd, tmp_path, reference):
    """Every epoch's groups rendezvous on a TCPStore that the plan's rank 0 hosts
    (`planaria.runtime.worker.epoch_store`): etcd holds its address, one key an epoch,
    and none of the groups' keys (`epoch/<e>/pg/`). The node hosting epoch 0's store is
    killed: that epoch fails with it, and the survivors' next epoch meets on a store of
    its new rank 0. The losses are the reference's."""
    from planaria.runtime.contract.epochs import EpochRecord

    job = Job(etcd, tmp_path, 4, OVERRIDES, run_id="epoch-stores")
    try:
        job.wait_for_commits(2)
        record = EpochRecord.from_json(job.client.get(job.prefix + keys.epoch_record(0))[0])
        host = record.plan.worker(0)[0]
        job.kill_node(host)
        codes = job.wait()
    finally:
        job.close()
    assert all(code == 0 for node, code in codes.items() if node != host), f"{codes}\n{job.logs(tail=4000)}"
    in_etcd = job.client.items_with_prefix(job.prefix)
    trained = sorted(int(k.split("/")[1]) for k in in_etcd if k.startswith("epoch/") and k.endswith("/trained"))
    assert len(trained) >= 2, f"no epoch trained after the host's death: {trained}\n{job.logs(tail=4000)}"
    assert not [k for k in in_etcd if "/pg/" in k], "a process group's key in etcd"
    assert all(keys.epoch_pg_store(e) in in_etcd for e in trained)
    assert len({in_etcd[keys.epoch_pg_store(e)] for e in trained}) == len(trained), "a store of each epoch's own"
    check_against_reference(tmp_path, reference, job)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_leaving_nodes_find_the_epochs_store_and_hand_their_layers_over_there(etcd, tmp_path):
    """Every holder of a stage leaves with notice (SIGTERM, peer snapshots off): the next
    epoch's receivers and the leaving workers, which are in no plan, meet on that epoch's
    bootstrap store (found through etcd, as its ranks find it) to hand over the layers only
    the leaving nodes hold. Nothing is lost: the losses are the reference's."""
    from planaria.runtime.contract.epochs import EpochRecord

    steps = [*JOB, "train.steps=60"]
    job = Job(etcd, tmp_path, 4, [*steps, "fault_tolerance.f=1", "checkpoint.memory_every=0"], run_id="handoff",
              agent_args=("--preemption-grace", "12"))
    try:
        leader = job.leader()
        job.wait_for_commits(2)
        plan = EpochRecord.from_json(job.client.get(job.prefix + keys.epoch_record(0))[0]).plan
        stages: dict[int, set[str]] = {}
        for rank in range(plan.world_size):
            stages.setdefault(plan.rank_info(rank).stage, set()).add(plan.rank_info(rank).node)
        leaving = sorted(next(nodes for nodes in stages.values() if leader not in nodes))
        for node in leaving:
            job.agents[node].send_signal(signal.SIGTERM)
        codes = job.wait()
    finally:
        job.close()
    assert all(codes[n] == 128 + signal.SIGTERM for n in leaving), f"{codes}\n{job.logs(tail=4000)}"
    assert all(code == 0 for n, code in codes.items() if n not in leaving), f"{codes}\n{job.logs(tail=4000)}"
    assert "layer shard(s) over" in job.logs(), job.logs(tail=4000)
    check_against_reference(tmp_path, reference_run(steps), job, steps=60)


def signal_a_follower_agent(etcd, tmp_path, run_id: str, signum: int, overrides=None,
                            agent_args: tuple[str, ...] = ()) -> tuple[str, dict[str, int], Job]:
    """Send `signum` to one agent that does not lead (its process only) after two steps."""
    job = Job(etcd, tmp_path, 4, overrides or OVERRIDES, run_id=run_id, agent_args=agent_args)
    try:
        leader = job.leader()
        victim = next(n for n in ("node1", "node2", "node3") if n != leader)
        job.wait_for_commits(2)
        job.agents[victim].send_signal(signum)
        codes = job.wait()
    finally:
        job.close()
    assert all(code == 0 for node, code in codes.items() if node != victim), f"{codes}\n{job.logs(tail=4000)}"
    return victim, codes, job


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_agent_killed_takes_its_worker_along(etcd, tmp_path, reference):
    """Only the agent process is SIGKILLed: its worker dies with it (PR_SET_PDEATHSIG)."""
    victim, _, job = signal_a_follower_agent(etcd, tmp_path, "agent-dies", signal.SIGKILL)
    assert f"'{victim}.0'" in job.logs()  # the controller's line: failed [...]
    check_against_reference(tmp_path, reference, job)


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_node_added_is_absorbed(etcd, tmp_path):
    """A fifth agent starts while the job trains (long enough for its start-up: a new
    node takes about 40 steps to import torch and build its model on an idle 2-core
    machine, more on a busy one)."""
    longer = [*OVERRIDES, "train.steps=120"]
    reference = reference_run([*JOB, "train.steps=120"])
    job = Job(etcd, tmp_path, 4, longer, run_id="node-added")
    try:
        job.wait_for_commits(2)
        job.add_node("node4")
        job.wait_for_commits(1, worker="node4.0")
        # An agent never computes, the leader's neither, through a reconfiguration that
        # planned and moved layers: none has imported torch (seconds and ~250 MB each).
        assert not [node for node in job.agents if job.imported_torch(node)], job.logs(tail=4000)
        codes = job.wait()
    finally:
        job.close()
    assert all(code == 0 for code in codes.values()), f"{codes}\n{job.logs(tail=4000)}"
    assert "joined ['node4.0']" in job.logs()
    assert (tmp_path / "commits-node4.0.jsonl").exists()
    check_against_reference(tmp_path, reference, job, steps=120)


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_workers_per_node_one_dies_and_its_agent_takes_the_node_out(etcd, tmp_path, reference):
    """Nodes of two workers (tp = 2). node3's second worker dies in a backward; its agent
    stops node3's first worker too (a stage needs its whole node) and the three nodes
    left go on in place, moving tp shards between workers of the same tp rank."""
    job = Job(etcd, tmp_path, 4, [*OVERRIDES, "parallel.tp=2"], run_id="two-per-node", nproc=2,
              env={"node3": {"PLANARIA_FAULTS": "node3.1:backward@2#2"}})
    run_until_only_this_node_left(job, "node3")
    logs = job.logs()
    assert "worker node3.1 exited with code -9" in logs
    (epoch,) = [line for line in logs.splitlines() if "controller: epoch" in line]
    assert "'node3.1'" in epoch and "pipelines of [3] stages" in epoch, epoch
    check_against_reference(tmp_path, reference, job)


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_max_restarts_a_node_whose_worker_died_rejoins_as_new_capacity(etcd, tmp_path):
    """--max-restarts 1: node3's worker dies in iteration 2; its agent starts it again as
    node3~1, which joins the running job (its commit log is its own, from where it joined)."""
    reference = reference_run([*JOB, "train.steps=60"])
    job = Job(etcd, tmp_path, 4, [*OVERRIDES, "train.steps=60"], run_id="restarts",
              env={"node3": {"PLANARIA_FAULTS": "node3.0:backward@2#2"}}, agent_args=("--max-restarts", "1"))
    logs = run_until_every_node_ended_ok(job)
    assert "restarting this node's workers (restart 1 of 1); they join the job as node3~1" in logs
    assert "joined ['node3~1.0']" in logs, logs
    assert (tmp_path / "commits-node3~1.0.jsonl").exists()
    check_against_reference(tmp_path, reference, job, steps=60)


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sigterm_to_an_agent_is_a_notice_its_node_leaves_at_a_step_boundary(etcd, tmp_path):
    """What Kubernetes and Slurm send before they take a machine: SIGTERM to one agent (not
    its workers), with 12 s of grace (within the leave window at once, so that the test
    need not wait). The node leaves at a step boundary (a planned leave: no failure,
    nothing trained again), and its agent exits 143."""
    longer = [*OVERRIDES, "train.steps=60"]  # long enough for the leave to happen before the end
    victim, codes, job = signal_a_follower_agent(etcd, tmp_path, "sigterm", signal.SIGTERM, longer,
                                                 agent_args=("--preemption-grace", "12"))
    assert codes[victim] == 128 + signal.SIGTERM, f"{codes}\n{job.logs(tail=4000)}"
    logs = job.logs()
    assert "preemption notice (SIGTERM, 12 s of grace)" in logs
    assert "(leave; failed -, joined -; left ['%s'])" % victim in logs, logs
    check_against_reference(tmp_path, reference_run([*JOB, "train.steps=60"]), job, steps=60)


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sigterm_twice_stops_the_node_at_once(etcd, tmp_path, reference):
    """A second SIGTERM during the grace period is an order to stop now (torchrun's
    meaning): the agent stops its worker, leaves, and the others recover from the failure."""
    job = Job(etcd, tmp_path, 4, OVERRIDES, run_id="sigterm-twice", agent_args=("--preemption-grace", "600"))
    try:
        leader = job.leader()
        victim = next(n for n in ("node1", "node2", "node3") if n != leader)
        job.wait_for_commits(2)
        job.agents[victim].send_signal(signal.SIGTERM)
        time.sleep(0.05)
        job.agents[victim].send_signal(signal.SIGTERM)
        codes = job.wait()
    finally:
        job.close()
    assert codes[victim] == 128 + signal.SIGTERM, f"{codes}\n{job.logs(tail=4000)}"
    assert "SIGTERM: stopping this node's workers" in job.logs()
    check_against_reference(tmp_path, reference, job)


@pytest.mark.timeout(120)
def test_a_worker_that_dies_of_an_exception_is_reported_from_its_error_file(etcd, tmp_path):
    """The worker's uncaught exception reaches TORCHELASTIC_ERROR_FILE (torch's `record`),
    and its agent's line names it."""
    one_node = [*JOB, "parallel.min_stages=1", "fault_tolerance.f=0"]
    job = Job(etcd, tmp_path, 1, one_node, run_id="error-file",
              env={"node0": {"PLANARIA_CORRUPT": "not-a-spec"}})
    try:
        codes = job.wait(timeout=100)
    finally:
        job.close()
    assert codes["node0"] == 1
    assert ("worker node0.0 exited with code 1: ValueError: bad PLANARIA_CORRUPT item 'not-a-spec'"
            in job.logs()), job.logs(tail=4000)


@pytest.mark.timeout(120)
def test_same_run_id_with_another_config_is_refused(etcd, tmp_path):
    base = [sys.executable, "-m", "planaria.elastic.agent", "--etcd", etcd.endpoint, "--run-id",
            "one-job", "--nnodes", "9", str(TINY), f"output.dir={tmp_path}"]
    first = subprocess.Popen([*base[:3], "--node", "a", *base[3:], "train.steps=5"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint))
        deadline = time.monotonic() + 60
        while client.get(keys.run_prefix("one-job") + keys.JOB)[0] is None:
            assert time.monotonic() < deadline and first.poll() is None, first.stdout.read()
            time.sleep(0.1)
        second = subprocess.run([*base[:3], "--node", "b", *base[3:], "train.steps=7"],
                                capture_output=True, text=True, timeout=60)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
    assert second.returncode == 2
    assert "refused: run id 'one-job' already runs" in second.stdout
    assert "train.steps=5" in second.stdout and "train.steps=7" in second.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_stopped_worker_is_killed_by_its_agent_and_its_node_joins_again(etcd, tmp_path, reference):
    """node2's worker stops (SIGSTOP) in a backward. Its agent sees its process stopped
    (comm.stopped_timeout_s, 0.5 s) and kills it, without waiting for the leader or the
    heartbeat; the others go on without node2, whose agent starts fresh workers that join
    again (the machine is sound), and the job ends with every node in it. (The collective
    timeout is made longer than that, so that the agent is what ends the epoch.)"""
    # node0 dawdles 6 s in iteration 4 (a straggler), so that the six steps are not over
    # before the fresh worker has started (it is planned in once started, the job
    # training meanwhile).
    job = Job(etcd, tmp_path, 4, [*OVERRIDES, "comm.timeout_s=60"], run_id="frozen",
              env={"node2": {"PLANARIA_FAULTS": "node2.0:backward@2!hang"},
                   "node0": {"PLANARIA_FAULTS": "node0.0:commit@4!slow=6"}})
    logs = run_until_every_node_ended_ok(job)
    assert "worker node2.0 stopped for" in logs
    assert "restarting this node's workers (a worker hung" in logs and "joined ['node2~1.0']" in logs
    assert "did not report" not in logs
    check_against_reference(tmp_path, reference, job)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_stuck_worker_is_killed_by_its_agent_and_a_slow_step_is_not(etcd, tmp_path, reference):
    """node3's worker waits forever inside a forward of step 4, its process running and
    its heartbeat beating: only its progress shows it. Its agent kills it once it made no
    progress for its bound (comm.stuck_factor x its median step; the floor made small
    here), and the job goes on without node3 (whose agent starts fresh workers). node1's
    step 3 is made about three times as long as the others (0.05 s each, on two cores): it is no hang, and its peers,
    blocked on node1 and node3 meanwhile, wait in collectives, which never count."""
    job = Job(etcd, tmp_path, 4, [*OVERRIDES, "comm.timeout_s=60", "comm.stuck_floor_s=0.2"], run_id="stuck",
              env={"node3": {"PLANARIA_FAULTS": "node3.0:forward@4!stall"},
                   "node1": {"PLANARIA_FAULTS": "node1.0:forward@3!slow=0.12"}})
    logs = run_until_every_node_ended_ok(job)
    assert "worker node3.0 is stuck: no progress in its step" in logs
    assert "restarting this node's workers (a worker hung" in logs
    assert logs.count("is stuck") == 1 and "stopped for" not in logs and "did not report" not in logs
    check_against_reference(tmp_path, reference, job)


@pytest.mark.slow  # the path a stuck but beating worker takes; the frozen one is above
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_hung_worker_is_killed_by_its_agent_on_the_leaders_request(etcd, tmp_path, reference):
    """The same, with the agent's watches out of the way: node2's worker reports nothing,
    so the leader, after its status timeout, asks its agent to kill it."""
    job = Job(etcd, tmp_path, 4, [*OVERRIDES, "comm.timeout_s=4", "comm.heartbeat_timeout_s=1000",
                                  "comm.stopped_timeout_s=0"],
              run_id="hung", env={"node2": {"PLANARIA_FAULTS": "node2.0:backward@2!hang"}})
    run_until_only_this_node_left(job, "node2")
    assert "worker node2.0 did not report" in job.logs()
    check_against_reference(tmp_path, reference, job)


@pytest.mark.timeout(120)
def test_unreachable_etcd_is_named_after_retrying(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "planaria.elastic.agent", "--node", "a", "--etcd",
                           "127.0.0.1:1", "--etcd-retry", "2", "--run-id", "x", "--nnodes", "1",
                           str(TINY), f"output.dir={tmp_path}"], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2
    assert "etcd at 127.0.0.1:1 did not answer" in proc.stderr and "Traceback" not in proc.stderr


def _agent(etcd, tmp_path, node: str, run_id: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planaria.elastic.agent", "--node", node, "--etcd",
                           etcd.endpoint, "--run-id", run_id, "--nnodes", "1", *extra, str(TINY),
                           f"output.dir={tmp_path}"], capture_output=True, text=True, timeout=100)


def test_a_run_id_whose_job_ended_is_not_run_again(etcd, tmp_path):
    """Its agents would read the old outcome and exit 0 at once, as if this job had run."""
    client = EtcdClient(EtcdSettings(endpoint=etcd.endpoint))
    client.put(keys.run_prefix("ended") + keys.DONE, keys.JOB_OK.encode())
    proc = _agent(etcd, tmp_path, "a", "ended")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "run id 'ended' already ran and ended (ok)" in proc.stdout
    assert "etcdctl del --prefix /planaria/ended/" in proc.stdout


def test_two_agents_under_one_node_name_the_second_is_refused(etcd, tmp_path):
    """Two machines given the same --node-rank: the second agent must not count the first
    one's workers as its own. It waits out a lease (the first might be a dead agent of
    this machine) and is refused, naming what to do; the first is not disturbed."""
    from planaria.elastic.agent import Agent
    from planaria.elastic.node_membership import NodeNameTaken

    settings = EtcdSettings(endpoint=etcd.endpoint)
    first, second = (Agent(node="twin", nproc=1, settings=settings, run_id="twins", min_nodes=1,
                           config=str(TINY), overrides=[f"output.dir={tmp_path}"], lease_ttl_s=1)
                     for _ in range(2))
    first._register()
    threading.Thread(target=first.membership.keep_alive, args=(first._stop, lambda: False), daemon=True).start()
    started = time.monotonic()
    with pytest.raises(NodeNameTaken, match="give each machine its own --node-rank"):
        second._register()
    assert time.monotonic() - started >= 1.5  # waited for the name, in case it was free soon
    assert first.client.refresh(first.membership.lease)  # the first agent's claim stands
    first._stop.set()
    first.client.revoke(first.membership.lease)  # the first agent leaves: the name is free
    second._register()
    second.client.revoke(second.membership.lease)


def test_a_late_failed_refresh_of_the_expired_lease_does_not_make_the_node_register_again(etcd, tmp_path):
    """The lease expired (etcd was away); the agent registers under a new one. A refresh
    of the old lease that fails only now (the keep-alive thread or the controller read
    the lease before the swap) says nothing of the new one: the node registered twice
    when it did (seen in CI as two "registering again" for one outage)."""
    from planaria.elastic.agent import Agent

    agent = Agent(node="late", nproc=1, settings=EtcdSettings(endpoint=etcd.endpoint), run_id="late",
                  min_nodes=1, config=str(TINY), overrides=[f"output.dir={tmp_path}"], lease_ttl_s=2)
    membership = agent.membership
    agent._register()
    old = membership.lease
    agent.client.revoke(old)  # as an expiry would
    assert membership.still_leading() is False  # the controller's refresh finds it gone
    assert membership.lost.is_set()
    agent._register()
    assert membership.lease != old and not membership.lost.is_set()
    assert agent.client.refresh(old) is False
    membership.mark_lost(old)  # what a refresh of the old lease that read it before the swap does
    assert not membership.lost.is_set(), "a late failure of the old lease marked the new one lost"
    membership.mark_lost(membership.lease)
    assert membership.lost.is_set()  # the lease in force still counts
    agent.client.revoke(membership.lease)


def test_a_worker_exit_while_the_lease_was_lost_still_takes_the_node_out(etcd, tmp_path):
    """The worker's `alive/` key went with the expired lease (etcd was away) before the
    agent saw the exit: the exit still counts (the agent once looked only at the key,
    and its node then neither left nor restarted)."""
    from planaria.elastic.agent import Agent

    agent = Agent(node="lapsed", nproc=1, settings=EtcdSettings(endpoint=etcd.endpoint), run_id="lapsed",
                  min_nodes=1, config=str(TINY), overrides=[f"output.dir={tmp_path}"], lease_ttl_s=2)
    agent._register()
    worker, supervisor = ("lapsed", 0), agent.supervisor
    supervisor.workers[worker] = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    agent.client.put(agent.prefix + keys.alive(("lapsed", 0)), b"1", lease=agent.membership.lease)
    supervisor.workers[worker].wait()
    agent.client.revoke(agent.membership.lease)  # as an expiry would: the key is gone
    assert agent.client.get(agent.prefix + keys.alive(("lapsed", 0)))[0] is None
    assert supervisor.reap() is True
    assert supervisor.reap() is False  # counted once


def test_the_leaders_own_exited_worker_is_not_alive_before_its_agent_reaps_it(etcd, tmp_path):
    """While the leader's controller collects an epoch's statuses, its agent's loop does
    not reap: a worker of its own node that exited then still has its `alive` key. The
    controller's view of who is alive leaves it out all the same (else it waited for
    that worker's status until the status timeout, minutes)."""
    from planaria.elastic.agent import Agent

    agent = Agent(node="node0", nproc=2, settings=EtcdSettings(endpoint=etcd.endpoint), run_id="own-exit",
                  min_nodes=1, config=str(TINY), overrides=[f"output.dir={tmp_path}"])
    for worker in (("node0", 0), ("node0", 1), ("node1", 0)):
        agent.client.put(agent.prefix + keys.alive(worker), b"1")
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        agent.supervisor.workers.update({("node0", 0): exited, ("node0", 1): running})
        assert agent._alive_now() == {("node0", 1), ("node1", 0)}  # (no probe: it starts with `run`)
    finally:
        running.kill()
        running.wait()
