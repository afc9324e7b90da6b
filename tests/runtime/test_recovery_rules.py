"""The decisions recovery is made of, one process: the exactly-once rule, what travels
between the control plane and workers, fault specs, audit verdicts, checkpoint files,
and which worker sends which layer."""
from __future__ import annotations

import json
import time

import pytest
import torch

from planaria.runtime.contract.checkpoint_layout import complete_checkpoints, prune, step_dir, write_manifest
from planaria.runtime.contract.epochs import EpochRecord
from planaria.runtime.contract.exactly_once import (INCOMPLETE, SYNCED, CommitRecord, InconsistentStatuses,
                                           WorkerStatus, resolve)
from planaria.runtime.state.audit import _compare
from planaria.runtime.worker.fault_injection import Fault, FaultInjector, flip_a_bit, parse_faults
from planaria.templates.layout import plan_from_layout
from planaria.templates.plan import Transfer, holders, missing_from, transfers_from


def status(node, last, state=INCOMPLETE, loss=1.0):
    commit = CommitRecord(last, loss, 0.5) if last >= 0 else None
    return WorkerStatus(worker=(node, 0), last_stepped=last, state=state, commit=commit)


# ---- the exactly-once rule -----------------------------------------------------------


def test_nobody_stepped_the_interrupted_iteration_so_it_runs_again():
    res = resolve([status("a", 4, SYNCED), status("b", 4, INCOMPLETE)])
    assert res.first_iteration == 5 and res.roll_forward is None


def test_one_worker_stepped_so_the_synced_ones_roll_forward_with_its_commit():
    res = resolve([status("a", 5, loss=2.5), status("b", 4, SYNCED), status("c", 5, loss=2.5)])
    assert res.first_iteration == 6
    assert res.roll_forward == CommitRecord(5, 2.5, 0.5)


def test_statuses_that_contradict_the_commit_protocol_are_refused():
    # b never finished its gradient sync of 5, yet a stepped 5: impossible.
    with pytest.raises(InconsistentStatuses, match="a step was committed without it"):
        resolve([status("a", 5), status("b", 4, INCOMPLETE)])
    with pytest.raises(InconsistentStatuses, match="last stepped iteration 3"):
        resolve([status("a", 5), status("b", 3, SYNCED)])
    with pytest.raises(InconsistentStatuses, match="no survivor"):
        resolve([])


def test_before_the_first_step():
    res = resolve([status("a", -1), status("b", -1, SYNCED)])
    assert res.first_iteration == 0 and res.roll_forward is None


def test_status_round_trips_through_json_and_checks_itself():
    s = WorkerStatus(worker=("node1", 0), last_stepped=3, state=SYNCED, commit=CommitRecord(3, 1.0, 2.0),
                     holds=((0, 0), (1, 0)), finished=False)
    assert WorkerStatus.from_json(s.to_json()) == s
    with pytest.raises(ValueError, match="state must be one of"):
        WorkerStatus(worker=("n", 0), last_stepped=0, state="done")
    with pytest.raises(ValueError, match="commit record of 2"):
        WorkerStatus(worker=("n", 0), last_stepped=3, state=SYNCED, commit=CommitRecord(2, 1.0, 1.0))


# ---- what the control plane publishes --------------------------------------------------


LAYOUT = dict(n_blocks=4, global_batch=8, micro_batch=1, tp=1, schedule="1f1b", virtual_stages=1)


def two_pipelines():
    """node0 (layers 0-2) and node1 (3-5); node2 (0-2) and node3 (3-5)."""
    return plan_from_layout([[2, 2], [2, 2]], **LAYOUT)


def test_epoch_record_round_trips_through_json():
    plan = two_pipelines()
    record = EpochRecord(plan, roll_forward=CommitRecord(2, 3.0, 0.1),
                         transfers=(Transfer(1, 0, ("node0", 0), ("node3", 0)),), restore="/ckpt/step-2")
    again = EpochRecord.from_json(record.to_json())
    assert again == record


def test_transfers_from_what_survivors_hold():
    plan = two_pipelines()
    held = holders(plan)
    # node3 held pipeline 1's last stage; it is gone and a new plan moves node2 to those layers.
    for key in held:
        held[key].discard(("node3", 0))
    new = plan_from_layout([[1, 2, 1]], **LAYOUT)  # node0: 0-1, node1: 2-3, node2: 4-5
    assert missing_from(held, new) == []
    moves = transfers_from(held, new)
    assert {(t.layer, t.dst) for t in moves} == {(2, ("node1", 0)), (4, ("node2", 0)), (5, ("node2", 0))}
    assert {t.src for t in moves if t.layer == 2} <= {("node0", 0), ("node2", 0)}
    for t in moves:
        assert t.src in held[(t.layer, t.tp_rank)] and t.dst not in held[(t.layer, t.tp_rank)]
    # every layer of the new plan is held or received by each worker that runs it
    for (layer, tp), workers in holders(new).items():
        for w in workers:
            assert w in held.get((layer, tp), set()) or any(
                t.layer == layer and t.dst == w for t in moves), (layer, w)


def test_layers_nobody_holds_are_missing():
    plan = two_pipelines()
    held = {k: v - {("node1", 0), ("node3", 0)} for k, v in holders(plan).items()}
    assert [layer for layer, _ in missing_from(held, plan)] == [3, 4, 5]


# ---- fault specs ----------------------------------------------------------------------


def test_fault_specs():
    assert parse_faults("node1.0:backward@3#2, node2.0:transfer@*!hang,node0.0:committed@1!error") == [
        Fault("node1.0", "backward", 3, 2, "kill"), Fault("node2.0", "transfer", None, 1, "hang"),
        Fault("node0.0", "committed", 1, 1, "error")]
    assert parse_faults("node0.0:step@*!slow=0.25") == [Fault("node0.0", "step", None, 1, "slow", 0.25)]
    assert parse_faults("") == []
    for bad in ("node1.0:lunch@3", "node1.0:forward", "node1.0:forward@x", "forward@1",
                "node0.0:step@*!slow=", "node0.0:step@*!slow=fast"):
        with pytest.raises(ValueError, match="expected NODE.LOCAL:PHASE@ITERATION"):
            parse_faults(bad)


def test_slow_fault_delays_every_matching_iteration():
    injector = FaultInjector("node0.0", parse_faults("node0.0:step@*!slow=0.05"))
    start = time.monotonic()
    for iteration in range(4):
        injector("step", iteration)
    assert time.monotonic() - start >= 0.2  # four iterations, each 0.05 s slower


def test_flip_a_bit_changes_exactly_one_bit():
    t = torch.tensor([1.0, 2.0], dtype=torch.float64)
    before = t.clone()
    flip_a_bit(t)
    assert t[1] == before[1] and t[0] != before[0]
    assert (t.view(torch.int64) ^ before.view(torch.int64)).tolist() == [1, 0]


# ---- audit verdicts -------------------------------------------------------------------


def test_audit_verdicts():
    assert _compare(0, 0, (0, 2, 4), [(1, 2), (1, 2), (1, 2)]) is None
    m = _compare(3, 1, (0, 2, 4), [(1, 2), (9, 9), (1, 2)])
    assert (m.majority, m.minority) == ((0, 4), (2,))
    tie = _compare(3, 0, (0, 2), [(1, 2), (9, 9)])
    assert tie.majority == () and tie.minority == (0, 2) and "no majority" in tie.describe()


# ---- checkpoint files -----------------------------------------------------------------


def test_only_checkpoints_with_a_manifest_count_and_pruning_keeps_the_newest(tmp_path):
    for k in (1, 3, 5):
        step_dir(tmp_path, k).mkdir(parents=True)
        write_manifest(tmp_path, CommitRecord(k, 1.0, 1.0), num_layers=6, tp=1)
    step_dir(tmp_path, 7).mkdir()  # files but no manifest: incomplete
    assert [k for k, _ in complete_checkpoints(tmp_path)] == [1, 3, 5]
    prune(tmp_path, keep=2)
    assert [k for k, _ in complete_checkpoints(tmp_path)] == [3, 5]
    assert step_dir(tmp_path, 7).exists()
    prune(tmp_path, keep=2, after=3)  # the job went back to 3: later ones will be rewritten
    assert [k for k, _ in complete_checkpoints(tmp_path)] == [3]
    assert not step_dir(tmp_path, 7).exists()
    assert json.loads((step_dir(tmp_path, 3) / "manifest.json").read_text())["iteration"] == 3


def test_a_rendezvous_is_given_up_when_the_control_plane_abandons_the_epoch():
    """A peer that died before registering would hold the others in the rendezvous until
    the store's timeout; once the controller asks the epoch to stop, the wait ends."""
    from datetime import timedelta

    import torch.distributed as dist

    from planaria.runtime.worker.coordination import StoreCoordinator

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=300))
    rendezvous = StoreCoordinator(store, ("node0", 0)).rendezvous_store(1)  # kept by the coordinator
    rendezvous.set("present", "1")
    assert rendezvous.get("present") == b"1"
    store.set("epoch/1/reconfigure", "failure")
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="epoch 1 was abandoned"):
        rendezvous.get("rank-of-a-dead-peer")
    assert time.monotonic() - start < 5


def test_a_leaving_worker_waits_for_the_next_epochs_first_step_and_no_longer():
    """`wait_until_trained`: True once the epoch committed a step; False, without waiting
    out its limit, once the job moved past the epoch or ended; False at the limit
    otherwise."""
    import threading

    import torch.distributed as dist

    from planaria.runtime.contract import keys
    from planaria.runtime.worker.coordination import StoreCoordinator

    store = dist.HashStore()
    coordinator = StoreCoordinator(store, ("node2", 0))
    threading.Timer(0.2, coordinator.mark_trained, args=(3,)).start()
    assert coordinator.wait_until_trained(3, timeout_s=30)
    store.set(keys.EPOCH, "5")  # epoch 4 failed before its first step; the job is in 5
    start = time.monotonic()
    assert not coordinator.wait_until_trained(4, timeout_s=30)
    assert time.monotonic() - start < 5
    assert not coordinator.wait_until_trained(5, timeout_s=0.2)
    store.set(keys.DONE, "ok")  # the job ended (it had no step left for epoch 5)
    start = time.monotonic()
    assert not coordinator.wait_until_trained(5, timeout_s=30)
    assert time.monotonic() - start < 5
