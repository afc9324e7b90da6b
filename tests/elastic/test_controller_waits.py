"""Below one replica's nodes, the job waits for nodes (`elastic/node_wait.py`): a node
that comes within the limit is planned in with the survivor, and the job goes on from
what the survivor keeps; none within the limit, and the job fails as before, saying so."""
from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from planaria.elastic.controller import Controller
from planaria.runtime.config.loading import load_config
from planaria.runtime.contract import keys
from planaria.runtime.contract.membership import Waiting
from planaria.runtime.contract.exactly_once import INCOMPLETE, CommitRecord, SnapshotHeld, WorkerStatus
from planaria.runtime.planning.job_plans import build_planner, cost_model
from planaria.runtime.worker.coordination import StoreCoordinator
from tests.elastic.test_controller_joins import announce
from tests.launch import TINY


def job(wait_s: float):
    """Four nodes (n0 = 2: pipelines of two stages), epoch 0 trained; then nodes 1 to 3
    gone, node0 stopped after step 5 holding its stage and a peer snapshot of every layer
    at step 3."""
    cfg = load_config(TINY, ["fault_tolerance.f=1", "parallel.min_stages=2"])
    planner = build_planner(cfg, cost_model(cfg, hardware_name="h100", gpus_per_node=1))
    store, logs = dist.HashStore(), []
    # Nodes 1 to 3 died: their agents refused the probes (`gone`), so nobody waits for them
    # as for nodes cut off (tests/elastic/test_controller_cuts.py).
    controller = Controller(store, planner, total_steps=100, debounce_s=0, log=logs.append, wait_for_nodes_s=wait_s,
                            gone=lambda: {"node1", "node2", "node3"})
    members = [(f"node{i}", 0) for i in range(4)]
    plan = controller.start(members)
    store.set(keys.epoch_trained(0), "1")
    survivor = members[0]
    kept = SnapshotHeld(CommitRecord(3, 1.0, 1.0), epoch=0, shards=tuple((layer, 0) for layer in range(plan.num_layers)))
    status = WorkerStatus(worker=survivor, last_stepped=5, state=INCOMPLETE, commit=CommitRecord(5, 1.0, 1.0),
                          holds=tuple((layer, 0) for layer in plan.layers_of(plan.rank_of_worker()[survivor])),
                          snapshots=(kept,))
    store.set(keys.epoch_status(0, survivor), status.to_json())
    return controller, store, logs, {survivor}


def test_below_the_minimum_the_job_waits_and_a_node_that_comes_is_planned_in_with_the_survivor():
    controller, store, logs, alive = job(wait_s=60)
    for _ in range(3):
        assert controller.poll(lambda: alive, kill=lambda worker: None) == "running"
    assert controller.epoch == 0 and not store.check([keys.DONE])
    waiting = Waiting.from_json(store.get(keys.WAITING))
    assert (waiting.nodes, waiting.needs, waiting.limit_s) == (1, 2, 60)
    assert sum("the job waits up to 60 s (--join-timeout) for 1 more node(s)" in line for line in logs) == 1, logs

    joiner = ("node4", 0)
    announce(store, joiner)
    alive.add(joiner)
    assert controller.poll(lambda: alive, kill=lambda worker: None) == "running"
    assert controller.epoch == 1 and sorted(controller.plan.nodes()) == ["node0", "node4"]
    assert not store.check([keys.WAITING])
    event = controller.events[-1]
    # node0's layers are of step 5, the others only in its snapshot of step 3: every layer
    # goes back to step 3, and steps 4 and 5 run again.
    assert event.snapshot == 3 and event.first_iteration == 4 and event.joined == ("node4.0",)
    assert any("nodes came after" in line for line in logs), logs


def test_below_the_minimum_no_node_within_the_limit_fails_the_job_saying_so():
    controller, store, logs, alive = job(wait_s=0.3)
    assert controller.poll(lambda: alive, kill=lambda worker: None) == "running"
    time.sleep(0.4)
    assert controller.poll(lambda: alive, kill=lambda worker: None) == "failed"
    outcome = store.get(keys.DONE).decode()
    assert not store.check([keys.WAITING])  # (status and metrics no longer say it waits)
    assert "1 node(s) left, but one replica of the model needs n0=2" in outcome
    assert "no node came within 0.3 s (--join-timeout)" in outcome


def test_a_worker_waits_for_its_next_epoch_while_the_job_waits_for_nodes_but_not_past_its_limit():
    """A worker's wait for its next epoch outlasts its own limit while `waiting` says the
    job waits for nodes, up to that wait's limit and its own more (a key that its leader
    could not delete holds nobody for ever)."""
    store = dist.HashStore()
    coordinator = StoreCoordinator(store, ("node0", 0))
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        coordinator.wait_for_epoch(-1, timeout_s=0.2)
    alone = time.monotonic() - started
    store.set(keys.WAITING, Waiting(since=time.time(), nodes=1, needs=2, limit_s=1.0).to_json())
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        coordinator.wait_for_epoch(-1, timeout_s=0.2)
    waited = time.monotonic() - started
    assert alone < 0.6 and 1.0 < waited < 3.0, (alone, waited)
