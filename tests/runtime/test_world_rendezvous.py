"""A worker whose epoch failed in the rendezvous joins the next epoch with its peers.

torch names the world group from a per-process counter that a failed
`init_process_group` advances and nothing resets; without
`planaria.runtime.parallel.groups.forget_failed_world` the worker's next world would wait on
other keys than its peers' until the connect timeout (found replaying the p3 trace:
every epoch after a failed join timed out).
"""
from __future__ import annotations

import multiprocessing as mp
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from planaria.runtime.parallel.groups import forget_failed_world


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, reset: bool, out) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    if rank == 0:  # epoch 1: its peer never comes
        try:
            dist.init_process_group("gloo", store=dist.PrefixStore("epoch/1/pg/", store), rank=0,
                                    world_size=2, timeout=timedelta(seconds=2))
            out.put((rank, "epoch 1 unexpectedly formed"))
            return
        except Exception:
            pass
        if reset:
            forget_failed_world()
        store.set("epoch1_failed", "1")
    else:
        store.wait(["epoch1_failed"])
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("epoch/2/pg/", store), rank=rank,
                                world_size=2, timeout=timedelta(seconds=8))
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        out.put((rank, value.item()))
        dist.destroy_process_group()
    except Exception as err:
        out.put((rank, f"epoch 2 failed: {err}"))


def _run(reset: bool) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, reset, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return results


@pytest.mark.timeout(120)
def test_worker_whose_rendezvous_failed_forms_the_next_world_with_its_peers():
    assert _run(reset=True) == {0: 3.0, 1: 3.0}
