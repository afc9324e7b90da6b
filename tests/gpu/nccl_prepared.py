"""One GPU, one process: a one-rank NCCL epoch whose groups are connected ahead
(`PreparedGroups`: `eager_connect_single_device`, a barrier) on a thread while an
all-reduce loop runs on the world in force, then handed to torch at the switch; prints
a JSON line for tests/gpu/test_nccl_prepared.py."""
from __future__ import annotations

import json
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from planaria.runtime.parallel.groups import EpochGroups
from planaria.runtime.parallel.prepared_groups import PREPARED_BACKEND, PreparedGroups
from planaria.runtime.parallel.release import group_options
from planaria.templates.plan import PipelinePlan, Plan, StagePlan


def main() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=60))
    dist.init_process_group("nccl", store=dist.PrefixStore("epoch0", store), rank=0, world_size=1,
                            timeout=timedelta(seconds=60), pg_options=group_options("nccl"))
    plan = Plan(epoch=1, first_iteration=0, num_layers=2, tp=1, schedule="1f1b", virtual_stages=1, global_batch=2,
                micro_batch=1, pipelines=(PipelinePlan("one", (StagePlan("n0", (0,), ((0, 2),)),), 2, 0),))
    started = time.perf_counter()
    prepared = PreparedGroups(1, plan, 0, lambda: dist.PrefixStore("epoch1", store), "nccl", device,
                              timedelta(seconds=60)).start()
    steps = 0
    while not prepared.done.is_set() or steps < 20:  # the epoch in force trains meanwhile
        value = torch.ones(1, device=device)
        dist.all_reduce(value)
        torch.cuda.synchronize(device)
        steps += 1
    connect_s = time.perf_counter() - started
    dist.destroy_process_group()
    dist.init_process_group(prepared.install() if prepared.connected else "nccl",
                            store=dist.PrefixStore("unused", store), rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    groups = EpochGroups.build(plan, 0, timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=60))
    value = torch.full((1,), 3.0, device=device)
    dist.all_reduce(value, group=groups.pipeline)
    torch.cuda.synchronize(device)
    print(json.dumps({"connected": prepared.connected, "error": prepared.error, "steps": steps,
                      "connect_s": connect_s, "backend": dist.get_backend(), "value": value.item(),
                      "expected_backend": PREPARED_BACKEND}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
