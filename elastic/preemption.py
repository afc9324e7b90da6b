"""Preemption notices: what the clouds and schedulers say before they take a node away.

Spot and preemptible machines rarely vanish unannounced. A node's agent watches one
source (`--preemption-notice`) and turns what it says into a `Notice`: which source,
and the moment the node will be gone (its deadline).

- `signal`: the signals of `--signals-to-handle` (SIGTERM first: what Kubernetes and
  Slurm send, then SIGKILL after their grace period) mean "gone in `--preemption-grace`
  seconds" rather than "stop now". Made by the agent's signal handler (`signal_notice`).
- `aws`: EC2's instance metadata (IMDSv2): a session token (`PUT /latest/api/token`),
  then `GET /latest/meta-data/spot/instance-action`: 404 while no interruption is
  scheduled, else `{"action": "terminate"|"stop"|"hibernate", "time": ISO-8601 UTC}`,
  about two minutes ahead.
- `gcp`: Compute Engine's metadata server, `GET /computeMetadata/v1/instance/preempted`
  with `Metadata-Flavor: Google`: `FALSE`, then `TRUE` once the VM is being preempted,
  which leaves it 30 s before the ACPI shutdown. Asked with `wait_for_change` (a hanging
  GET that returns when the value changes, or after `timeout_sec`), so the notice is
  seen at once without polling hard.
- `azure`: the Instance Metadata Service's Scheduled Events, `GET
  /metadata/scheduledevents` with `Metadata: true`: a `Preempt` event naming this VM in
  its `Resources`, with `NotBefore` (RFC 1123) at least 30 s ahead. Once the node has
  left, the agent acknowledges the event (`POST` of its `EventId` in `StartRequests`) so
  that Azure need not wait for `NotBefore`.

A notice can be withdrawn: a scheduled event cleared, an instance action gone again (a
Kubernetes pod that was not terminated after all gets no signal, so a signal notice is
never withdrawn). A watcher returns the notice pending now, or None; the agent compares
with what it returned before.

Every address is a setting whose default is the cloud's documented one; the tests point
them at local servers. A watcher that cannot reach its endpoint says so once (and again
when it can) and goes on; an answer it cannot read is logged once per distinct answer
and ignored, never a crash. Hand-written over `urllib` rather than a cloud SDK: three
small documented HTTP calls, and no SDK covers all three.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Callable

SOURCES = ("signal", "aws", "gcp", "azure")
DEFAULT_ENDPOINTS = {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal",
                     "azure": "http://169.254.169.254"}
"""Each cloud's documented metadata address (link-local, or the name the cloud's DNS
resolves inside the VM): reachable only from inside an instance of that cloud."""
GCP_NOTICE_S = 30.0
"""Compute Engine's notice: the ACPI shutdown comes 30 s after `preempted` turns TRUE."""
AZURE_API = "2020-07-01"


@dataclass(frozen=True)
class Notice:
    """The node will be gone at `deadline` (seconds since the epoch), says `source`."""

    source: str
    deadline: float
    detail: str = ""

    def left_s(self, now: float | None = None) -> float:
        return self.deadline - (time.time() if now is None else now)


def signal_notice(name: str, grace_s: float, now: float | None = None) -> Notice:
    """A signal such as SIGTERM, read as "gone in `grace_s` seconds"."""
    now = time.time() if now is None else now
    return Notice(source=f"signal {name}", deadline=now + grace_s, detail=f"{name}, {grace_s:g} s of grace")


class MalformedAnswer(ValueError):
    """An answer of the metadata server that is not what its documentation says."""


# ------------------------------------------------------------------ answers
def parse_aws(status: int, body: str) -> Notice | None:
    """`spot/instance-action`: 404 is none pending; 200 carries the action and its time."""
    if status == 404:
        return None
    if status != 200:
        raise MalformedAnswer(f"HTTP {status}")
    try:
        answer = json.loads(body)
        action, when = answer["action"], answer["time"]
        deadline = datetime.fromisoformat(when.replace("Z", "+00:00"))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise MalformedAnswer(f"{body[:200]!r}: {err}") from None
    if deadline.tzinfo is None:
        deadline = deadline.replace(tzinfo=timezone.utc)
    return Notice(source="aws", deadline=deadline.timestamp(), detail=f"spot instance-action {action} at {when}")


def parse_gcp(status: int, body: str, first_seen: float) -> Notice | None:
    """`instance/preempted`: FALSE, or TRUE (30 s from when it turned TRUE)."""
    if status != 200:
        raise MalformedAnswer(f"HTTP {status}")
    value = body.strip().upper()
    if value == "FALSE":
        return None
    if value == "TRUE":
        return Notice(source="gcp", deadline=first_seen + GCP_NOTICE_S, detail="instance/preempted TRUE")
    raise MalformedAnswer(repr(body[:200]))


def parse_azure(status: int, body: str, vm_name: str | None) -> tuple[Notice | None, str | None]:
    """Scheduled events: (the `Preempt` event for this VM as a notice, its EventId).
    With no VM name known, any Preempt event counts (better leave for another's)."""
    if status != 200:
        raise MalformedAnswer(f"HTTP {status}")
    try:
        events = json.loads(body)["Events"]
        mine = [e for e in events if e["EventType"] == "Preempt"
                and (vm_name is None or vm_name in e.get("Resources", []))]
        if not mine:
            return None, None
        event = mine[0]
        not_before = event.get("NotBefore") or ""
        deadline = parsedate_to_datetime(not_before).timestamp() if not_before else time.time()
        return (Notice(source="azure", deadline=deadline,
                       detail=f"scheduled event Preempt {event['EventId']} ({event.get('EventStatus', '?')})"),
                event["EventId"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise MalformedAnswer(f"{body[:200]!r}: {err}") from None


# ----------------------------------------------------------------- watchers
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Metadata is asked directly, never through an HTTP proxy of the environment (the clouds
say so: a proxy would answer for itself, or not at all)."""


class _Watcher:
    """What every cloud's watcher shares: HTTP with a timeout, and saying things once."""

    source = ""

    def __init__(self, endpoint: str | None = None, *, timeout_s: float = 2.0,
                 log: Callable[[str], None] = print):
        self.endpoint = (endpoint or DEFAULT_ENDPOINTS[self.source]).rstrip("/")
        self.timeout_s = timeout_s
        self.log = log
        self._unreachable = False
        self._malformed: set[str] = set()
        self.answered = False
        """Whether the last `poll` had an answer as documented."""

    def _request(self, method: str, path: str, headers: dict[str, str], data: bytes | None = None,
                 timeout_s: float | None = None) -> tuple[int, str, dict]:
        request = urllib.request.Request(self.endpoint + path, data=data, headers=headers, method=method)
        try:
            with _DIRECT.open(request, timeout=timeout_s or self.timeout_s) as answer:
                return answer.status, answer.read().decode(errors="replace"), dict(answer.headers)
        except urllib.error.HTTPError as err:  # an answer all the same (404: nothing pending)
            return err.code, err.read().decode(errors="replace"), dict(err.headers or {})

    def poll(self) -> Notice | None:
        """The notice pending now, or None (none, or the endpoint could not say: then
        `answered` is False, and a notice seen before is not to be taken as withdrawn)."""
        self.answered = False
        try:
            notice = self._poll()
        except (urllib.error.URLError, OSError) as err:
            if not self._unreachable:
                self._unreachable = True
                self.log(f"preemption notices ({self.source}): {self.endpoint} unreachable "
                         f"({getattr(err, 'reason', err)}); watching on, without notices meanwhile")
            return None
        except MalformedAnswer as err:
            if str(err) not in self._malformed:
                self._malformed.add(str(err))
                self.log(f"preemption notices ({self.source}): an answer not as documented, ignored: {err}")
            return None
        if self._unreachable:
            self._unreachable = False
            self.log(f"preemption notices ({self.source}): {self.endpoint} answers again")
        self.answered = True
        return notice

    def _poll(self) -> Notice | None:
        raise NotImplementedError

    def acknowledge(self, notice: Notice) -> None:
        """Tell the cloud the node has left (only Azure asks for it)."""


class AwsWatcher(_Watcher):
    """EC2 spot interruption notices over IMDSv2 (module docstring)."""

    source = "aws"
    TOKEN_TTL_S = 21600

    def __init__(self, endpoint: str | None = None, **kwargs):
        super().__init__(endpoint, **kwargs)
        self._token: str | None = None
        self._token_until = 0.0

    def _session_token(self) -> str:
        if self._token is None or time.time() > self._token_until:
            status, body, _ = self._request("PUT", "/latest/api/token",
                                            {"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL_S)})
            if status != 200 or not body.strip():
                raise MalformedAnswer(f"session token: HTTP {status} {body[:100]!r}")
            self._token, self._token_until = body.strip(), time.time() + self.TOKEN_TTL_S / 2
        return self._token

    def _poll(self) -> Notice | None:
        status, body, _ = self._request("GET", "/latest/meta-data/spot/instance-action",
                                        {"X-aws-ec2-metadata-token": self._session_token()})
        if status == 401:  # the token expired early (an instance stopped and started): a new one
            self._token = None
            status, body, _ = self._request("GET", "/latest/meta-data/spot/instance-action",
                                            {"X-aws-ec2-metadata-token": self._session_token()})
        return parse_aws(status, body)


class GcpWatcher(_Watcher):
    """Compute Engine preemption over `instance/preempted` (module docstring)."""

    source = "gcp"

    def __init__(self, endpoint: str | None = None, *, wait_s: int = 10, **kwargs):
        super().__init__(endpoint, **kwargs)
        self.wait_s = wait_s
        self._etag: str | None = None
        self._first_seen: float | None = None

    def _poll(self) -> Notice | None:
        path = "/computeMetadata/v1/instance/preempted"
        if self._etag is not None:  # a hanging GET: returns when the value changes
            path += f"?wait_for_change=true&timeout_sec={self.wait_s}&last_etag={self._etag}"
        status, body, headers = self._request("GET", path, {"Metadata-Flavor": "Google"},
                                              timeout_s=self.wait_s + self.timeout_s)
        self._etag = next((v for k, v in headers.items() if k.lower() == "etag"), None)
        if body.strip().upper() == "TRUE" and self._first_seen is None:
            self._first_seen = time.time()
        elif body.strip().upper() == "FALSE":
            self._first_seen = None
        return parse_gcp(status, body, self._first_seen or time.time())


class AzureWatcher(_Watcher):
    """Azure Scheduled Events of type Preempt for this VM (module docstring)."""

    source = "azure"

    def __init__(self, endpoint: str | None = None, **kwargs):
        super().__init__(endpoint, **kwargs)
        self._vm_name: str | None = None
        self._event: str | None = None

    def _poll(self) -> Notice | None:
        if self._vm_name is None:
            status, body, _ = self._request(
                "GET", "/metadata/instance/compute/name?api-version=2021-02-01&format=text", {"Metadata": "true"})
            if status == 200 and body.strip():
                self._vm_name = body.strip()
        status, body, _ = self._request("GET", f"/metadata/scheduledevents?api-version={AZURE_API}",
                                        {"Metadata": "true"})
        notice, self._event = parse_azure(status, body, self._vm_name)
        return notice

    def acknowledge(self, notice: Notice) -> None:
        if self._event is None:
            return
        data = json.dumps({"StartRequests": [{"EventId": self._event}]}).encode()
        try:
            status, body, _ = self._request("POST", f"/metadata/scheduledevents?api-version={AZURE_API}",
                                            {"Metadata": "true", "Content-Type": "application/json"}, data)
        except (urllib.error.URLError, OSError) as err:
            self.log(f"preemption notices (azure): could not acknowledge event {self._event}: "
                     f"{getattr(err, 'reason', err)}")
            return
        if status != 200:
            self.log(f"preemption notices (azure): acknowledging event {self._event}: HTTP {status} {body[:200]}")


WATCHERS = {"aws": AwsWatcher, "gcp": GcpWatcher, "azure": AzureWatcher}


def make_watcher(source: str, endpoint: str | None = None, *,
                 log: Callable[[str], None] = print) -> _Watcher | None:
    """The watcher of `source` (None for `signal`: the agent's signal handler is it)."""
    if source not in SOURCES:
        raise ValueError(f"unknown preemption notice source {source!r}: choose one of {', '.join(SOURCES)}")
    if source == "signal":
        if endpoint:
            raise ValueError("--preemption-endpoint is for the cloud sources (aws, gcp, azure), not signal")
        return None
    return WATCHERS[source](endpoint, log=log)
