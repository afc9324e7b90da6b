"""A cut is not a death (`elastic/cut_wait.py`): layers held only by nodes out of reach
but maybe alive are waited for, within a limit, before the job trains steps again from
older state; a node found dead is never waited for."""
from __future__ import annotations

import time

import torch.distributed as dist

from planaria.elastic.controller import Controller
from planaria.runtime.config.loading import load_config
from planaria.runtime.contract import keys
from planaria.runtime.contract.exactly_once import INCOMPLETE, CommitRecord, SnapshotHeld, WorkerStatus
from planaria.runtime.planning.job_plans import build_planner, cost_model
from tests.launch import TINY

NODES = [f"node{i}" for i in range(6)]


def job(*, cut_wait_s: float = 60.0, gone: set[str] = frozenset(), views: dict | None = None):
    """Six one-worker nodes in three pipelines of two stages (f = 1), epoch 0 trained to
    step 5; every worker keeps a peer snapshot of the whole model at step 3."""
    cfg = load_config(TINY, ["fault_tolerance.f=1", "parallel.min_stages=2"])
    planner = build_planner(cfg, cost_model(cfg, hardware_name="h100", gpus_per_node=1))
    store, logs = dist.HashStore(), []
    controller = Controller(store, planner, total_steps=100, debounce_s=0, log=logs.append,
                            gone=lambda: set(gone), cut_wait_s=cut_wait_s, unreachable=lambda: views or {})
    workers = [(node, 0) for node in NODES]
    plan = controller.start(workers)
    store.set(keys.epoch_trained(0), "1")
    return controller, store, logs, plan


def report(store, plan, workers, last_stepped: int = 5) -> None:
    """What `workers` publish when epoch 0 stops after `last_stepped`: their stage's
    layers, and a peer snapshot of every layer at step 3."""
    every = tuple((layer, 0) for layer in range(plan.num_layers))
    for worker in workers:
        rank = plan.rank_of_worker()[worker]
        status = WorkerStatus(worker=worker, last_stepped=last_stepped, state=INCOMPLETE,
                              commit=CommitRecord(last_stepped, 1.0, 1.0),
                              holds=tuple((layer, 0) for layer in plan.layers_of(rank)),
                              snapshots=(SnapshotHeld(CommitRecord(3, 1.0, 1.0), epoch=0, shards=every),))
        store.set(keys.epoch_status(0, worker), status.to_json())


def second_stage_holders(plan) -> list[str]:
    """The nodes that hold the model's last layer (one pipeline stage's worth each)."""
    last = plan.num_layers - 1
    return sorted(w[0] for w, r in plan.rank_of_worker().items() if last in plan.layers_of(r))


def poll(controller, alive) -> str:
    return controller.poll(lambda: set(alive), kill=lambda worker: None)


def test_layers_held_only_by_nodes_out_of_etcd_are_waited_for_and_copied_when_they_come_back():
    """The three holders of the second stage are out: one killed (its probe refused:
    gone), two out of etcd and not found dead (cut off). The survivors' peer snapshots of
    step 3 would train steps 4 and 5 again: the job waits instead, and when the two come
    back and report, their layers of step 5 are copied and nothing is trained again."""
    _, _, _, plan = job()
    killed, *cut = second_stage_holders(plan)
    controller, store, logs, plan = job(gone={killed})
    survivors = [(n, 0) for n in NODES if n not in cut and n != killed]
    report(store, plan, survivors)
    for _ in range(3):
        assert poll(controller, survivors) == "running"
    assert controller.epoch == 0 and not store.check([keys.DONE])
    said = [line for line in logs if "out of reach but not known dead" in line]
    assert len(said) == 1 and all(node in said[0] for node in cut) and killed not in said[0], logs
    assert "rather than go back to step 3 (2 step(s) trained again)" in said[0]

    back = [(n, 0) for n in cut]
    report(store, plan, back)
    assert poll(controller, survivors + back) == "running"
    assert controller.epoch == 1, logs
    event = controller.events[-1]
    assert event.snapshot is None and event.restored is None and event.rerun == 0
    assert event.first_iteration == 6 and event.transfers > 0 and event.cut_wait_s is not None
    assert event.failed == (f"{killed}.0",)


def test_past_the_limit_the_job_goes_back_to_the_peer_snapshots():
    _, _, _, plan = job()
    killed, *cut = second_stage_holders(plan)
    controller, store, logs, plan = job(cut_wait_s=0.3, gone={killed})
    survivors = [(n, 0) for n in NODES if n not in cut and n != killed]
    report(store, plan, survivors)
    assert poll(controller, survivors) == "running" and controller.epoch == 0
    time.sleep(0.4)
    assert poll(controller, survivors) == "running"
    assert controller.epoch == 1
    event = controller.events[-1]
    assert event.snapshot == 3 and event.first_iteration == 4 and event.cut_wait_s is None
    assert any("did not come back within 0.3 s; the job will go back to step 3" in line for line in logs), logs


def test_nodes_found_dead_are_not_waited_for():
    """The same loss where every missing holder's agent refused a probe: peer snapshots at once."""
    _, _, _, plan = job()
    lost = second_stage_holders(plan)
    controller, store, logs, plan = job(gone=set(lost))
    survivors = [(n, 0) for n in NODES if n not in lost]
    report(store, plan, survivors)
    assert poll(controller, survivors) == "running"
    assert controller.epoch == 1 and controller.events[-1].snapshot == 3
    assert not any("out of reach" in line for line in logs), logs


def test_a_partition_whose_other_side_holds_layers_is_waited_for_and_no_step_is_trained_again():
    """Both sides alive and reporting, the second stage's holders across a cut from the
    first's (each side reports the other): neither side holds the whole model; rather
    than go back to the snapshots of step 3, the job waits for the cut to heal."""
    _, _, _, plan = job()
    other = second_stage_holders(plan)
    views: dict[str, list[str]] = {}
    controller, store, logs, plan = job(views=views)
    views.update({n: list(other) for n in NODES if n not in other})
    views.update({n: [m for m in NODES if m not in other] for n in other})
    workers = [(n, 0) for n in NODES]
    report(store, plan, workers)
    for _ in range(2):
        assert poll(controller, workers) == "running"
    assert controller.epoch == 0 and any("out of reach but not known dead" in line for line in logs), logs
    views.clear()  # the cut heals
    assert poll(controller, workers) == "running"
    assert controller.epoch == 1 and sorted(controller.plan.nodes()) == NODES
    event = controller.events[-1]
    assert event.snapshot is None and event.rerun == 0 and event.first_iteration == 6


def test_a_node_cut_off_from_every_other_is_not_waited_for_while_its_lease_runs():
    """node1 cut off the network, etcd included, before its lease lapsed: every other node
    reports it, its worker still shows alive but cannot report. The leader does not wait
    the status timeout for it: it plans without it at once (its layers have replicas)."""
    views: dict[str, list[str]] = {}
    controller, store, logs, plan = job(views=views)
    controller.status_timeout_s = 30.0
    views.update({n: ["node1"] for n in NODES if n != "node1"})
    workers = [(n, 0) for n in NODES]
    report(store, plan, [w for w in workers if w[0] != "node1"])
    started = time.monotonic()
    assert poll(controller, workers) == "running"  # node1.0 alive, silent
    assert time.monotonic() - started < 10, "waited for the cut-off node's status"
    assert controller.epoch == 1 and "node1" not in controller.plan.nodes()
    assert controller.events[-1].failed == ("node1.0",) and controller.events[-1].snapshot is None
