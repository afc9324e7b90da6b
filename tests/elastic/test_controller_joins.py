"""Joins as the leader's controller sees them: a node the job cannot use (its batch has
too few microbatches for one more pipeline) waits instead of failing the job, and is
used once a node fails; a new worker is planned in only once it has announced itself
(its start-up over), and its join is planned before the stop, as a leave is."""
from __future__ import annotations

import threading

import torch.distributed as dist

from planaria.elastic.controller import Controller
from planaria.runtime.config.loading import load_config
from planaria.runtime.contract import keys
from planaria.runtime.contract.epochs import EpochRecord
from planaria.runtime.contract.membership import Announcement
from planaria.runtime.contract.exactly_once import INCOMPLETE, CommitRecord, WorkerStatus
from planaria.runtime.planning.job_plans import build_planner, cost_model
from tests.launch import TINY


def report_statuses(store, plan, last_stepped: int, workers) -> None:
    """What each worker of `plan` publishes when its epoch stops after `last_stepped`."""
    for worker in workers:
        rank = plan.rank_of_worker()[worker]
        status = WorkerStatus(worker=worker, last_stepped=last_stepped, state=INCOMPLETE,
                              commit=CommitRecord(last_stepped, 1.0, 1.0),
                              holds=tuple((layer, worker[1]) for layer in plan.layers_of(rank)))
        store.set(keys.epoch_status(plan.epoch, worker), status.to_json())
    store.set(keys.epoch_trained(plan.epoch), "1")


def stop_when_asked(store, plan, last_stepped: int, members) -> None:
    """The workers' side of a stop: once the controller asks, each reports its status."""
    store.wait([keys.epoch_reconfigure(plan.epoch)])
    report_statuses(store, plan, last_stepped, members)


def announce(store, worker) -> None:
    """What a worker writes once its start-up is over (`StoreCoordinator.announce`)."""
    store.set(keys.member(worker), Announcement(1234).to_json())


def test_a_node_the_job_cannot_use_waits_and_is_used_after_a_failure():
    cfg = load_config(TINY, ["fault_tolerance.f=1"])  # 4 microbatches
    planner = build_planner(cfg, cost_model(cfg, hardware_name="h100", gpus_per_node=1))
    most = 4 * max(planner._sizes_for(10**6))  # 4 pipelines of the largest template
    logs: list[str] = []
    store = dist.HashStore()
    controller = Controller(store, planner, total_steps=100, debounce_s=0, log=logs.append)
    members = [(f"node{i:02d}", 0) for i in range(most)]
    plan = controller.start(members)
    extra = ("node99", 0)
    announce(store, extra)
    alive = set(members) | {extra}
    report_statuses(store, plan, 3, members)

    assert controller.poll(lambda: alive, kill=lambda worker: None) == "running"  # not "failed"
    assert controller.epoch == 1 and sorted(controller.plan.nodes()) == sorted(n for n, _ in members)
    assert any("['node99'] wait until a node fails" in line for line in logs)
    (event,) = controller.events
    assert event.joined == () and event.first_iteration == 4
    store.set("epoch/1/trained", "1")
    assert controller.poll(lambda: alive, kill=lambda worker: None) == "running"
    assert controller.epoch == 1  # the waiting node does not stop the epoch again

    alive.discard(members[0])  # a node fails: the waiting one takes its place
    report_statuses(store, controller.plan, 7, sorted(alive - {extra}))
    assert controller.poll(lambda: alive, kill=lambda worker: None) == "running"
    assert controller.epoch == 2 and "node99" in controller.plan.nodes()
    assert controller.events[-1].joined == ("node99.0",)


def test_a_worker_back_from_a_cut_is_planned_in_only_once_it_has_left_its_old_epoch():
    """node3 is cut off (gone), the job goes on without it; then its agent shows its
    worker alive again, but the worker is still blocked in epoch 0, where it was cut off:
    planned in, it would keep the next epoch's rendezvous waiting for it. It is planned
    in once it says it has left (`keys.ready`, written when it sees an epoch it is not in)."""
    cfg = load_config(TINY, ["fault_tolerance.f=1", "parallel.min_stages=2"])
    planner = build_planner(cfg, cost_model(cfg, hardware_name="h100", gpus_per_node=1))
    logs: list[str] = []
    store = dist.HashStore()
    controller = Controller(store, planner, total_steps=100, log=logs.append)
    members = [(f"node{i}", 0) for i in range(4)]
    plan = controller.start(members)
    alive = set(members) - {("node3", 0)}
    report_statuses(store, plan, 3, sorted(alive))
    controller.poll(lambda: alive, kill=lambda worker: None)
    assert controller.epoch == 1 and "node3" not in controller.plan.nodes()
    store.set(keys.epoch_trained(1), "1")

    alive.add(("node3", 0))  # back on etcd, its worker still in epoch 0
    assert controller.poll(lambda: alive, kill=lambda worker: None) == "running"
    assert controller.epoch == 1 and not store.check([keys.epoch_reconfigure(1)])
    assert any("node3.0 is alive but still in epoch 0" in line for line in logs), logs

    store.set(keys.ready(("node3", 0)), "1")  # it left epoch 0 and saw epoch 1 without it
    report_statuses(store, controller.plan, 5, sorted(alive - {("node3", 0)}))
    assert controller.poll(lambda: alive, kill=lambda worker: None) == "running"
    assert controller.epoch == 2 and controller.events[-1].joined == ("node3.0",)


def test_a_new_worker_is_planned_in_once_announced_and_its_join_is_prepared_before_the_stop():
    """node4's agent shows its worker alive while the worker still starts (imports, data,
    on a GPU its device and compilation): the job trains on, without stopping for it.
    Once announced, the join is planned while the epoch trains and written as prepared
    before the stop is asked for, so that the workers that stop enter it at once."""
    cfg = load_config(TINY, ["fault_tolerance.f=1", "parallel.min_stages=2"])
    planner = build_planner(cfg, cost_model(cfg, hardware_name="h100", gpus_per_node=1))
    logs: list[str] = []
    store = dist.HashStore()
    controller = Controller(store, planner, total_steps=100, debounce_s=0, log=logs.append)
    members = [(f"node{i}", 0) for i in range(4)]
    plan = controller.start(members)
    store.set(keys.epoch_trained(0), "1")
    joiner = ("node4", 0)
    alive = set(members) | {joiner}

    for _ in range(3):  # alive, not announced: no stop, said once
        assert controller.poll(lambda: alive, kill=lambda worker: None) == "running"
    assert controller.epoch == 0 and not store.check([keys.epoch_reconfigure(0)])
    assert sum("node4.0 is starting" in line for line in logs) == 1, logs

    announce(store, joiner)
    stopped = threading.Thread(target=stop_when_asked, args=(store, plan, 6, members))
    stopped.start()
    assert controller.poll(lambda: alive, kill=lambda worker: None) == "running"
    stopped.join()
    assert store.get(keys.epoch_reconfigure(0)).decode() == keys.JOIN
    prepared = EpochRecord.from_json(store.get(keys.epoch_prepared(0)))
    assert "node4" in prepared.plan.nodes()
    assert controller.epoch == 1 and controller.plan.nodes() == prepared.plan.nodes()
    assert controller.plan.first_iteration == 7
    (event,) = controller.events
    assert event.joined == ("node4.0",) and event.reason == keys.JOIN
    assert any("planned before the stop" in line for line in logs), logs
