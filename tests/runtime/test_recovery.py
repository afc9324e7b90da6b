"""In-place recovery on real processes: workers SIGKILLed at every phase of an iteration,
the survivors reconfigure, copy the lost layers from replicas, and finish the job with
the losses and final parameters of a run where nothing failed (float64, gloo, CPU).

Each case runs a `LocalJob` (a TCPStore, the controller, one process per node) and
checks what a user would: the job finished; every iteration was committed exactly once
on every worker that lived through it (per-worker commit logs: consecutive, no repeats);
each iteration's loss equals the plain single-process reference within 1e-9; the final
parameters equal the reference's; and no checkpoint was involved (the job has none).
"""
from __future__ import annotations

import pytest

from planaria.elastic.local_job import LocalJob
from planaria.runtime.contract.exits import EXIT_TORN_STEP
from planaria.runtime.contract.logs import AUDIT, COMMITS, AuditEntry, CommitEntry, read_logs
from tests.launch import TINY, assert_final_parameters, cases_with_slow, reference_run

STEPS = 6
JOB = [
    "model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.vocab_size=128",
    "model.seq_len=16", "data.source=synthetic", f"train.steps={STEPS}", "train.global_batch=8",
    "train.micro_batch=1", "train.dtype=float64", "train.lr=0.01", "train.warmup_steps=2",
    "train.grad_clip=0.5", "train.log_every=1", "comm.backend=gloo", "comm.timeout_s=30",
    "parallel.min_stages=2",
]


@pytest.fixture(scope="module")
def reference():
    return reference_run(JOB)


def run_job(tmp_path, *, nodes, faults="", fault_tolerance=1, extra=(), actions=None, timeout=200):
    job = LocalJob(TINY, [*JOB, f"fault_tolerance.f={fault_tolerance}", *extra], nodes=nodes,
                   out_dir=tmp_path, faults=faults, log=lambda message: None)
    result = job.run(timeout, actions=actions)
    assert result.outcome == "ok", f"{result.outcome}\n{job.logs()}"
    return job, result


def commits(tmp_path) -> dict[str, list[CommitEntry]]:
    return read_logs(tmp_path, COMMITS, CommitEntry)


def check_against_reference(tmp_path, reference, job, steps=STEPS):
    logs = commits(tmp_path)
    done = set()
    for worker, entries in logs.items():
        if not entries:  # started, never planned in (a joiner still starting as the job ended)
            continue
        iterations = [e.step for e in entries]
        # Exactly once per worker: consecutive from where it started, never repeated.
        assert iterations == list(range(iterations[0], iterations[0] + len(iterations))), \
            f"worker {worker} committed {iterations}\n{job.logs()}"
        for e in entries:
            expected = reference.losses[e.step]
            assert abs(e.loss - expected) < 1e-9, (worker, e, expected)
        done.update(iterations)
    assert done == set(range(steps)), f"iterations committed: {sorted(done)}"
    assert_final_parameters(tmp_path / "final", reference)
    assert not list(tmp_path.glob("checkpoint*")), "no checkpoint may be involved"
    return logs


PHASES = {
    # phase: the fault, on node3 (pipeline 1, last stage) in iteration 2
    "forward": "node3.0:forward@2#3",
    "backward": "node3.0:backward@2#2",
    "gradient sync": "node3.0:sync@2",
    "before the commit": "node3.0:commit@2",
    "just after the commit": "node3.0:committed@2",
    "optimizer step": "node3.0:step@2",
}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("phase", cases_with_slow(PHASES, {"forward", "backward", "gradient sync", "just after the commit"}))
def test_rank_killed_in_every_phase_recovers_in_place(phase, reference, tmp_path):
    job, result = run_job(tmp_path, nodes=4, faults=PHASES[phase])
    logs = check_against_reference(tmp_path, reference, job)
    (event,) = result.controller.events
    assert event.failed == ("node3.0",)
    # Node 3 dies in iteration 2. Before its commit nobody can step 2: the job resumes at
    # 2. After it, the others stepped 2 as well: the job resumes at 3.
    after_commit = phase in ("just after the commit", "optimizer step")
    assert event.first_iteration == (3 if after_commit else 2)
    assert [e.step for e in logs["node3.0"]] == [0, 1]  # it never logged 2
    # The broken pipeline (node2 alone) is below n0 = 2: the three survivors merge into
    # one pipeline of three stages, re-cutting the layers, so state moves.
    assert event.plan_shape == (3,) and event.transfers > 0


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_commit_lost_on_one_worker_is_rolled_forward(reference, tmp_path):
    """node1's commit all-reduce fails on it alone after the others completed: they step
    iteration 3, it holds synced gradients; the rule rolls it forward (no re-run)."""
    job, result = run_job(tmp_path, nodes=4, faults="node1.0:committed@3!error")
    logs = check_against_reference(tmp_path, reference, job)
    (event,) = result.controller.events
    assert event.failed == () and event.rolled_forward == 3 and event.first_iteration == 4
    rolled = [e for e in logs["node1.0"] if e.rolled_forward]
    assert [e.step for e in rolled] == [3]


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_optimizer_step_failing_part_way_leaves_the_job(reference, tmp_path):
    """node1's optimizer step of iteration 3 raises after its gradients were clipped in
    place: its layers hold neither step 2 nor step 3. Rolled forward, it would clip them
    twice and its replicas would drift apart; it leaves the job instead, and its layers
    come from their replicas."""
    job, result = run_job(tmp_path, nodes=4, faults="node1.0:step@3!error")
    logs = check_against_reference(tmp_path, reference, job)
    (event,) = result.controller.events
    assert event.failed == ("node1.0",) and event.rolled_forward is None and event.first_iteration == 4
    assert [e.step for e in logs["node1.0"]] == [0, 1, 2]
    assert job.processes[("node1", 0)].returncode == EXIT_TORN_STEP


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_failure_during_reconfiguration(reference, tmp_path):
    """node3 dies in iteration 2; while the survivors copy layers for epoch 1, node2 dies
    in the middle of its transfer. Epoch 2 is planned from what the two left hold."""
    job, result = run_job(tmp_path, nodes=4, faults="node3.0:backward@2,node2.0:transfer@2")
    check_against_reference(tmp_path, reference, job)
    assert [e.failed for e in result.controller.events] == [("node3.0",), ("node2.0",)]


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_simultaneous_failures_with_three_replicas(reference, tmp_path):
    """f = 2: three pipelines of two stages; node1 and node3 (the last stage of two
    pipelines) die in the same iteration. Only node5 still holds layers 3-5."""
    job, result = run_job(tmp_path, nodes=6, fault_tolerance=2,
                          faults="node1.0:forward@2#2,node3.0:forward@2#2")
    assert [len(p.stages) for p in job.initial_plan().pipelines] == [2, 2, 2]
    check_against_reference(tmp_path, reference, job)
    assert [e.failed for e in result.controller.events] in (
        [("node1.0", "node3.0")], [("node1.0",), ("node3.0",)], [("node3.0",), ("node1.0",)])
    assert result.controller.events[-1].plan_shape == (2, 2)


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_pipeline_left_too_small_borrows_a_node(reference, tmp_path):
    """Five nodes run pipelines of 3 and 2 stages (n0 = 2). node4 dies: its pipeline is
    down to one node, below n0. The four survivors regroup into two pipelines of two."""
    job, result = run_job(tmp_path, nodes=5, faults="node4.0:backward@1#3")
    assert [len(p.stages) for p in job.initial_plan().pipelines] == [3, 2]
    check_against_reference(tmp_path, reference, job)
    (event,) = result.controller.events
    assert event.failed == ("node4.0",) and event.plan_shape == (2, 2)


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_node_joining_mid_run_receives_its_layers(reference, tmp_path):
    """A fifth node starts after iteration 1 committed; the job stops at an iteration
    boundary (no failure, nothing re-run) and the newcomer receives its layers."""
    added = []
    # An iteration takes ~50 ms: the remaining four could end before the newcomer has
    # started (it is planned in once started: imports, data) on a busy machine. node0
    # dawdles 10 s in iteration 2 (a straggler: nothing fails) to hold the window open.
    straggler = "node0.0:commit@2!slow=10"

    def add_after_iteration_1(job, elapsed):
        log = tmp_path / "commits-node0.0.jsonl"
        if not added and log.exists() and len(log.read_text().splitlines()) >= 2:
            added.append(job.add_node())

    job, result = run_job(tmp_path, nodes=4, faults=straggler, actions=add_after_iteration_1)
    logs = check_against_reference(tmp_path, reference, job)
    (event,) = result.controller.events
    assert event.reason == "join" and event.joined == ("node4.0",) and event.failed == ()
    assert event.transfers > 0
    assert len(event.plan_shape) == 2 and sum(event.plan_shape) == 5
    joiner = [e.step for e in logs["node4.0"]]
    assert joiner and joiner[0] == event.first_iteration >= 2 and joiner[-1] == STEPS - 1


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_kill_and_a_join_recompile_no_block(reference, tmp_path):
    """Compiled blocks (`train.compile`): node3 is killed in iteration 2, and a fifth node
    joins once the survivors have committed iteration 3. The losses and the final
    parameters are the reference's (compilation is never an exactness choice), and every
    worker's process compiled as many graphs by its last commit as by its first: the
    survivors, which re-built their stages over other layers twice, and the joiner alike,
    which is what a run without faults compiles."""
    added = []
    straggler = "node0.0:commit@4!slow=10"  # holds the window open for the joiner

    def add_after_iteration_3(job, elapsed):
        log = tmp_path / "commits-node0.0.jsonl"
        if not added and log.exists() and len(log.read_text().splitlines()) >= 4:
            added.append(job.add_node())

    job, result = run_job(tmp_path, nodes=4, faults=f"node3.0:commit@2,{straggler}",
                          extra=["train.compile=true"], actions=add_after_iteration_3)
    logs = check_against_reference(tmp_path, reference, job)
    assert [e.reason for e in result.controller.events] == ["failure", "join"], result.controller.events
    counts = {worker: {e.compiled_graphs for e in entries} for worker, entries in logs.items() if entries}
    assert "node4.0" in counts and len(counts) == 5, counts
    assert all(len(c) == 1 for c in counts.values()), counts  # no worker compiled after its first commit
    assert len(set.union(*counts.values())) == 1 and min(set.union(*counts.values())) >= 1, counts


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_tensor_parallel_blocks_compiled_once_through_a_re_cut(reference, tmp_path):
    """tp = 2 with compiled blocks: each epoch has a new tensor-parallel group, which a
    graph calling its collectives would be guarded on; the collectives run outside the
    compiled pieces (`tensor_parallel._copy_to_tp`), so the re-cut after node3.0's death
    compiles nothing (before that, every worker compiled its blocks again in epoch 1)."""
    job = LocalJob(TINY, [*JOB, "fault_tolerance.f=1", "parallel.tp=2", "train.compile=true"], nodes=4,
                   gpus_per_node=2, out_dir=tmp_path, faults="node3.0:backward@2#2", log=lambda message: None)
    result = job.run(350)
    assert result.outcome == "ok", job.logs()
    logs = check_against_reference(tmp_path, reference, job)
    counts = {worker: {e.compiled_graphs for e in entries} for worker, entries in logs.items() if entries}
    survivors = [w for w in counts if not w.startswith("node3")]
    assert all(max(e.epoch for e in logs[w]) == 1 for w in survivors), logs
    assert all(len(c) == 1 for c in counts.values()) and len(set.union(*counts.values())) == 1, counts


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_more_failures_than_replicas_resumes_from_the_last_checkpoint(reference, tmp_path):
    """Both replicas of layers 3-5 (node1 and node3) die in iteration 4. The job goes back
    to its newest complete checkpoint, of iteration 2 (checkpoint.every=3), and re-runs
    exactly the steps committed since: iteration 3, no more."""
    job, result = run_job(tmp_path, nodes=4, extra=["checkpoint.every=3", "checkpoint.memory_every=0"],
                          faults="node1.0:forward@4#2,node3.0:forward@4#2")
    logs = commits(tmp_path)
    (event,) = result.controller.events
    assert sorted(event.failed) == ["node1.0", "node3.0"] and event.restored == 2
    for worker in ("node0.0", "node2.0"):
        iterations = [e.step for e in logs[worker]]
        assert iterations == [0, 1, 2, 3, 3, 4, 5], iterations  # 3 lost and run again
        for e in logs[worker]:
            assert abs(e.loss - reference.losses[e.step]) < 1e-9, (worker, e)
    assert_final_parameters(tmp_path / "final", reference)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_every_replica_of_a_stage_lost_is_restored_from_peer_memory(reference, tmp_path):
    """f+1 nodes at once: node1 and node3, which hold every replica of layers 3-5, are
    SIGKILLed together once step 3 is committed. With peer snapshots on (the default:
    every step, kept on two other nodes: here node0 and node2) the job goes back to the
    newest step whose snapshot node0 and node2 keep whole (the last committed one, or
    the one before it if the kills cut its exchange short), never to the disk: every
    checkpoint file is made unreadable as soon as it is written (checkpoints are of steps
    2 and 5, never newer than the snapshot, so a restore from one would be a wrong choice
    as well as a failed read). The steps after the snapshot's are trained once more, with
    the reference's losses."""
    poisoned: set = set()

    def actions(job, elapsed):
        for path in (tmp_path / "checkpoints").glob("step-*/epoch-*/*.pt"):
            if path not in poisoned:
                path.write_bytes(b"unreadable: a restore must not need the disk")
                poisoned.add(path)

    # Both die in their first forward after step 3 committed (killed from outside once
    # step 3 was seen, a loaded machine let them reach the checkpoint of step 5 first).
    # Every worker pauses 0.2 s before each commit: a snapshot exchange runs at idle
    # priority, and with four workers busy on two cores it could lag several of these
    # millisecond steps, leaving the newest whole snapshot older than the checkpoint of
    # step 2, which the controller then rightly prefers; the pause lets each round land
    # before the next commit, as on a machine with cores to spare.
    killed = [3]
    pauses = ",".join(f"node{i}.0:commit@*!slow=0.2" for i in range(4))
    job, result = run_job(tmp_path, nodes=4, extra=["checkpoint.every=3"], actions=actions,
                          faults=f"node1.0:forward@4#1,node3.0:forward@4#1,{pauses}")
    (event,) = result.controller.events
    assert sorted(event.failed) == ["node1.0", "node3.0"]
    assert event.source == "memory" and event.restored is None, job.logs()
    newest = event.snapshot + event.rerun  # the last step committed before the kills
    assert event.rerun <= 1 and newest >= killed[0] and event.first_iteration == event.snapshot + 1
    assert poisoned, "the checkpoint of step 2 was written (there was a disk to fall back to)"
    logs = commits(tmp_path)
    for worker in ("node0.0", "node2.0"):
        iterations = [e.step for e in logs[worker]]
        assert iterations == [*range(newest + 1), *range(event.snapshot + 1, STEPS)], iterations
        for e in logs[worker]:
            assert abs(e.loss - reference.losses[e.step]) < 1e-9, (worker, e)
    assert_final_parameters(tmp_path / "final", reference)


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_more_failures_than_replicas_without_checkpoint_fails_clearly(tmp_path):
    job = LocalJob(TINY, [*JOB, "fault_tolerance.f=1", "checkpoint.memory_every=0"], nodes=4, out_dir=tmp_path,
                   faults="node1.0:forward@2#2,node3.0:forward@2#2", log=lambda message: None)
    result = job.run(200)
    assert result.outcome.startswith("failed: no surviving worker holds layer shards")
    assert "checkpoint.every" in result.outcome


def audits(tmp_path) -> list[dict]:
    return [entry for entries in read_logs(tmp_path, AUDIT, AuditEntry).values() for entry in entries]


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_replica_audit_repairs_silent_corruption_from_the_majority(reference, tmp_path):
    """Three replicas (f = 2). A bit of node2's copy of layer 0 flips after step 2; the
    audit after step 3 finds node2 (rank 2) against ranks 0 and 4, and repairs it. The
    corruption changed that pipeline's step-3 gradient, so the final state differs from
    the reference a little, but all replicas agree again and the next audit is clean."""
    job = LocalJob(TINY, [*JOB, "fault_tolerance.f=2", "audit.every=2",
                          "audit.repair=true"], nodes=6, out_dir=tmp_path,
                   corrupt="node2.0@2", log=lambda message: None)
    result = job.run(200)
    assert result.outcome == "ok", job.logs()
    found = audits(tmp_path)
    assert found, job.logs()
    assert {(a.step, a.layer) for a in found} == {(3, 0)}
    assert all(a.minority == (2,) and a.majority == (0, 4) and a.repaired for a in found)
    assert "replica audit after step 3" in job.logs()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_replica_audit_reports_a_tie_loudly(tmp_path):
    """Two replicas disagree: there is no majority; the audit names the layer and ranks."""
    job = LocalJob(TINY, [*JOB, "fault_tolerance.f=1", "audit.every=2"], nodes=4,
                   out_dir=tmp_path, corrupt="node2.0@0", log=lambda message: None)
    result = job.run(200)
    assert result.outcome == "ok", job.logs()
    first = audits(tmp_path)[0]
    assert (first.step, first.layer, first.majority, first.minority) == (1, 0, (), (0, 2))
    assert not first.repaired


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_hung_worker_is_detected_within_the_timeout(reference, tmp_path):
    """node3 stops (SIGSTOP) in a backward: no socket closes. Its peers' collectives time
    out after comm.timeout_s; the controller waits that long again for node3's status,
    then kills it, and the job goes on without it."""
    timeout_s, status_timeout_s = 4, 6
    job = LocalJob(TINY, [*JOB, "fault_tolerance.f=1", f"comm.timeout_s={timeout_s}"],
                   nodes=4, out_dir=tmp_path, faults="node3.0:backward@2!hang",
                   status_timeout_s=status_timeout_s, log=lambda message: None)
    result = job.run(200)
    assert result.outcome == "ok", job.logs()
    check_against_reference(tmp_path, reference, job)
    (event,) = result.controller.events
    assert event.failed == ("node3.0",)
    hung_at = max(e.time for e in commits(tmp_path)["node3.0"])  # its last commit, before the hang
    assert event.statuses_s - hung_at < timeout_s + status_timeout_s + 5


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_tensor_parallel_shards_move_shard_by_shard(reference, tmp_path):
    """Nodes of two workers (tp = 2), two pipelines of two stages: node3.0 dies, which
    takes node3 out (a stage needs the whole node; node3.1 is left idle), and the three
    nodes' re-cut moves tp shards between workers of the same tp rank."""
    job = LocalJob(TINY, [*JOB, "fault_tolerance.f=1", "parallel.tp=2"], nodes=4,
                   gpus_per_node=2, out_dir=tmp_path, faults="node3.0:backward@2#2",
                   log=lambda message: None)
    result = job.run(250)
    assert result.outcome == "ok", job.logs()
    check_against_reference(tmp_path, reference, job)
    (event,) = result.controller.events
    assert event.failed == ("node3.0",) and event.plan_shape == (3,) and event.transfers > 0
