"""The agents' Prometheus endpoints (`--metrics-port`, `planaria.elastic.metrics`): scraped
over HTTP on loopback during a real job (real etcd, agents and workers, a node SIGKILLed),
the epoch and the recovery count rise and the dead node's endpoint goes silent. Without
a job: a scrape is not held up by an etcd that hangs, a port in use is refused in one
line, and the example alert rules load and name only metrics that exist."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from planaria.chaos.cluster import LocalCluster
from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
from planaria.elastic.metrics import (PORT_ENV, JobReader, MetricsCollector, MetricsServer, STATES,
                                      agent_port_env)
from tests.elastic.test_status import wait_for
from tests.launch import TINY
from tests.runtime.test_recovery import JOB


ALERTS = Path(__file__).resolve().parents[2] / "examples" / "prometheus-alerts.yaml"


def scrape(endpoint: str) -> dict[str, float] | None:
    """{'name{label="value",...}': value} as Prometheus's own parser reads the endpoint;
    None when nothing answers there."""
    try:
        with urllib.request.urlopen(endpoint, timeout=10) as reply:
            text = reply.read().decode()
    except OSError:  # refused, reset, timed out (URLError is an OSError)
        return None
    return {_series(s.name, s.labels): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _series(name: str, labels: dict[str, str]) -> str:
    return name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports free on 127.0.0.1 (node i serves on BASE + i)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65536:
            continue
        held = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise AssertionError(f"no {count} consecutive free ports on 127.0.0.1")


RECOVERIES = 'planaria_reconfigurations_total{reason="failure"}'


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_each_agent_serves_the_jobs_metrics_across_a_killed_node(tmp_path):
    overrides = [*[o for o in JOB if not o.startswith("train.steps")], "train.steps=100000",
                 "fault_tolerance.f=1", f"output.dir={tmp_path}"]
    base = free_ports(4)
    cluster = LocalCluster(TINY, overrides, nodes=4, nproc=1, out_dir=tmp_path, run_id="metrics-test",
                           metrics_port=base)
    try:
        endpoints = [cluster.metrics_endpoint(i) for i in range(4)]
        assert endpoints == [f"http://127.0.0.1:{base + i}/metrics" for i in range(4)]
        before = [wait_for(lambda e=e: (m := scrape(e)) and "planaria_committed_step" in m and m,
                           f"{e} showing a committed step") for e in endpoints]
        for i, m in enumerate(before):
            assert m[f'planaria_agent_info{{node="node{i}",run_id="metrics-test"}}'] == 1
            assert m["planaria_etcd_reachable"] == 1 and m["planaria_live_workers"] == 1
            assert m["planaria_epoch"] == 0 and m[RECOVERIES] == 0
            assert {s: m[f'planaria_node_state{{state="{s}"}}'] for s in STATES} == {
                s: int(s == "training") for s in STATES}
            assert m["planaria_steps_per_second"] > 0 and m["planaria_last_commit_timestamp_seconds"] > 0
            assert "planaria_last_recovery_seconds" not in m  # none yet

        cluster.kill_node(3)
        wait_for(lambda: scrape(endpoints[3]) is None, "the killed node's endpoint going silent", 30)
        after = [wait_for(lambda e=e, b=b: (m := scrape(e)) and m.get("planaria_epoch", 0) >= 1
                          and m[RECOVERIES] >= 1 and "planaria_last_recovery_seconds" in m
                          and m["planaria_committed_step"] > b["planaria_committed_step"] and m,
                          f"{e} showing the recovery") for e, b in zip(endpoints[:3], before[:3])]
        for m in after:
            assert m["planaria_etcd_reachable"] == 1 and m['planaria_node_state{state="training"}'] == 1
            assert 0 < m["planaria_last_recovery_seconds"] < 120
            assert m['planaria_reconfigurations_total{reason="join"}'] == 0
        assert scrape(endpoints[3]) is None
        # The example alert rules name only metrics that the agents serve.
        served = {name.split("{")[0] for name in after[0]}
        named = {n for rule in _alert_rules() for n in re.findall(r"\bplanaria_\w+", rule["expr"])}
        assert named and named <= served, named - served
    finally:
        cluster.close()


def test_a_scrape_is_not_held_up_by_an_etcd_that_hangs():
    """An etcd that accepts connections and never answers (a member cut off, a frozen
    host): the scrape comes back after its wait, not after the read's 30 s timeout, with
    reachability 0 and this node's own numbers."""
    with socket.create_server(("127.0.0.1", 0)) as hung:  # listens; never accepts nor answers
        etcd = f"127.0.0.1:{hung.getsockname()[1]}"
        reader = JobReader(EtcdClient(EtcdSettings(endpoint=etcd, timeout_s=30.0, retry_s=0.5),
                                      on_outage=lambda line: None), "hung")
        collector = MetricsCollector(reader, run_id="hung", node=lambda: ("n0", "n0"), live_workers=lambda: 2,
                                     log=print, wait_s=0.2)
        server = MetricsServer(collector, "127.0.0.1", 0)
        try:
            for _ in range(2):  # the second scrape finds the first read still under way
                started = time.monotonic()
                m = scrape(server.endpoint)
                assert time.monotonic() - started < 10
                assert m["planaria_etcd_reachable"] == 0 and m["planaria_live_workers"] == 2
                assert all(m[f'planaria_node_state{{state="{s}"}}'] == 0 for s in STATES)
                assert "planaria_epoch" not in m and RECOVERIES not in m  # nothing read: nothing said
        finally:
            server.stop()
    assert scrape(server.endpoint) is None


def test_a_metrics_port_in_use_is_refused_in_one_line(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "planaria.elastic.agent", "--node", "n0", "--etcd", "127.0.0.1:1",
             "--run-id", "taken", "--nnodes", "1", "--metrics-port", str(port), "--log-dir", str(tmp_path),
             str(TINY)], capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--metrics-port {port}: port {port} on 127.0.0.1 is in use" in lines[0], out.stderr
    bad = subprocess.run([sys.executable, "-m", "planaria.elastic.agent", "--node", "n0", "--etcd", "127.0.0.1:1",
                          "--run-id", "bad", "--nnodes", "1", "--log-dir", str(tmp_path), str(TINY)],
                         capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, **{PORT_ENV: "http"}))
    assert bad.returncode == 2 and PORT_ENV in bad.stderr, bad.stderr


def test_planaria_run_gives_each_standalone_agent_its_own_port():
    assert agent_port_env({}, 3) == [{}, {}, {}]
    assert agent_port_env({PORT_ENV: "0"}, 2) == [{}, {}]
    assert agent_port_env({PORT_ENV: "9400"}, 3) == [{PORT_ENV: "9400"}, {PORT_ENV: "9401"}, {PORT_ENV: "9402"}]
    with pytest.raises(ValueError, match="65535 to 65536"):
        agent_port_env({PORT_ENV: "65535"}, 2)
    with pytest.raises(ValueError, match=PORT_ENV):
        agent_port_env({PORT_ENV: "-1"}, 1)


def _alert_rules() -> list[dict]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_the_example_alert_rules_load():
    rules = _alert_rules()
    assert {r["alert"] for r in rules} >= {"PlanariaNoStepCommitted", "PlanariaFrequentRecoveries"}
    for rule in rules:
        assert rule["expr"].strip() and rule["annotations"]["summary"], rule
