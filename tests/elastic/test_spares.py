"""`--nnodes MIN:MAX` with more nodes than MAX: the plan uses MAX, the rest wait as spares
(their workers started), and a spare takes a killed node's place at the recovery; all of
it seen as a person sees it, through `planaria status` (read only): the epoch and the
plan change across the kill, the killed node goes from training to gone."""
from __future__ import annotations

import pytest

from planaria.chaos.cluster import LocalCluster
from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.elastic.status import read_status, render
from tests.elastic.test_status import status_json, wait_for
from tests.launch import TINY
from tests.runtime.test_recovery import JOB


def _states(view: dict) -> dict[str, str]:
    return {n["name"]: n["state"] for n in view["nodes"]}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_nnodes_4_to_5_with_6_nodes_keeps_a_spare_that_replaces_a_killed_node(tmp_path):
    overrides = [*[o for o in JOB if not o.startswith("train.steps")], "train.steps=100000",
                 "fault_tolerance.f=1", f"output.dir={tmp_path}"]
    cluster = LocalCluster(TINY, overrides, nodes=6, nproc=1, out_dir=tmp_path, run_id="spares-test",
                           min_nodes=4, max_nodes=5)
    try:
        def five_and_a_spare():
            view = status_json(cluster, started=False)
            states = sorted(_states(view).values())
            return view["committed_step"] is not None and states == ["spare"] + ["training"] * 5 and view

        before = wait_for(five_and_a_spare, "five nodes training and one spare")
        spare = next(n for n, s in _states(before).items() if s == "spare")
        planned = {s["node"] for p in before["pipelines"] for s in p}
        assert len(planned) == 5 and spare not in planned
        # (any live node may lead, the spare too: it plans, its worker waits)
        assert before["outcome"] is None and before["leader"] in planned | {spare} and before["steps_per_s"] > 0
        assert all(n["renewed_s_ago"] is not None and n["renewed_s_ago"] < 5 for n in before["nodes"])
        # the spare's worker is started and waiting (not a cold start at the recovery)
        assert next(n for n in before["nodes"] if n["name"] == spare)["workers"] == 1

        victim = next(n for n in sorted(planned) if n != before["leader"])
        cluster.kill_node(int(victim.removeprefix("node")))
        after = wait_for(lambda: (s := status_json(cluster))["epoch"] > before["epoch"]
                         and _states(s).get(victim) == "gone" and s["committed_step"] > before["committed_step"]
                         and {p["node"] for q in s["pipelines"] for p in q} == planned - {victim} | {spare} and s,
                         "the spare taking the killed node's place")
        assert sorted(_states(after).values()) == ["gone"] + ["training"] * 5
        recovery = after["recoveries"][-1]
        assert recovery["reason"] == "failure" and recovery["failed"] == [f"{victim}.0"]
        assert recovery["joined"] == [f"{spare}.0"] and recovery["rerun"] == 0
        assert recovery["source"] == "replicas"
        from rich.console import Console

        console = Console(width=200, record=True)
        console.print(render(read_status(EtcdClient(EtcdSettings(endpoint=cluster.etcd.endpoint)), cluster.run_id)))
        shown = console.export_text()
        assert victim in shown and "gone" in shown and f"failed {victim}.0" in shown, shown
    finally:
        cluster.close()
