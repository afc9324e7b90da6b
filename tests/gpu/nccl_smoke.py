"""The single-GPU smoke of tests/gpu/test_nccl_smoke.py, in a process of its own (an
aborted communicator must not share the test runner's process). Prints one JSON line.

Besides the release's whole time it records when each group's abort began and ended
(`abort_spans`, seconds from the release's start) and, on the rebuilt world, how long
one group's abort takes alone (`one_abort_s`): what tells aborts side by side from
aborts one after another, where the whole time alone cannot (docs/gpu.md)."""
from __future__ import annotations

import json
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from planaria.runtime.config.loading import load_config
from planaria.runtime.config.validation import plan_from_config
from planaria.runtime.contract import env
from planaria.runtime.data.token_datasets import dataset_for
from planaria.runtime.parallel import release
from planaria.runtime.parallel.release import CommunicatorAbort, group_options
from planaria.runtime.worker.build import start_engine


def world(store_dir: str, name: str) -> None:
    store = dist.FileStore(f"{store_dir}/{name}", 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60),
                            pg_options=group_options("nccl"))


def all_reduce_ok(group=None) -> bool:
    value = torch.ones(4, device="cuda")
    dist.all_reduce(value, group=group)
    torch.cuda.synchronize()
    return bool(torch.equal(value, torch.ones(4, device="cuda")))


class TimedGroup:
    """A process group whose `abort()` notes when it began and ended (time.monotonic())."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.span: tuple[float, float] | None = None

    def abort(self) -> None:
        began = time.monotonic()
        try:
            self.group.abort()
        finally:
            self.span = (began, time.monotonic())


def timed_release() -> tuple[str, float, list[tuple[float, float]]]:
    """`CommunicatorAbort().release()` on the registry's groups, each timed: (what it
    said, its whole time, each group's abort span from the release's start)."""
    groups = [TimedGroup(group) for group in release.registered_groups()]
    real = release.registered_groups
    release.registered_groups = lambda: groups  # the release's own code path, groups timed
    try:
        started = time.monotonic()
        said = CommunicatorAbort().release()
        whole = time.monotonic() - started
    finally:
        release.registered_groups = real
    return said, whole, [(g.span[0] - started, g.span[1] - started) for g in groups if g.span is not None]


def main(config: str) -> None:
    import os

    env.nccl_recovery(os.environ, timeout_s=60)
    torch.cuda.set_device(0)
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        world(tmp, "first")
        # an epoch's groups: the world and three more (pipeline, data parallel, tied)
        subs = [dist.new_group([0], pg_options=group_options("nccl")) for _ in range(3)]
        found["first_world"] = all_reduce_ok() and all(all_reduce_ok(sub) for sub in subs)
        found["abort"], found["abort_s"], found["abort_spans"] = timed_release()
        try:
            all_reduce_ok()
            found["after_abort"] = "completed"
        except Exception as err:  # an aborted communicator refuses further work
            found["after_abort"] = f"refused: {str(err).splitlines()[0][:200]}"
        try:
            dist.destroy_process_group()
        except Exception as err:
            found["destroy"] = str(err).splitlines()[0][:200]
        torch.cuda.synchronize()
        world(tmp, "second")  # a new epoch's groups, in the same process
        found["rebuilt_world"] = all_reduce_ok()
        cfg = load_config(config, ["train.dtype=bfloat16", "comm.backend=nccl", "data.source=synthetic",
                                   "parallel.pp=1", "parallel.dp=1", "train.steps=3"])
        engine = start_engine(cfg, plan_from_config(cfg, world_size=1), 0, torch.device("cuda", 0))
        data = dataset_for(cfg)
        found["losses"] = [engine.train_step(i, data, cfg.data.seed).loss for i in range(3)]
        found["memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
        engine.destroy()
        # One group's abort alone, the measure of the release's four: its communicator
        # connected first, as the release's were.
        probe = dist.new_group([0], pg_options=group_options("nccl"))
        found["probe_ok"] = all_reduce_ok(probe)
        started = time.monotonic()
        probe.abort()
        found["one_abort_s"] = time.monotonic() - started
        try:
            dist.destroy_process_group()
        except Exception as err:
            found["destroy_after_probe"] = str(err).splitlines()[0][:200]
    found["device"] = torch.cuda.get_device_name(0)
    found["torch"] = torch.__version__
    found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    print(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1])
