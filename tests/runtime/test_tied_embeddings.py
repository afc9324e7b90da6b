"""Tied embeddings (`model.tie_embeddings`) train exactly like one shared weight.

The single-process reference ties truly (the head's output weight is the embedding's
own Parameter). Every parallel plan keeps two copies, the embedding's and the head's,
often on different ranks: each case checks, in float64, that the losses, gradient
norms and final parameters equal the reference's within 1e-9, and that the two copies
end bit-identical. An elastic job loses a worker holding a head and recovers in place
by replica transfer; a torchrun job loses one and restarts from a checkpoint.
"""
from __future__ import annotations

import json

import pytest
import torch

from planaria.runtime.config.loading import load_config
from planaria.runtime.config.sections import parameter_count
from planaria.runtime.models.llama import LayerModel
from planaria.runtime.models.tensor_parallel import TensorParallel
from planaria.runtime.parallel.reference import build_reference_model
from planaria.runtime.state.saved_model import load_full_model
from tests.launch import (TINY, assert_final_parameters, cases_with_slow, read_metrics, reference_run,
                          torchrun_train)
from tests.runtime import test_recovery as recovery

TIED = ["model.tie_embeddings=true"]
STEPS = 6
JOB = [
    "model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.vocab_size=128",
    "model.seq_len=16", "data.source=synthetic", f"train.steps={STEPS}", "train.global_batch=8",
    "train.micro_batch=1", "train.dtype=float64", "train.lr=0.01", "train.warmup_steps=2",
    "train.grad_clip=0.5", "train.log_every=100", *TIED,
]

CASES = {
    "single-process": (1, ["parallel.pp=1"]),
    "pp2-interleaved-v2": (2, ["parallel.pp=2", "parallel.schedule=interleaved",
                               "parallel.virtual_stages=2"]),
    "tp2": (2, ["parallel.tp=2"]),
    "tp2-pp2-fused-head-loss": (4, ["parallel.tp=2", "parallel.pp=2", "model.fused_head_loss=true"]),
    # Pipeline 0 holds the embedding and the head on one rank, pipeline 1 on two.
    "heterogeneous-[[4],[2,2]]-mb[3,5]": (3, ["parallel.layout=[[4],[2,2]]", "parallel.microbatches=[3,5]"]),
}


def tiny_model(tied: bool) -> LayerModel:
    cfg = load_config(TINY, ["model.vocab_size=64", "model.d_model=16", f"model.tie_embeddings={tied}"])
    return LayerModel(cfg.model, seed=3)


def assert_copies_identical(saved: dict[int, dict[str, torch.Tensor]]) -> None:
    embedding, head = saved[0]["embed.weight"], saved[len(saved) - 1]["output.weight"]
    assert torch.equal(embedding, head), (embedding - head).abs().max()


@pytest.mark.parametrize("tp_size", [1, 2])
def test_head_starts_as_the_embeddings_copy(tp_size):
    tied, untied = tiny_model(True), tiny_model(False)
    last = tied.num_layers - 1
    for tp_rank in range(tp_size):
        tp = TensorParallel(rank=tp_rank, size=tp_size)  # sharding only: no group needed
        embedding = tied.build_layer(0, tp, torch.float64, torch.device("cpu"), pretrained=True).embed.weight
        head = tied.build_layer(last, tp, torch.float64, torch.device("cpu"), pretrained=True).output.weight
        assert torch.equal(embedding, head)
        untied_head = untied.build_layer(last, tp, torch.float64, torch.device("cpu"), pretrained=True).output.weight
        assert not torch.equal(embedding, untied_head)
    assert tied.tied_parameters() == ((0, "embed.weight"), (last, "output.weight"))
    assert untied.tied_parameters() == ()


def test_reference_shares_one_weight_counted_once():
    model = tiny_model(True)
    net = build_reference_model(model, torch.float64, torch.device("cpu"))
    assert net[0].embed.weight is net[-1].output.weight
    count = sum(p.numel() for p in net.parameters())  # parameters() yields a shared one once
    assert count == parameter_count(model.cfg)
    assert parameter_count(tiny_model(False).cfg) - count == model.cfg.vocab_size * model.cfg.d_model


@pytest.fixture(scope="module")
def reference():
    run = reference_run(JOB)
    untied = reference_run([o for o in JOB if o not in TIED])
    # Tying changes the training: a runtime that ignored it could not match.
    assert abs(run.losses[-1] - untied.losses[-1]) > 1e-3
    return run


# Kept for `make test-slow`, out of the default suite's time: tp=2 alone is covered by
# tp2 x pp2, and a rank holding both copies by the heterogeneous plan's 1-stage pipeline.
SLOW_CASES = {"single-process", "tp2", "tp2-pp2-fused-head-loss", "pp2-interleaved-v2"}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", cases_with_slow(CASES, SLOW_CASES))
def test_tied_plan_matches_single_process(case, reference, tmp_path):
    nproc, overrides = CASES[case]
    torchrun_train(nproc, JOB + overrides, tmp_path)
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m, ref_loss, ref_norm in zip(metrics, reference.losses, reference.grad_norms):
        assert abs(m["loss"] - ref_loss) < 1e-9, (m["step"], m["loss"], ref_loss)
        assert abs(m["grad_norm"] - ref_norm) < 1e-9 * max(1.0, ref_norm)
    assert max(reference.grad_norms) > 0.5  # clipping was exercised
    assert_final_parameters(tmp_path / "final", reference)
    assert_copies_identical(load_full_model(tmp_path / "final"))
    manifest = json.loads((tmp_path / "final" / "manifest.json").read_text())
    assert manifest["tied"] == [[0, "embed.weight"], [5, "output.weight"]]


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_worker_holding_a_head_killed_recovers_exactly(tmp_path):
    """node3 (pipeline 1's last stage: a head, so a tied copy) dies in the gradient sync of
    iteration 2; the survivors re-plan, the head moves by replica transfer, and the job
    ends with the fault-free losses and the two copies still bit-identical. The replica
    audit runs every other step and finds every layer's replicas equal."""
    reference = reference_run([*recovery.JOB, "fault_tolerance.f=1", *TIED])
    job, result = recovery.run_job(tmp_path, nodes=4, faults="node3.0:sync@2",
                                   extra=[*TIED, "audit.every=2"])
    recovery.check_against_reference(tmp_path, reference, job)
    (event,) = result.controller.events
    assert event.failed == ("node3.0",) and event.first_iteration == 2 and event.transfers > 0
    assert not recovery.audits(tmp_path), "the replica audit found replicas that differ"
    assert_copies_identical(load_full_model(tmp_path / "final"))


@pytest.mark.slow  # the default suite's time (~15 min on 2 cores): `make test-slow`
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_torchrun_restart_from_a_checkpoint_keeps_the_copies_tied(tmp_path):
    """pp=2: rank 1 (the head) is killed in iteration 5; torchrun restarts the job, which
    loads each layer from the checkpoint of iteration 3 and trains like the reference."""
    overrides = [*recovery.JOB, *TIED, "parallel.pp=2", "checkpoint.every=2", "checkpoint.keep=1"]
    reference = reference_run(overrides)
    proc = torchrun_train(2, overrides, tmp_path, extra_args=["--max-restarts=1"],
                          env={"PLANARIA_FAULTS": "rank1:backward@5#2"})
    assert "resumed from the checkpoint of iteration 3" in proc.stdout, proc.stdout[-3000:]
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4, 4, 5]
    for m in metrics:
        assert abs(m["loss"] - reference.losses[m["step"]]) < 1e-9
    assert_final_parameters(tmp_path / "final", reference)
    assert_copies_identical(load_full_model(tmp_path / "final"))
