"""A join's next epoch connected while the job trains (`prepared_groups`, `connect_ahead`):
every worker of the join's epoch enters it over groups connected ahead, nothing lost; a
joiner lost while they connect gives that epoch up, and the job goes on without it,
nothing lost either."""
from __future__ import annotations

import re

import pytest

from tests.chaos.faulted_runs import assert_nothing_lost, chaos

STEPS = 250
"""Enough for both joins on a busy machine: the first joiner's start-up (imports, model,
data) took from 120 to 160 steps of this job, and the second is planned in after it."""


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_join_connects_ahead_and_a_joiner_lost_while_connecting_costs_nothing(tmp_path, cache):
    proc = chaos(["--nodes", "4", "--fault-tolerance", "1", "--fault", "add-node@5", "--fault", "add-node@30",
                  "parallel.min_stages=2", f"train.steps={STEPS}"], tmp_path, cache,
                 env={"PLANARIA_FAULTS": "node5.0:connect@0"})  # the second joiner dies as it connects
    report = assert_nothing_lost(proc, tmp_path, STEPS)
    logs = tmp_path / "out" / "run" / "logs"
    agents = "".join(p.read_text() for p in logs.glob("agent-*.log"))
    workers = {p.stem: p.read_text() for p in logs.glob("node*.log")}
    # The first join: planned before the stop; each of its five workers entered it over
    # groups connected while epoch 0 trained, the joiner among them.
    first = re.search(r"controller: epoch (\d+) \(join; failed -, joined \['node4.0'\]\)[^\n]*planned before the stop",
                      agents)
    assert first, agents[-3000:]
    epoch = int(first[1])
    ahead = [name for name, text in workers.items()
             if f"epoch {epoch}: its groups and its peer-snapshot group were connected ahead" in text]
    assert len(ahead) == 5 and any(name.startswith("node4") for name in ahead), (ahead, agents[-3000:])
    # The second: its joiner was killed as it connected; the epoch was given up at once
    # and planned again from the survivors' statuses (nothing of it was trained).
    assert re.search(r"\['node5\.0'\] gone while the groups of epoch \d+ connected; given up", agents), agents[-3000:]
    add = report["recoveries"][0]
    assert add["fault"].startswith("add-node@5") and add["pause_s"] is not None, add
