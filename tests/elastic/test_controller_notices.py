"""The controller and preemption notices, over an in-memory store: a noticed node trains
on until its deadline is within the leave window, is then planned out at a step boundary
with the layers only it holds handed over from it; a notice too close to act on is left
to the failure path, and a leaving worker that vanishes before its copies landed fails
the new epoch instead of leaving its receivers waiting."""
from __future__ import annotations

import dataclasses
import threading
import time

import torch.distributed as dist

from planaria.elastic.controller import Controller
from planaria.elastic.leave_planning import leave_window_s
from planaria.runtime.config.loading import load_config
from planaria.runtime.contract import keys
from planaria.runtime.contract.epochs import EpochRecord, Progress
from planaria.runtime.contract.keys import worker_key
from planaria.runtime.contract.membership import LeaveNotice
from planaria.runtime.planning.job_plans import build_planner, cost_model
from tests.elastic.test_controller_joins import report_statuses, stop_when_asked
from tests.launch import TINY

STEP_S = 0.5


def job(notices: dict):
    cfg = load_config(TINY, ["fault_tolerance.f=1", "parallel.min_stages=2"])
    planner = build_planner(cfg, cost_model(cfg, hardware_name="h100", gpus_per_node=1))
    store, logs = dist.HashStore(), []
    controller = Controller(store, planner, total_steps=100, log=logs.append, notices=lambda: dict(notices))
    members = [(f"node{i}", 0) for i in range(4)]
    plan = controller.start(members)
    store.set(keys.epoch_trained(0), "1")
    store.set(keys.PROGRESS, Progress(epoch=0, step=3, time_s=time.time(), step_s=STEP_S).to_json())
    return controller, store, logs, members, plan


def notice(in_s: float) -> LeaveNotice:
    return LeaveNotice(source="aws", deadline=time.time() + in_s, posted=time.time())


def test_a_noticed_node_trains_on_then_leaves_within_its_window_handing_its_layers_over():
    notices: dict = {}
    controller, store, logs, members, plan = job(notices)
    needs = 2 * STEP_S + controller.leaves.overhead_s
    # Both holders of the last stage: nobody else has its layers.
    last = [p.stages[-1].node for p in plan.pipelines]
    notices.update({node: notice(leave_window_s(needs) + 30) for node in last})
    alive = set(members)
    assert controller.poll(lambda: alive, kill=lambda w: None) == "running"
    assert controller.epoch == 0 and any("trains on and leaves about" in line for line in logs), logs

    notices.update({node: notice(leave_window_s(needs) - 1) for node in last})
    stopped = threading.Thread(target=stop_when_asked, args=(store, plan, 5, members))
    stopped.start()
    assert controller.poll(lambda: alive, kill=lambda w: None) == "running"
    stopped.join()
    assert store.get(keys.epoch_reconfigure(0)) == keys.LEAVE.encode()
    (event,) = controller.events
    assert event.reason == "leave" and event.left == tuple(sorted(last)) and event.failed == ()
    assert event.first_iteration == 6 and event.rerun == 0 and event.source == "replicas"
    assert not set(last) & set(controller.plan.nodes())
    record = EpochRecord.from_json(store.get(keys.epoch_record(1)))
    assert record.leaving == tuple(sorted(last))
    handed = [t for t in record.transfers if t.src[0] in last]
    assert handed and event.handed_off == len(handed)
    # Only what no staying worker holds comes from the leaving ones.
    staying_held = {(layer, 0) for w in members if w[0] not in last for layer in plan.layers_of(plan.rank_of_worker()[w])}
    assert all((t.layer, t.tp_rank) not in staying_held for t in handed)


def test_a_leave_is_planned_while_the_epoch_trains_and_published_as_prepared():
    """The next epoch is written as prepared before the stop is asked for (a worker that
    stops enters it at once), and published as it was, from the step after the stop."""
    notices: dict = {}
    controller, store, logs, members, plan = job(notices)
    notices["node3"] = notice(5.0)
    seen = []

    def workers() -> None:
        store.wait([keys.epoch_reconfigure(0)])
        seen.append(EpochRecord.from_json(store.get(keys.epoch_prepared(0))))  # there before the stop
        report_statuses(store, plan, 7, members)

    stopped = threading.Thread(target=workers)
    stopped.start()
    controller.poll(lambda: set(members), kill=lambda w: None)
    stopped.join()
    (prepared,) = seen
    record = EpochRecord.from_json(store.get(keys.epoch_record(1)))
    assert record.plan.first_iteration == 8 and record.plan.epoch == 1
    assert record == EpochRecord(dataclasses.replace(prepared.plan, first_iteration=8),
                                 transfers=prepared.transfers, leaving=("node3",))
    assert "node3" not in record.plan.nodes() and not store.check([keys.epoch_reconfigure(1)])
    (event,) = controller.events
    assert event.reason == "leave" and event.left == ("node3",) and event.first_iteration == 8
    assert any("planned before the stop" in line for line in logs), logs


def test_a_worker_lost_during_a_prepared_leave_ends_the_prepared_epoch_at_once():
    """A worker of the prepared plan dies while the epoch stops: workers that stopped may
    be in the prepared epoch already, so it is published all the same, declared failed
    first; the next epoch is planned from the stop's statuses, the leaving node's among
    them (it still holds its layers: here the last stage's only other copy)."""
    notices: dict = {}
    controller, store, logs, members, plan = job(notices)
    leaving = plan.pipelines[0].stages[-1].node
    dead = next(w for w in members if w[0] == plan.pipelines[1].stages[-1].node)
    notices[leaving] = notice(5.0)
    alive = set(members)

    def workers() -> None:
        store.wait([keys.epoch_reconfigure(0)])
        assert store.check([keys.epoch_prepared(0)])
        alive.discard(dead)  # died before it reported
        report_statuses(store, plan, 7, [w for w in members if w != dead])

    stopped = threading.Thread(target=workers)
    stopped.start()
    controller.poll(lambda: set(alive), kill=lambda w: None)
    stopped.join()
    prepared = EpochRecord.from_json(store.get(keys.epoch_record(1)))
    assert dead in prepared.plan.rank_of_worker()
    assert store.get(keys.epoch_reconfigure(1)) == keys.FAILURE.encode()
    assert any("ended at once" in line for line in logs), logs
    assert controller.epoch == 2, logs
    record = EpochRecord.from_json(store.get(keys.epoch_record(2)))
    assert dead not in record.plan.rank_of_worker() and leaving not in record.plan.nodes()
    assert record.plan.first_iteration == 8 and record.restore is None and record.snapshot is None
    assert record.leaving == (leaving,) and any(t.src[0] == leaving for t in record.transfers)
    (event,) = controller.events
    assert event.epoch == 2 and event.failed == (worker_key(dead),) and event.left == (leaving,)


def test_a_notice_too_close_to_act_on_is_left_to_the_failure_path():
    notices: dict = {}
    controller, store, logs, members, plan = job(notices)
    notices["node3"] = notice(0.1)
    assert controller.poll(lambda: set(members), kill=lambda w: None) == "running"
    assert controller.epoch == 0 and not store.check([keys.epoch_reconfigure(0)])
    assert any("too soon for a planned leave" in line for line in logs), logs


def test_a_leaving_worker_gone_before_its_copies_landed_fails_the_epoch_not_after():
    notices: dict = {}
    controller, store, logs, members, plan = job(notices)
    last = [p.stages[-1].node for p in plan.pipelines]
    notices.update({node: notice(5.0) for node in last})
    stopped = threading.Thread(target=stop_when_asked, args=(store, plan, 5, members))
    stopped.start()
    alive = set(members)
    controller.poll(lambda: alive, kill=lambda w: None)
    stopped.join()
    assert controller.epoch == 1
    record = EpochRecord.from_json(store.get(keys.epoch_record(1)))
    sources = sorted({t.src for t in record.transfers if t.src[0] in last})
    first, second = sources
    store.set(keys.epoch_handed_off(1, first), "1")  # its copies landed, then it exited
    alive -= {first}
    assert controller.poll(lambda: alive, kill=lambda w: None) == "running"
    assert not store.check([keys.epoch_reconfigure(1)]), "a source that said so is no failure"
    alive -= {second}  # gone without a word: its receivers would wait for it
    threading.Thread(target=stop_when_asked, args=(store, controller.plan, 5,
                                                   sorted(controller.plan.rank_of_worker()))).start()
    controller.poll(lambda: alive, kill=lambda w: None)
    assert store.get(keys.epoch_reconfigure(1)) == keys.FAILURE.encode()
