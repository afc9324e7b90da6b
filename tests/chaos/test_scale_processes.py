"""The scale harness with its nodes in several processes: the epochs' steps still meet
(`StepHub`: one outcome per iteration for every rank, wherever it runs), and a job whose
nodes live in two processes recovers from a node's death and absorbs a join, as the
harness's own process does (the real agents and etcd; tests/chaos/test_scale_traffic.py
checks the requests, this the multi-process plumbing)."""
from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from planaria.chaos.scale.data_plane import DataPlane, PeerGone, Released, StepBarrier, connect_barrier
from planaria.chaos.scale.scale_run import ScaleHarness
from planaria.chaos.scale.shared_records import SharedRecords
from planaria.chaos.scale.step_hub import HostedDataPlane, StepHub
from planaria.runtime.contract.epochs import EpochRecord
from planaria.templates.layout import plan_from_layout
from tests.launch import TINY


def arrive(hub: StepHub, epoch: int, iteration: int, count: int, stop: bool = False, released: bool = False):
    return hub.apply({"arrived": {(epoch, iteration): (count, stop, released)}})


def test_an_iteration_completes_once_every_rank_of_every_process_arrived():
    hub = StepHub()
    assert hub.apply({"worlds": {0: 16}}) == []
    assert arrive(hub, 0, 5, 8) == []  # one process's eight ranks: the others' are missing
    assert arrive(hub, 0, 5, 8, stop=True) == [(0, 5, True, True, [])]  # the OR of the stop requests
    assert arrive(hub, 0, 6, 16) == [(0, 6, True, False, [])]


def test_a_release_or_a_death_fails_the_iteration_for_every_rank():
    hub = StepHub()
    hub.apply({"worlds": {1: 16}})
    arrive(hub, 1, 0, 10)
    assert hub.apply({"released": [(1, 0)]}) == [(1, 0, False, False, [])]
    # Decided once: the ranks that come later find it failed, even when all are in.
    assert arrive(hub, 1, 0, 6) == []
    hub.apply({"worlds": {2: 4}})
    assert hub.apply({"dead": [(2, 3, None)]}) == []  # nobody waits yet
    assert arrive(hub, 2, 0, 1) == [(2, 0, False, False, [3])]


def test_a_rank_that_died_waiting_fails_the_iteration_only_for_the_others_and_in_order():
    hub = StepHub()
    hub.apply({"worlds": {0: 2}})
    arrive(hub, 0, 4, 1)
    assert hub.apply({"dead": [(0, 1, 4)]}) == []  # rank 1 died in the all-reduce it waited in
    assert arrive(hub, 0, 4, 1) == [(0, 4, True, False, [1])]  # as one process: every rank entered it
    # A death between two arrivals of one host's batch stays between them.
    hub.apply({"worlds": {1: 3}})
    decided = hub.apply([{"arrived": {(1, 0): (2, False, False)}}, {"dead": [(1, 2, None)]},
                         {"arrived": {(1, 0): (1, False, False)}}])
    assert decided == [(1, 0, False, False, [2])]


def test_a_partition_keeps_every_iteration_from_completing():
    hub = StepHub()
    hub.apply({"worlds": {0: 2}})
    hub.block_all()
    assert arrive(hub, 0, 0, 2) == []
    assert hub.apply({"released": [(0, 0)]}) == [(0, 0, False, False, [])]


@pytest.mark.timeout(300)
def test_nodes_in_two_processes_recover_from_a_death_and_take_a_join(tmp_path):
    with ScaleHarness(nodes=4, gpus_per_node=2, config=str(TINY), step_s=0.2, backend="gloo", processes=2,
                      overrides=["fault_tolerance.f=1"], log_dir=tmp_path, log=lambda line: None) as harness:
        harness.start(timeout_s=120)
        assert harness.measured_step_s() >= 0.2  # what a planned leave's notice is sized from
        leader = harness.leader()
        victim = next(i for i in reversed(harness.live()) if i != leader)
        killed = harness.reconfigure(lambda: harness.kill_node(victim), "node killed", timeout_s=120)
        assert killed.nodes == 3 and killed.workers == 6
        assert f"node{victim}" not in {node for node, _ in harness.workers_of(killed.epoch)}
        joined = harness.reconfigure(harness.add_node, "node joins", timeout_s=120)
        assert joined.epoch == killed.epoch + 1 and joined.nodes == 4
        assert joined.etcd.total > 0 and joined.bootstrapped_s > 0
        # Both processes carried nodes of the plan, so the steps met across them.
        assert {int(node[4:]) % 2 for node, _ in harness.workers_of(joined.epoch)} == {0, 1}
        assert harness.harness_cpu() > 0


def test_a_peers_death_fails_a_step_still_computing():
    """A real step's first collective fails within milliseconds of a peer's death: a
    simulated step of 10 s does too, in one process and across node processes (the hub's
    word of the death), and so does a release."""
    barrier = StepBarrier(2)
    threading.Timer(0.2, barrier.fail, args=(1,)).start()
    started = time.monotonic()
    with pytest.raises(PeerGone):
        barrier.work(0, 7, 10.0)
    assert time.monotonic() - started < 2.0

    sent, _ = multiprocessing.Pipe()
    plane = HostedDataPlane(sent)
    hosted = plane.epoch(3, 4)
    threading.Timer(0.2, plane.on_decided, args=({"deaths": [(3, 2)]},)).start()
    started = time.monotonic()
    with pytest.raises(PeerGone):
        hosted.work(0, 7, 10.0)
    assert time.monotonic() - started < 2.0
    other = plane.epoch(4, 2)
    started = time.monotonic()
    other.work(0, 0, 0.3)  # nobody of this epoch died: the step takes its time
    assert 0.25 < time.monotonic() - started < 2.0
    threading.Timer(0.2, other.release, args=(1,)).start()
    with pytest.raises(Released):
        other.work(1, 1, 10.0)


def test_a_prepared_record_starting_at_a_step_is_made_once_for_every_simulated_worker():
    """A join's and a leave's next epoch is prepared before the stop; each worker sets its
    plan's first step. Made once for all (`SharedRecords.starting_at`), the plan's rank
    table is derived once, not once per worker (8,192 times at 1,024 nodes)."""
    records = SharedRecords()
    prepared = EpochRecord(plan_from_layout(layout=[[2, 2]], n_blocks=4, tp=1, schedule="1f1b",
                                            virtual_stages=1, global_batch=2, micro_batch=1))
    first = records.starting_at(prepared, 7)
    assert first.plan.first_iteration == 7 and first.plan.layers_of(0) == prepared.plan.layers_of(0)
    assert records.starting_at(prepared, 7) is first
    assert records.starting_at(prepared, 8).plan.first_iteration == 8


def _meet(barrier, rank: int, outcomes: dict, timeout_s: float) -> None:
    try:
        barrier.step(rank, 0, False, timeout_s=timeout_s)
        outcomes[rank] = True
    except (PeerGone, Released):
        outcomes[rank] = False


def _all_meet(barrier, ranks, timeout_s: float) -> dict:
    outcomes: dict[int, bool] = {}
    threads = [threading.Thread(target=_meet, args=(barrier, rank, outcomes, timeout_s)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return outcomes


def test_a_join_connected_ahead_is_entered_by_every_rank_or_by_none():
    """The barrier that ends a connection ahead (`PreparedGroups`): a rank whose groups did
    not connect fails it for every rank, and a rank that never comes fails it once the
    others' wait lapses; the epoch's own steps are not touched (its ranks train after a
    rendezvous). At 1,024 nodes, without it, 781 simulated workers entered a join's epoch
    over a rendezvous while its rank 0 took the prepared groups, and the epoch failed."""
    plane = DataPlane()
    joined = plane.epoch(connect_barrier(5), 3)
    assert _all_meet(joined, [0, 1, 2], 10.0) == {0: True, 1: True, 2: True}

    failed = plane.epoch(connect_barrier(6), 3)
    threading.Timer(0.3, failed.fail, args=(2,)).start()  # rank 2's replay timed out
    assert _all_meet(failed, [0, 1], 10.0) == {0: False, 1: False}
    started = time.monotonic()
    assert _all_meet(plane.epoch(connect_barrier(7), 3), [0, 1], 0.5) == {0: False, 1: False}
    assert time.monotonic() - started < 5.0
    late = plane.epoch(connect_barrier(7), 3)
    assert _all_meet(late, [2], 10.0) == {2: False}  # decided: it failed for every rank
    steps = plane.epoch(6, 3)
    assert _all_meet(steps, [0, 1, 2], 10.0) == {0: True, 1: True, 2: True}

    # Across node processes: a rank whose wait lapsed tells the hub it gave up, which
    # fails the all-reduce for every rank, however many came.
    hub = StepHub()
    key = connect_barrier(8)
    hub.apply({"worlds": {key: 3}})
    arrive(hub, key, 0, 2)
    assert hub.apply({"dead": [(key, 1, None)]}) == [(key, 0, False, False, [1])]
    sent, received = multiprocessing.Pipe()
    hosted = HostedDataPlane(sent).epoch(key, 3)
    started = time.monotonic()
    assert _all_meet(hosted, [0], 0.3) == {0: False}
    assert time.monotonic() - started < 5.0
    said = []
    while received.poll(1.0):
        said += [batch for batch in received.recv()[1]]
    assert {"dead": [(key, 0, None)]} in said
