"""The simulated cluster's cloud: each node's instance metadata, as EC2 answers it.

A local cluster's agents watch for preemption notices as they would on EC2 spot
instances (`--preemption-notice aws`), each at its own path of one HTTP server on
loopback (`<url>/node<i>`): a session token (`PUT /latest/api/token`), then
`GET /latest/meta-data/spot/instance-action`, 404 until the harness schedules that
node's interruption (`preempt`), then `{"action": "terminate", "time": ...}`. The harness
kills the node at that time if it is still there, as EC2 would. Served with the standard
library's `http.server`: a few fixed answers, nothing a framework would add to.
"""
from __future__ import annotations

import json
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_ACTION = "/latest/meta-data/spot/instance-action"
_TOKEN = "/latest/api/token"


class LocalCloud:
    """One metadata server for every node of a local cluster (module docstring)."""

    def __init__(self):
        self._deadlines: dict[str, float] = {}
        self._lock = threading.Lock()
        cloud = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self):
                node, _, path = self.path.lstrip("/").partition("/")
                self._answer(200 if "/" + path == _TOKEN else 404, f"token-{node}")

            def do_GET(self):
                node, _, path = self.path.lstrip("/").partition("/")
                deadline = cloud.deadline(node)
                if "/" + path != _ACTION or deadline is None:
                    self._answer(404, "Not Found")
                    return
                when = datetime.fromtimestamp(deadline, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                self._answer(200, json.dumps({"action": "terminate", "time": when}))

            def _answer(self, status: int, text: str) -> None:
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True, name="local-cloud").start()

    def endpoint(self, node: str) -> str:
        """The metadata address node `node`'s agent is given (`--preemption-endpoint`)."""
        return f"{self.url}/{node}"

    def preempt(self, node: str, deadline: float) -> None:
        """Schedule `node`'s interruption at `deadline` (wall clock); its metadata says so
        from now on. EC2 gives the time to the second: it is rounded down, so that the
        node's own deadline is never later than the harness's kill."""
        with self._lock:
            self._deadlines[node] = float(int(deadline))

    def deadline(self, node: str) -> float | None:
        with self._lock:
            return self._deadlines.get(node)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
