"""Preemption notice watchers against local HTTP servers that answer as each cloud's
documentation says (pending, none pending, malformed, unreachable, withdrawn). Nothing
here contacts a real metadata address: every watcher is given a loopback endpoint."""
from __future__ import annotations

import json
import socket
import threading
import time
from email.utils import format_datetime
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from planaria.elastic.preemption import (GCP_NOTICE_S, AwsWatcher, AzureWatcher, GcpWatcher, make_watcher,
                                         signal_notice)


class Metadata:
    """A local metadata server: `routes[(method, path)] = (status, body, headers)`,
    changed by the test while it runs; `requests` records (method, path, headers with
    lower-case names, body)."""

    def __init__(self):
        self.routes: dict[tuple[str, str], tuple[int, str, dict]] = {}
        self.requests: list[tuple[str, str, dict, bytes]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                owner.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                path = self.path.split("?")[0]
                status, text, headers = owner.routes.get((self.command, path), (404, "Not Found", {}))
                data = text.encode()
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def metadata():
    server = Metadata()
    yield server
    server.close()


@pytest.fixture
def said():
    return []


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# ---------------------------------------------------------------------- AWS
def test_aws_pending_none_withdrawn_and_the_token(metadata, said):
    metadata.routes[("PUT", "/latest/api/token")] = (200, "TOKEN-1", {})
    watcher = AwsWatcher(metadata.url, log=said.append)
    assert watcher.poll() is None  # 404: nothing scheduled
    when = datetime.fromtimestamp(time.time() + 120, tz=timezone.utc).replace(microsecond=0)
    metadata.routes[("GET", "/latest/meta-data/spot/instance-action")] = (
        200, json.dumps({"action": "terminate", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}), {})
    notice = watcher.poll()
    assert notice.source == "aws" and notice.deadline == when.timestamp() and 110 < notice.left_s() <= 120
    assert "terminate" in notice.detail
    del metadata.routes[("GET", "/latest/meta-data/spot/instance-action")]
    assert watcher.poll() is None  # withdrawn
    # IMDSv2: one PUT for the session token, its value on every GET.
    puts = [r for r in metadata.requests if r[0] == "PUT"]
    assert len(puts) == 1 and puts[0][2]["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    gets = [r for r in metadata.requests if r[0] == "GET"]
    assert len(gets) == 3 and all(r[2]["x-aws-ec2-metadata-token"] == "TOKEN-1" for r in gets)
    assert said == []


def test_aws_malformed_answers_are_logged_once_and_ignored(metadata, said):
    metadata.routes[("PUT", "/latest/api/token")] = (200, "T", {})
    metadata.routes[("GET", "/latest/meta-data/spot/instance-action")] = (200, "{not json", {})
    watcher = AwsWatcher(metadata.url, log=said.append)
    assert watcher.poll() is None and watcher.poll() is None
    assert len(said) == 1 and "not as documented" in said[0]
    metadata.routes[("GET", "/latest/meta-data/spot/instance-action")] = (200, json.dumps({"action": "stop"}), {})
    assert watcher.poll() is None and len(said) == 2  # a new malformed answer is said too


# ---------------------------------------------------------------------- GCP
def test_gcp_waits_for_a_change_and_gives_thirty_seconds(metadata, said):
    route = ("GET", "/computeMetadata/v1/instance/preempted")
    metadata.routes[route] = (200, "FALSE", {"ETag": "e1"})
    watcher = GcpWatcher(metadata.url, wait_s=1, log=said.append)
    assert watcher.poll() is None
    metadata.routes[route] = (200, "TRUE", {"ETag": "e2"})
    before = time.time()
    notice = watcher.poll()
    assert notice.source == "gcp" and before + GCP_NOTICE_S - 1 <= notice.deadline <= time.time() + GCP_NOTICE_S
    assert watcher.poll().deadline == notice.deadline  # the same notice, not a later one
    first, second = [r for r in metadata.requests if r[0] == "GET"][:2]
    assert first[2]["metadata-flavor"] == "Google" and "wait_for_change" not in first[1]
    assert "wait_for_change=true" in second[1] and "last_etag=e1" in second[1]
    metadata.routes[route] = (200, "FALSE", {"ETag": "e3"})
    assert watcher.poll() is None and said == []


def test_gcp_malformed_answer_is_ignored(metadata, said):
    metadata.routes[("GET", "/computeMetadata/v1/instance/preempted")] = (200, "MAYBE", {})
    assert GcpWatcher(metadata.url, wait_s=1, log=said.append).poll() is None
    assert len(said) == 1 and "'MAYBE'" in said[0]


# -------------------------------------------------------------------- Azure
def _events(*events) -> str:
    return json.dumps({"DocumentIncarnation": len(events), "Events": list(events)})


def _preempt(event_id: str, resources: list[str], seconds: float) -> dict:
    not_before = format_datetime(datetime.fromtimestamp(time.time() + seconds, tz=timezone.utc).replace(
        microsecond=0), usegmt=True)
    return {"EventId": event_id, "EventType": "Preempt", "ResourceType": "VirtualMachine",
            "Resources": resources, "EventStatus": "Scheduled", "NotBefore": not_before,
            "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}


def test_azure_preempt_for_this_vm_then_acknowledged(metadata, said):
    metadata.routes[("GET", "/metadata/instance/compute/name")] = (200, "vm-7", {})
    events = ("GET", "/metadata/scheduledevents")
    metadata.routes[events] = (200, _events(), {})
    watcher = AzureWatcher(metadata.url, log=said.append)
    assert watcher.poll() is None
    # Another VM's preemption (and a reboot of this one) are not this node's notice.
    metadata.routes[events] = (200, _events(_preempt("a", ["vm-3"], 30),
                                            {**_preempt("b", ["vm-7"], 30), "EventType": "Reboot"}), {})
    assert watcher.poll() is None
    metadata.routes[events] = (200, _events(_preempt("c", ["vm-3", "vm-7"], 30)), {})
    notice = watcher.poll()
    assert notice.source == "azure" and 25 < notice.left_s() <= 30 and "c" in notice.detail
    metadata.routes[("POST", "/metadata/scheduledevents")] = (200, "", {})
    watcher.acknowledge(notice)
    (post,) = [r for r in metadata.requests if r[0] == "POST"]
    assert json.loads(post[3]) == {"StartRequests": [{"EventId": "c"}]} and post[2]["metadata"] == "true"
    assert all(r[2]["metadata"] == "true" for r in metadata.requests)
    metadata.routes[events] = (200, _events(), {})
    assert watcher.poll() is None and said == []  # withdrawn (cleared)


def test_azure_malformed_events_are_ignored(metadata, said):
    metadata.routes[("GET", "/metadata/scheduledevents")] = (200, json.dumps({"Events": [{"EventType": "Preempt"}]}),
                                                             {})
    assert AzureWatcher(metadata.url, log=said.append).poll() is None
    assert len(said) == 1 and "not as documented" in said[0]


# --------------------------------------------------------------- all of them
@pytest.mark.parametrize("watcher", [AwsWatcher, GcpWatcher, AzureWatcher])
def test_an_unreachable_endpoint_is_said_once_then_its_return(watcher, metadata, said):
    w = watcher(closed_port(), timeout_s=0.5, log=said.append)
    assert w.poll() is None and w.poll() is None
    assert not w.answered  # "could not say": a notice seen before is not withdrawn by it
    assert len(said) == 1 and "unreachable" in said[0] and "watching on" in said[0]
    w.endpoint = metadata.url  # as if the metadata server came back
    metadata.routes[("PUT", "/latest/api/token")] = (200, "T", {})
    metadata.routes[("GET", "/computeMetadata/v1/instance/preempted")] = (200, "FALSE", {})
    metadata.routes[("GET", "/metadata/scheduledevents")] = (200, _events(), {})
    assert w.poll() is None and w.answered  # "none pending", said by the cloud
    assert len(said) == 2 and "answers again" in said[1]


def test_the_signal_source_and_bad_sources():
    notice = signal_notice("SIGTERM", 30, now=1000.0)
    assert notice.deadline == 1030.0 and notice.source == "signal SIGTERM"
    assert make_watcher("signal") is None
    assert isinstance(make_watcher("gcp", "http://127.0.0.1:9"), GcpWatcher)
    with pytest.raises(ValueError, match=r"unknown preemption notice source 'ibm': choose one of signal, aws"):
        make_watcher("ibm")
    with pytest.raises(ValueError, match="not signal"):
        make_watcher("signal", "http://127.0.0.1:9")


# ---------------------------------------------------------- end to end
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_node_told_by_its_cloud_leaves_at_a_step_boundary_and_nothing_is_lost(etcd, metadata, tmp_path):
    """Four agents on etcd; node3's watches an EC2 metadata server (this test's, on
    loopback). Once the job trains, the server schedules node3's termination far ahead,
    then withdraws it (node3 stays), then schedules it 14 s ahead (acted on at once: the
    leave window is about 13 s here): node3 leaves at a step boundary (a planned leave: nobody failed, no step
    trained twice) and its agent exits 0, long before the deadline; the job finishes
    with the losses of a run without faults."""
    from tests.elastic.test_agents import JOB, OVERRIDES, Job
    from tests.launch import reference_run
    from tests.runtime.test_recovery import check_against_reference

    metadata.routes[("PUT", "/latest/api/token")] = (200, "TOKEN", {})
    steps = ["train.steps=150"]
    # The notice, its withdrawal and the second notice each wait for the agent's next
    # look at its metadata (every 2 s): node0.0 (never noticed) sleeps 0.06 s at each
    # step, so that the 150 steps outlast them however fast the machine (unpaced, they
    # had ended in 5 s on one where the demo job steps in 0.03 s, before the leave).
    pace = {"node0": {"PLANARIA_FAULTS": "node0.0:step@*!slow=0.06"}}
    job = Job(etcd, tmp_path, 4, [*OVERRIDES, *steps], run_id="aws-notice", env=pace,
              node_args={"node3": ("--preemption-notice", "aws", "--preemption-endpoint", metadata.url)})
    action = ("GET", "/latest/meta-data/spot/instance-action")

    def announce(in_s: float) -> None:
        when = datetime.fromtimestamp(time.time() + in_s, tz=timezone.utc)
        metadata.routes[action] = (200, json.dumps({"action": "terminate",
                                                    "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}), {})

    def agent_says(text: str) -> None:
        deadline = time.monotonic() + 60
        while text not in (tmp_path / "logs" / "agent-node3.log").read_text():
            assert time.monotonic() < deadline, f"node3's agent never said {text!r}\n{job.logs()}"
            time.sleep(0.1)
    try:
        job.wait_for_commits(2)
        announce(600)
        agent_says("preemption notice (")
        del metadata.routes[action]  # withdrawn: 404 again
        agent_says("was withdrawn; this node stays in the job")
        announce(14)
        codes = job.wait()
    finally:
        job.close()
    logs = job.logs(tail=10**6)
    assert codes == {"node0": 0, "node1": 0, "node2": 0, "node3": 0}, f"{codes}\n{logs}"
    assert "preemption notice (" in logs and "this node's workers have left; the node leaves the job" in logs
    assert "(leave; failed -, joined -; left ['node3'])" in logs, logs
    assert logs.count("(leave; failed -, joined -; left ['node3'])") == 1
    check_against_reference(tmp_path, reference_run([*JOB, *steps]), job, steps=150)
