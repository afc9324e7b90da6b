"""Publishing an epoch when two controllers may both believe they lead (a leader whose
lease expired while it was busy or cut off): the job's epochs are never overwritten,
and a leader that died between writing an epoch and publishing it is finished for."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch.distributed as dist

from planaria.elastic.controller import Controller
from planaria.elastic.controller_errors import Interrupted, StaleLeader
from planaria.runtime.config.loading import load_config
from planaria.runtime.contract import keys
from planaria.runtime.contract.epochs import EpochRecord
from planaria.runtime.planning.job_plans import build_planner, cost_model
from tests.launch import TINY


@pytest.fixture(scope="module")
def planner():
    cfg = load_config(TINY, ["fault_tolerance.f=1"])
    return build_planner(cfg, cost_model(cfg, hardware_name="h100", gpus_per_node=1))


def controller(store, planner) -> Controller:
    return Controller(store, planner, total_steps=100, log=lambda message: None)


def next_record(plan, *, first_iteration: int) -> EpochRecord:
    return EpochRecord(dataclasses.replace(plan, epoch=plan.epoch + 1, first_iteration=first_iteration))


def published(store, epoch: int) -> EpochRecord:
    return EpochRecord.from_json(store.get(keys.epoch_record(epoch)))


def test_a_stale_leader_can_neither_overwrite_nor_move_on_its_successors_epoch(planner):
    store = dist.HashStore()
    old = controller(store, planner)
    plan = old.start([(f"node{i}", 0) for i in range(4)])
    new = controller(store, planner)
    assert new.resume() and new.epoch == 0
    ours = next_record(plan, first_iteration=7)
    new._publish(ours)

    with pytest.raises(StaleLeader):  # the old leader still believes epoch 0 is in force
        old._publish(next_record(plan, first_iteration=5))
    assert published(store, 1) == ours
    assert store.get("epoch") == b"1"
    with pytest.raises(StaleLeader):  # nor can it skip ahead to an epoch nobody wrote
        old._publish(next_record(ours.plan, first_iteration=9))
    assert store.get("epoch") == b"1"


def test_a_new_leader_publishes_the_epoch_its_predecessor_wrote_before_dying(planner):
    store = dist.HashStore()
    first = controller(store, planner)
    plan = first.start([(f"node{i}", 0) for i in range(4)])
    orphan = next_record(plan, first_iteration=3)
    store.set("epoch/1/record", orphan.to_json())  # written; the leader died before the CAS
    successor = controller(store, planner)
    assert successor.resume()
    assert successor.epoch == 1 and successor.plan == orphan.plan and store.get("epoch") == b"1"


def test_an_epoch_0_written_but_never_published_is_published_by_the_next_leader(planner):
    store = dist.HashStore()
    plan = planner.instantiate(4, node_ids=[f"node{i}" for i in range(4)]).plan
    store.set("epoch/0/record", EpochRecord(plan).to_json())
    successor = controller(store, planner)
    assert successor.resume()  # it would otherwise plan epoch 0 again and find it taken
    assert successor.epoch == 0 and store.get("epoch") == b"0"


def test_a_leader_whose_node_is_leaving_stops_waiting_for_statuses_at_once(planner):
    """A signal reached the leader's agent while it waited for the survivors' statuses (up
    to the status timeout: minutes on a real job): it steps down now, publishing nothing,
    and the next leader redoes the reconfiguration."""
    store = dist.HashStore()
    leaving = []
    leader = Controller(store, planner, total_steps=100, status_timeout_s=120, log=lambda message: None,
                        interrupted=lambda: bool(leaving))
    plan = leader.start([(f"node{i}", 0) for i in range(4)])
    survivors = {(f"node{i}", 0) for i in range(3)}  # node3 died; nobody has reported yet

    def alive_now():
        leaving.append(True)  # the signal arrives during the wait
        return survivors

    started = time.monotonic()
    with pytest.raises(Interrupted):
        leader.poll(alive_now, kill=lambda worker: None)
    assert time.monotonic() - started < 10
    assert store.get("epoch") == b"0"  # nothing published
    successor = controller(store, planner)
    assert successor.resume() and successor.plan == plan
