"""The vocabulary-parallel forms over a real gloo group of 2 processes: each rank holds
half the vocabulary, and the loss and this rank's gradients equal those of the full
logits (the reference gathers them whole). Through the interpreter on CPU."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planaria.kernels import dispatch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]
if dispatch.triton is None:
    pytest.skip("Triton is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

if dispatch.interpreter_problem() is not None:
    pytest.skip(dispatch.interpreter_problem(), allow_module_level=True)

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, results) -> None:
    os.environ[dispatch.ENV] = "triton"
    from planaria import kernels as K
    from planaria.kernels.cross_entropy import IGNORE_INDEX

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        group = dist.new_group(list(range(WORLD)))
        gen = torch.Generator().manual_seed(0)
        rows, hidden, vocab = 11, 24, 2 * 1100  # a half of 1100: not a multiple of any block
        logits = torch.randn(rows, vocab, generator=gen) * 3
        h = torch.randn(rows, hidden, generator=gen)
        weight = torch.randn(vocab, hidden, generator=gen) * hidden ** -0.5
        target = torch.randint(vocab, (rows,), generator=gen)
        target[4] = IGNORE_INDEX
        mine = slice(rank * vocab // WORLD, (rank + 1) * vocab // WORLD)
        errors = {}
        for name, kernel, reference, inputs in (
            ("cross_entropy", lambda x: K.cross_entropy(x, target, group),
             lambda x: K.cross_entropy_reference(x, target, group), [logits[:, mine]]),
            ("linear_cross_entropy", lambda x, w: K.linear_cross_entropy(x, w, target, group, chunk_rows=4),
             lambda x, w: K.linear_cross_entropy_reference(x, w, target, group), [h, weight[mine]]),
        ):
            assert dispatch.use_triton(name, "auto", *inputs)
            outs = []
            for fn in (kernel, reference):
                leaves = [x.clone().requires_grad_() for x in inputs]
                loss = fn(*leaves)
                loss.backward()
                outs.append((loss.detach(), [x.grad for x in leaves]))
            (loss, grads), (ref_loss, ref_grads) = outs
            errors[name] = [abs(loss - ref_loss).item() / abs(ref_loss).item()] + [
                ((g - r).norm() / r.norm()).item() for g, r in zip(grads, ref_grads)]
        results[rank] = errors
    finally:
        dist.destroy_process_group()


def test_vocabulary_parallel_cross_entropies_match_the_full_logits(monkeypatch):
    # The children are spawned: they import Triton afresh, for its interpreter also on a
    # machine with a GPU.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    mp.start_processes(_worker, args=(_free_port(), results), nprocs=WORLD, start_method="spawn", join=True)
    assert sorted(results.keys()) == list(range(WORLD))
    for rank, errors in results.items():
        for name, values in errors.items():
            # The loss, then each input's gradient (the hidden states' is this rank's share).
            assert max(values) < 1e-5, (rank, name, values)
