"""A new leader takes over a job that has completed and pruned checkpoints: it must not
try to complete them again (their directories are gone), and it goes on completing new
ones. Found by replaying the p3 trace: every leader after the first crashed on it."""
from __future__ import annotations

import dataclasses
import json

import torch.distributed as dist

from planaria.elastic.controller import Controller
from planaria.elastic.job_checkpoints import CheckpointPolicy
from planaria.runtime.config.loading import load_config
from planaria.runtime.contract.checkpoint_layout import (complete_checkpoints, epoch_dir, read_checkpoint_manifest,
                                                         shard_dir, shard_filename, step_dir, write_manifest)
from planaria.runtime.contract.exactly_once import CommitRecord
from planaria.runtime.planning.job_plans import build_planner, cost_model
from tests.launch import TINY


def write_shards(policy, k: int, plan, *, epoch: int = 0, leave_out: int = 0) -> None:
    """The shard files of checkpoint `k`, as the workers of `epoch` write them (all but `leave_out`)."""
    directory = epoch_dir(policy.directory, k, epoch)
    directory.mkdir(parents=True, exist_ok=True)
    names = [shard_filename(layer, t) for layer in range(plan.num_layers) for t in range(plan.tp)]
    for name in names[:len(names) - leave_out]:
        (directory / name).write_bytes(b"shard")


def complete_in_store(store, k: int, shards: int, epoch: int = 0) -> None:
    store.add(f"checkpoint/{k}/{epoch}/shards", shards)
    store.set(f"checkpoint/{k}/{epoch}/commit", json.dumps({"iteration": k, "loss": 1.0, "grad_norm": 1.0}))


def started_job(tmp_path):
    """A store, a checkpoint policy (every 10, keep 2), and a controller that published
    epoch 0 for four nodes."""
    cfg = load_config(TINY, ["fault_tolerance.f=1"])
    planner = build_planner(cfg, cost_model(cfg, hardware_name="h100", gpus_per_node=1))
    store = dist.HashStore()
    policy = CheckpointPolicy(tmp_path / "ckpt", every=10, keep=2)
    controller = Controller(store, planner, total_steps=100, checkpoints=policy, log=lambda m: None)
    return store, policy, controller, controller.start([(f"node{i}", 0) for i in range(4)])


def test_a_new_leader_skips_checkpoints_an_earlier_one_completed_and_pruned(tmp_path):
    cfg = load_config(TINY, ["fault_tolerance.f=1"])
    planner = build_planner(cfg, cost_model(cfg, hardware_name="h100", gpus_per_node=1))
    store = dist.HashStore()
    policy = CheckpointPolicy(tmp_path / "ckpt", every=10, keep=2)
    logs: list[str] = []
    first = Controller(store, planner, total_steps=100, checkpoints=policy, log=logs.append)
    plan = first.start([(f"node{i}", 0) for i in range(4)])
    shards = plan.num_layers * plan.tp
    for k in (9, 19, 29):  # the workers wrote every shard of three checkpoints
        write_shards(policy, k, plan)
        complete_in_store(store, k, shards)
    first._complete_checkpoints()
    assert [i for i, _ in complete_checkpoints(policy.directory)] == [19, 29]  # 9 was pruned

    second = Controller(store, planner, total_steps=100, checkpoints=policy, log=logs.append)
    assert second.resume()
    second._complete_checkpoints()  # 9's directory is gone: nothing to write there
    assert not step_dir(policy.directory, 9).exists()
    write_shards(policy, 39, plan)
    complete_in_store(store, 39, shards)
    second._complete_checkpoints()
    assert [i for i, _ in complete_checkpoints(policy.directory)] == [29, 39]


def test_a_checkpoint_a_failure_left_incomplete_does_not_hold_back_later_ones(tmp_path):
    """A worker died after iteration 9's step, before writing its shards of checkpoint 9;
    the job went on from iteration 10 in a new epoch and wrote checkpoint 19 whole. 19
    counts (it once waited for 9 forever: no manifest was written again in that run)."""
    store, policy, controller, plan = started_job(tmp_path)
    shards = plan.num_layers * plan.tp
    write_shards(policy, 9, plan, leave_out=1)
    store.add("checkpoint/9/0/shards", shards - 1)  # one shard never came
    controller._complete_checkpoints()
    assert complete_checkpoints(policy.directory) == []  # epoch 0 may still write it

    controller.plan = dataclasses.replace(plan, epoch=1, first_iteration=10)  # as after the failure
    controller.epoch = 1
    for k in (19, 29):
        write_shards(policy, k, plan, epoch=1)
        complete_in_store(store, k, shards, epoch=1)
        controller._complete_checkpoints()
        assert complete_checkpoints(policy.directory)[-1][0] == k
    assert controller.checkpoints.completed == [19, 29]


def test_a_shard_counted_twice_does_not_complete_a_checkpoint_whose_file_is_missing(tmp_path):
    """A worker's report, retried after its reply was lost, counted its shards twice: the
    count says complete while one file is not there. No manifest until it is."""
    store, policy, controller, plan = started_job(tmp_path)
    write_shards(policy, 9, plan, leave_out=1)
    complete_in_store(store, 9, plan.num_layers * plan.tp)
    controller._complete_checkpoints()
    assert complete_checkpoints(policy.directory) == []
    write_shards(policy, 9, plan)
    controller._complete_checkpoints()
    assert [k for k, _ in complete_checkpoints(policy.directory)] == [9]


def test_a_job_started_over_another_models_checkpoints_ends_with_a_message(tmp_path):
    """A new job resumes from the newest checkpoint in its directory; one of another model
    (a reused output.dir) must not be loaded into it."""
    cfg = load_config(TINY, ["fault_tolerance.f=1"])
    planner = build_planner(cfg, cost_model(cfg, hardware_name="h100", gpus_per_node=1))
    policy = CheckpointPolicy(tmp_path / "ckpt", every=10, keep=2)
    plan = planner.instantiate(4, node_ids=[f"node{i}" for i in range(4)]).plan
    write_shards(policy, 9, plan)
    write_manifest(policy.directory, CommitRecord(9, 1.0, 1.0), plan.num_layers + 3, plan.tp)
    controller = Controller(dist.HashStore(), planner, total_steps=100, checkpoints=policy, log=lambda m: None)
    controller.start([(f"node{i}", 0) for i in range(4)])
    assert controller.outcome.startswith("failed: the checkpoint") and "its own checkpoint.dir" in controller.outcome
    assert controller.poll(lambda: set(), kill=lambda w: None) == "failed"


def test_shards_of_an_epoch_the_job_went_on_without_are_never_counted_nor_named(tmp_path):
    """Fencing: epoch 0's workers are replaced at iteration 5 (a node cut off, its lease
    expired). One of them, not knowing it, writes every shard of checkpoint 9 and reports
    them: nothing completes. Epoch 1's workers write theirs: the manifest names epoch 1,
    reading the checkpoint reads epoch 1's files, and the late writer's are removed."""
    store, policy, controller, plan = started_job(tmp_path)
    shards = plan.num_layers * plan.tp
    controller.plan, controller.epoch = dataclasses.replace(plan, epoch=1, first_iteration=5), 1
    write_shards(policy, 9, plan, epoch=0)  # the late writer: whole, and reported
    complete_in_store(store, 9, shards, epoch=0)
    controller._complete_checkpoints()
    assert complete_checkpoints(policy.directory) == []

    write_shards(policy, 9, plan, epoch=1, leave_out=1)
    complete_in_store(store, 9, shards - 1, epoch=1)
    controller._complete_checkpoints()
    assert complete_checkpoints(policy.directory) == []  # epoch 0's file does not stand in for the missing one

    write_shards(policy, 9, plan, epoch=1)
    complete_in_store(store, 9, 1, epoch=1)
    controller._complete_checkpoints()
    ((k, path),) = complete_checkpoints(policy.directory)
    assert k == 9 and read_checkpoint_manifest(path).epoch == 1
    assert shard_dir(path) == epoch_dir(policy.directory, 9, 1)
    assert not epoch_dir(policy.directory, 9, 0).exists()


def test_a_lost_layer_comes_from_the_newest_whole_peer_snapshot_of_the_jobs_own_history(tmp_path):
    """Both nodes of the second stages die after step 9. The survivors keep peer
    snapshots: step 8 whole (their own first stages and copies of the second ones), step
    9 with a shard missing (its exchange was cut), and a step 9 of a timeline the job
    left (an epoch that never committed it). The controller goes back to step 8, with
    transfers from the keepers; a disk checkpoint newer than every whole snapshot wins."""
    from planaria.runtime.contract.exactly_once import SnapshotHeld, WorkerStatus

    cfg = load_config(TINY, ["fault_tolerance.f=1", "parallel.min_stages=2"])
    planner = build_planner(cfg, cost_model(cfg, hardware_name="h100", gpus_per_node=1))
    store = dist.HashStore()
    policy = CheckpointPolicy(tmp_path / "ckpt", every=10, keep=2)
    controller = Controller(store, planner, total_steps=100, checkpoints=policy, log=lambda m: None)
    plan = controller.start([(f"node{i}", 0) for i in range(4)])
    assert all(len(p.stages) == 2 for p in plan.pipelines) and len(plan.pipelines) == 2
    survivors = sorted(p.stages[0].node for p in plan.pipelines)
    rank = plan.rank_of_worker()
    every_shard = tuple((layer, 0) for layer in range(plan.num_layers))

    def held(step: int, shards, epoch: int = 0) -> SnapshotHeld:
        return SnapshotHeld(commit=CommitRecord(step, 1.0 + step, 0.5), epoch=epoch, shards=tuple(shards))

    statuses = {}
    for i, node in enumerate(survivors):
        own = tuple((layer, 0) for layer in plan.layers_of(rank[(node, 0)]))
        snapshots = (held(8, every_shard if i == 0 else own),  # whole: the first keeps copies of the rest
                     held(9, own),  # the exchange of 9 was cut: only their own shards
                     held(9, every_shard, epoch=3))  # another timeline's: never counts
        statuses[(node, 0)] = WorkerStatus(worker=(node, 0), last_stepped=9, state="incomplete",
                                           commit=CommitRecord(9, 10.0, 0.5), holds=own, snapshots=snapshots)
    choice, transfers, restore, snapshot, first = controller.epoch_planner.with_sources(survivors, statuses, 10,
                                                                                         controller.plan)
    assert restore is None and snapshot.step == 8 and snapshot.commit.loss == 9.0 and first == 9
    assert choice.plan.first_iteration == 9 and transfers
    keeps = {w: {tuple(s) for h in st.snapshots if h.step == 8 and h.epoch == 0 for s in h.shards}
             for w, st in statuses.items()}
    for t in transfers:  # every copy comes from a worker that keeps that shard of step 8
        assert (t.layer, t.tp_rank) in keeps[t.src] and (t.layer, t.tp_rank) not in keeps[t.dst]

    write_shards(policy, 9, plan)  # a checkpoint of step 9, newer than the snapshot: it wins
    complete_in_store(store, 9, plan.num_layers * plan.tp)
    controller._complete_checkpoints()
    choice, transfers, restore, snapshot, first = controller.epoch_planner.with_sources(survivors, statuses, 10,
                                                                                         controller.plan)
    assert snapshot is None and restore == step_dir(policy.directory, 9) and first == 10 and transfers == []
