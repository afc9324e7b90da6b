"""Grouped-query and multi-query attention train exactly like plain single-process
PyTorch under pipeline, tensor (key/value heads split, and replicated where tp exceeds
them) and heterogeneous plans (float64, CPU, gloo).

As in test_exactness.py: losses and gradient norms from metrics.jsonl against the
reference run step by step, then the final parameters reassembled from the saved tp
shards (`LayerModel.unshard`). The gradient norm checks that a replicated key/value
head is counted once; the final wk/wv that its replicas' gradients were summed.
"""
from __future__ import annotations

import pytest

from tests.launch import assert_final_parameters, cases_with_slow, read_metrics, reference_run, torchrun_train
from tests.runtime.test_exactness import JOB

GQA = ["model.n_kv_heads=2"]
# Multi-query, with LLaMA 3.1's rotary scaling shortened so that it changes positions < seq_len.
MQA = ["model.n_kv_heads=1", "model.rope_theta=500000.0",
       "model.rope_scaling={rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, "
       "high_freq_factor: 4.0, original_max_position_embeddings: 16}"]

CASES = {
    "gqa-pp2": (2, GQA, ["parallel.pp=2"]),
    "gqa-tp2-pp2-zb1f1b": (4, GQA, ["parallel.tp=2", "parallel.pp=2", "parallel.schedule=zb1f1b"]),
    "gqa-tp4-replicated": (4, GQA, ["parallel.tp=4", "parallel.pp=1"]),
    "mqa-tp2-replicated-rope-scaling": (2, MQA, ["parallel.tp=2", "parallel.pp=1"]),
    "gqa-heterogeneous-[[4],[2,2]]": (3, GQA, ["parallel.layout=[[4],[2,2]]", "parallel.microbatches=[3,5]"]),
    # Replicated heads in two pipelines: the replica-group sum, then the tp replicas' sum.
    "mqa-tp2-two-pipelines": (4, MQA, ["parallel.tp=2", "parallel.layout=[[4],[4]]",
                                       "parallel.microbatches=[3,5]"]),
}


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(model: list[str]):
        key = tuple(model)
        if key not in cache:
            cache[key] = reference_run(JOB + model)
        return cache[key]
    return get


# pp=2 alone is covered by tp2 x pp2, and MQA in two pipelines by the single-pipeline MQA case
# and the heterogeneous one: kept for `make test-slow`, out of the default suite's time.
SLOW_CASES = {"gqa-pp2", "mqa-tp2-two-pipelines", "gqa-tp4-replicated", "gqa-tp2-pp2-zb1f1b",
              "gqa-heterogeneous-[[4],[2,2]]"}
"""The default suite keeps one multi-process case (mqa-tp2-replicated-rope-scaling);
heterogeneous plans are exact in tests/runtime/test_tied_embeddings.py (and, under
`make test-slow`, tests/runtime/test_exactness.py)."""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", cases_with_slow(CASES, SLOW_CASES))
def test_gqa_plan_matches_single_process(case, references, tmp_path):
    nproc, model, plan = CASES[case]
    reference = references(model)
    torchrun_train(nproc, JOB + model + plan, tmp_path)

    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == list(range(len(reference.losses)))
    for m, ref_loss, ref_norm in zip(metrics, reference.losses, reference.grad_norms):
        assert abs(m["loss"] - ref_loss) < 1e-9, (m["step"], m["loss"], ref_loss)
        assert abs(m["grad_norm"] - ref_norm) < 1e-9 * max(1.0, ref_norm), (m["step"], m["grad_norm"], ref_norm)
    assert max(reference.grad_norms) > 0.5  # clipping exercised
    assert_final_parameters(tmp_path / "final", reference)
    wk = reference.model[1].attn.wk.weight
    assert wk.shape[0] == 32 // 4 * int(model[0].split("=")[1])  # the reference is grouped-query too
