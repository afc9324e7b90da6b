"""The per-worker logs are named in one place: what a worker writes at `log_path` is
what the chaos report reads back, per worker and in order, and one kind never reads
the other's files."""
from __future__ import annotations

import json

from planaria.chaos.report import read_commits, read_evals
from planaria.runtime.worker_logs import COMMITS, EVALS, log_path


def test_what_a_worker_writes_the_report_reads(tmp_path):
    for worker, n in (("n0.0", 3), ("n1.0", 2)):
        with open(log_path(tmp_path, COMMITS, worker), "a", encoding="utf-8") as f:
            f.writelines(json.dumps({"iteration": i}) + "\n" for i in range(n))
    with open(log_path(tmp_path, EVALS, "n0.0"), "a", encoding="utf-8") as f:
        f.write(json.dumps({"iteration": 1, "val_loss": 2.5}) + "\n")
    assert read_commits(tmp_path) == {"n0.0": [{"iteration": i} for i in range(3)],
                                      "n1.0": [{"iteration": i} for i in range(2)]}
    assert read_evals(tmp_path) == {"n0.0": [{"iteration": 1, "val_loss": 2.5}]}
