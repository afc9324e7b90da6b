"""The per-worker logs are named in one place: what a worker writes at `log_path` is
what the chaos report reads back, per worker and in order, as typed records, and one
kind never reads the other's files."""
from __future__ import annotations

import pytest

from planaria.chaos.report import read_commits, read_evals
from planaria.runtime.contract.logs import COMMITS, EVALS, CommitEntry, EvalEntry, append, log_path
from planaria.runtime.contract.record import RecordError


def commit(step: int) -> CommitEntry:
    return CommitEntry(step=step, loss=5.0 - step / 10, grad_norm=1.0, epoch=0, time=100.0 + step)


def test_what_a_worker_writes_the_report_reads(tmp_path):
    for worker, n in (("n0.0", 3), ("n1.0", 2)):
        with open(log_path(tmp_path, COMMITS, worker), "a", encoding="utf-8") as f:
            for i in range(n):
                append(f, commit(i))
    evaluation = EvalEntry(step=1, val_loss=2.5, epoch=0, time=101.0)
    with open(log_path(tmp_path, EVALS, "n0.0"), "a", encoding="utf-8") as f:
        append(f, evaluation)
    assert read_commits(tmp_path) == {"n0.0": [commit(i) for i in range(3)], "n1.0": [commit(i) for i in range(2)]}
    assert read_evals(tmp_path) == {"n0.0": [evaluation]}


def test_a_damaged_log_line_is_named_by_file_and_line(tmp_path):
    path = log_path(tmp_path, COMMITS, "n0.0")
    path.write_text(commit(0).to_json() + "\n" + '{"step": 1, "loss": 4.9}\n')
    with pytest.raises(RecordError, match=r"commits-n0\.0\.jsonl:2: .*CommitEntry\.grad_norm: missing"):
        read_commits(tmp_path)


def test_an_error_is_said_in_one_line_even_when_it_says_nothing():
    """What log lines and timing records quote of an error (`error_line`)."""
    from planaria.runtime.contract.logs import error_line

    assert error_line(RuntimeError("CUDA out of memory.\nTried to allocate 2 GiB")) == "CUDA out of memory."
    assert error_line(TimeoutError()) == "TimeoutError"
    assert error_line(ValueError("x" * 500), 300) == "x" * 300
