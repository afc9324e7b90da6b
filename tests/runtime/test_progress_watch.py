"""A worker's progress watch (runtime/worker/progress_watch.py): what its heartbeat tells
the agent. A stall counts only within a step, past the epoch's warm-up, outside any
collective; the bound follows the worker's own step times."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from planaria.runtime.worker.progress_watch import WARMUP_STEPS, ProgressWatch


def warmed_up(watch: ProgressWatch, step_s: float = 0.05) -> ProgressWatch:
    watch.epoch_started()
    for iteration in range(WARMUP_STEPS):
        watch.mark("begin", iteration)
        watch.step_done(step_s)
    return watch


def test_a_stall_counts_only_within_a_step_after_the_warm_up():
    watch = ProgressWatch(factor=10, floor_s=0.5)
    watch.epoch_started()
    watch.mark("begin", 0)  # the first steps (compilation, the first fill) are not watched
    time.sleep(0.1)
    assert watch.stall().stalled_s == 0
    warmed_up(watch)
    time.sleep(0.1)  # between steps (checkpoints, evaluations): not watched
    assert watch.stall().stalled_s == 0
    watch.mark("begin", WARMUP_STEPS)
    time.sleep(0.2)
    stall = watch.stall()
    assert 0.15 < stall.stalled_s < 1.0 and stall.bound_s == 0.5  # 10 x 0.05 s, at least the floor
    watch.mark("forward", WARMUP_STEPS)  # progress
    assert watch.stall().stalled_s < 0.05


def test_the_bound_is_its_own_median_step_times_the_factor_and_a_slow_step_is_far_from_it():
    watch = warmed_up(ProgressWatch(factor=10, floor_s=0.1), step_s=0.2)
    assert watch.stall().bound_s == pytest.approx(2.0)
    watch.mark("begin", WARMUP_STEPS)
    watch.step_done(0.6)  # a step 3x the median, once
    assert watch.stall().bound_s == pytest.approx(2.0)  # (the median moved not at all)


def test_waits_in_the_steps_all_reduces_are_not_stalls():
    watch = warmed_up(ProgressWatch(factor=10, floor_s=0.1))
    watch.mark("begin", WARMUP_STEPS)
    watch.mark("sync", WARMUP_STEPS)  # the gradient all-reduce: a peer may hold it up
    time.sleep(0.2)
    assert watch.stall().stalled_s == 0
    watch.mark("committed", WARMUP_STEPS)
    time.sleep(0.2)
    assert watch.stall().stalled_s > 0.15


@pytest.mark.timeout(60)
def test_a_main_thread_waiting_in_torch_distributed_is_not_stalled_but_one_waiting_elsewhere_is():
    """A peer blocked on the stuck worker waits inside torch.distributed (here: a gloo
    group whose other rank never comes); the stuck one waits anywhere else."""
    outcome = {}

    def wait_for_a_peer() -> None:
        try:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=2,
                                    timeout=timedelta(seconds=3))
        except Exception as err:  # noqa: BLE001 - the other rank never came
            outcome["error"] = err

    stuck = threading.Event()
    for target, in_collective in ((wait_for_a_peer, True), (stuck.wait, False)):
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        watch = warmed_up(ProgressWatch(factor=10, floor_s=0.1, main=thread))
        watch.mark("begin", WARMUP_STEPS)
        time.sleep(1.0)
        assert (watch.stall().stalled_s == 0) == in_collective, target
    stuck.set()
