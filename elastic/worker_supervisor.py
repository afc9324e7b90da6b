"""A node's workers, as its agent runs them: started, watched, reaped, started again,
killed when frozen or asked to, stopped when the node leaves (docs/control_plane.md).

    alive/<node>.<local>    a live worker, bound to the agent's lease, deleted when it exits
    kill/<node>.<local>     the leader asks the worker's agent to SIGKILL it

Workers run `python -m planaria.train CONFIG ...` with PLANARIA_STORE pointing at the
store in etcd (and etcd's TLS and credentials in PLANARIA_ETCD_*, the node's address in
PLANARIA_NODE_ADDRESS, where an epoch's rank 0 hosts its bootstrap store), and die with their
agent (PR_SET_PDEATHSIG): a killed agent takes its node out, as a dead machine would.
They get torchrun's TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT,
TORCHELASTIC_MAX_RESTARTS and TORCHELASTIC_ERROR_FILE; a worker that dies of an uncaught
exception writes it there (torch's `record`), and its exit is reported with it.

Started again (`restart`, with `--max-restarts N`, up to N times), the workers join as
new capacity under a new name, `<node>~<restart>` (`member`): the leader sees a node
join, and a worker is never mistaken for its predecessor (whose kill requests, statuses
and commit log stay its own). A worker that asks to be started again
(`EXIT_STUCK_AFTER_RELEASE`), and one its agent killed for hanging (stopped, its
heartbeat silent, or stuck in a step: runtime/worker/progress_watch.py), are not counted against --max-restarts (`reset_asked`), up to
`MAX_RESETS` and `MAX_HANG_RESTARTS` times: the machine is sound, and the node joins again
rather than leaving the job for good.

`WorkerSupervisor` owns the workers' processes, their output and error files and their
heartbeat files; whether an exit makes the node restart or leave is the agent's call.
Imports no torch (a node's agent loads it).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from planaria.elastic.etcd_client import LeaseExpired
from planaria.elastic.etcd_kv import EtcdKeyValue
from planaria.elastic.process_state import is_stopped
from planaria.elastic.worker_output import (OutputSpec, Tail, WorkerStreams, close_files, open_streams,
                                            start_tails)
from planaria.runtime.config.sections import CommConfig
from planaria.runtime.contract import env as worker_env, keys
from planaria.runtime.contract.exits import EXIT_STUCK_AFTER_RELEASE
from planaria.runtime.contract.heartbeat import silent_for, stalled
from planaria.runtime.contract.keys import worker_key
from planaria.templates.plan import Worker

MAX_RESETS = 5
"""Workers started again because they asked (`reset_asked`), at most, on top of --max-restarts."""
MAX_HANG_RESTARTS = 3
"""Workers started again after one of them hung (`reset_asked`), at most, on top of
--max-restarts: a node whose workers keep hanging leaves the job."""


class WorkerSupervisor:
    """The processes of one node's workers, and what its agent does to them."""

    def __init__(self, *, node: str, nproc: int, store: EtcdKeyValue, lease: Callable[[], object],
                 store_url: str, etcd_env: dict[str, str], run_id: str, config: str, overrides: list[str],
                 comm: CommConfig, max_restarts: int, shutdown_timeout_s: float, log_dir: Path | None,
                 output: OutputSpec | None, log: Callable[[str], None]):
        """`store`: the job's keys (its client binds the `alive/` keys); `lease`: the agent's
        lease in force; `store_url` and `etcd_env`: how the workers reach the store."""
        self.node, self.nproc, self.run_id = node, nproc, run_id
        self.store, self.client, self.prefix, self.lease = store, store.client, store.prefix, lease
        self.store_url, self.etcd_env = store_url, etcd_env
        self.config, self.overrides, self.comm = config, overrides, comm
        self.max_restarts, self.restarts, self.resets = max_restarts, 0, 0
        self.shutdown_timeout_s = shutdown_timeout_s
        self.log = log
        self.log_dir = Path(log_dir) if log_dir else None
        """Worker output goes here, a file per worker; None: to the agent's own output."""
        self.output = output
        """torchrun's --log-dir, -r, -t and --local-ranks-filter (`worker_output`); None: as
        `log_dir` says."""
        self.error_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"planaria-{node}-")) / "errors"
        self.workers: dict[Worker, subprocess.Popen] = {}
        self._streams: dict[Worker, WorkerStreams] = {}
        self._tails: list[Tail] = []
        self._exited: set[Worker] = set()
        self._stopped_since: dict[Worker, float] = {}
        """When each worker was first seen stopped (`kill_frozen`)."""
        self.hung: set[Worker] = set()
        """Workers killed for hanging, until the node's workers are started again."""
        self.hang_restarts = 0
        self.node_address: str | None = None
        """The address the other nodes reach this one at (the agent's `node_address`), given
        to the workers: the plan's rank 0 hosts an epoch's bootstrap store there."""

    @property
    def member(self) -> str:
        """The name this node's workers have in the job: the node's, then `<node>~<restart>`."""
        return self.node if self.restarts == 0 else f"{self.node}~{self.restarts}"

    # ------------------------------------------------------------ starting
    def start(self) -> None:
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        for local in range(self.nproc):
            self._spawn((self.member, local))

    def restart(self, reset: bool = False) -> None:
        """Stop what is left of this node's workers, then start them again as new capacity
        (`reset`: one asked to be, or hung: `reset_asked`)."""
        hung = bool(self.hung)
        self.stop(signal.SIGKILL)
        self.reap()
        self.restarts += 1
        self.workers.clear()
        self.hung.clear()
        self._stopped_since.clear()
        if reset and hung:
            why = (f"a worker hung: restart {self.hang_restarts} of {MAX_HANG_RESTARTS} after a hang, "
                   "not counted against --max-restarts")
        elif reset:
            why = (f"a worker's collectives stayed blocked after their release: reset {self.resets} of "
                   f"{MAX_RESETS}, not counted against --max-restarts")
        else:
            free = self.resets + self.hang_restarts
            why = f"restart {self.restarts - free} of {self.max_restarts - free}"
        self.log(f"restarting this node's workers ({why}); they join the job as {self.member}")
        self.start()

    def reset_asked(self) -> bool:
        """A worker exited asking to be started again (`EXIT_STUCK_AFTER_RELEASE`: its
        collectives stayed blocked after their release), up to `MAX_RESETS` times, or
        was killed for hanging (`kill_frozen`), up to `MAX_HANG_RESTARTS` times: not a
        failure of the node, so not counted against --max-restarts."""
        if self.hung:
            if self.hang_restarts >= MAX_HANG_RESTARTS:
                return False
            self.hang_restarts += 1
            self.max_restarts += 1  # this restart is not one of the user's
            return True
        asked = any(p.returncode == EXIT_STUCK_AFTER_RELEASE for p in self.workers.values())
        if asked and self.resets < MAX_RESETS:
            self.resets += 1
            self.max_restarts += 1  # this restart is not one of the user's
            return True
        return False

    def _error_file(self, worker: Worker) -> Path:
        if worker in self._streams:
            return self._streams[worker].error_file
        return self.error_dir / worker_key(worker) / "error.json"

    def _heartbeat_file(self, worker: Worker) -> Path:
        return self.error_dir / worker_key(worker) / "heartbeat"

    def _spawn(self, worker: Worker) -> None:
        streams = None
        if self.output is not None:
            streams = self._streams[worker] = open_streams(self.output, worker[1], self.restarts)
        error_file = self._error_file(worker)
        error_file.parent.mkdir(parents=True, exist_ok=True)
        self._heartbeat_file(worker).parent.mkdir(parents=True, exist_ok=True)  # (apart with --run-log-dir)
        error_file.unlink(missing_ok=True)
        self._heartbeat_file(worker).unlink(missing_ok=True)
        env = dict(os.environ, **worker_env.for_worker(self.store_url, worker), PYTHONUNBUFFERED="1",
                   **{worker_env.DIE_WITH_AGENT: "1"}, TORCHELASTIC_RUN_ID=self.run_id,
                   TORCHELASTIC_RESTART_COUNT=str(self.restarts),
                   TORCHELASTIC_MAX_RESTARTS=str(self.max_restarts),
                   TORCHELASTIC_ERROR_FILE=str(error_file), **self.etcd_env,
                   **{worker_env.HEARTBEAT_FILE: str(self._heartbeat_file(worker))})
        if self.node_address:
            env[worker_env.NODE_ADDRESS] = self.node_address
        if self.restarts:  # an injected fault fires in the first incarnation only
            env.pop(worker_env.FAULTS, None)
        env.setdefault("OMP_NUM_THREADS", "1")
        # NCCL's own error handling must never end a survivor; warned about once, by the worker.
        worker_env.nccl_recovery(env, self.comm.timeout_s)
        out = err = None  # inherit: the worker's lines (prefixed with its name) in the agent's output
        if streams is not None:
            out, err = streams.stdout, streams.stderr
        elif self.log_dir is not None:
            out, err = open(self.log_dir / f"{worker_key(worker)}.log", "a", encoding="utf-8"), subprocess.STDOUT
        self.workers[worker] = process = subprocess.Popen(
            [sys.executable, "-m", "planaria.train", self.config, *self.overrides], stdout=out, stderr=err, env=env)
        if streams is not None:
            close_files(streams)
            self._tails += start_tails(streams, self.output.rank_offset + worker[1], process)
        self._put_alive(worker)

    def _put_alive(self, worker: Worker) -> None:
        """A started worker's `alive/` key, under the lease. A lease that expired meanwhile
        does not keep the node's other workers from starting: the keep-alive thread sees
        it, and the agent registers again, putting every running worker's key again
        (`put_alive_keys`)."""
        try:
            self.client.put(self.prefix + keys.alive(worker), b"1", lease=self.lease())
        except LeaseExpired:
            self.log(f"worker {worker_key(worker)} started while this node's lease had expired; "
                     "its key is written when the node registers again")

    def put_alive_keys(self) -> None:
        """The running workers' `alive/` keys, again, under the lease in force (registered
        again after a lease expired: the old keys went with it)."""
        for worker in self.running():
            self.client.put(self.prefix + keys.alive(worker), b"1", lease=self.lease())

    # ------------------------------------------------------------ watching
    def running(self) -> list[Worker]:
        return [w for w, p in self.workers.items() if p.poll() is None]

    def exited(self) -> set[Worker]:
        """Workers whose process has ended, reaped or not."""
        return {w for w, proc in self.workers.items() if proc.poll() is not None}

    def live_workers(self) -> int:
        """Running workers, for a scrape's thread: a copy of the processes (the loop may be
        changing the dict), their state as the loop last polled it (a tick ago)."""
        return sum(p.returncode is None for p in list(self.workers.values()))

    def kill_frozen(self) -> None:
        """SIGKILL a worker that hangs: stopped (its process state) for
        `comm.stopped_timeout_s`, its heartbeat silent for `comm.heartbeat_timeout_s`
        (runtime/contract/heartbeat.py: frozen, swapping, stuck in the kernel), or, by its
        heartbeat, stalled within a step outside any collective past its bound (stuck in a
        kernel or a deadlock: runtime/worker/progress_watch.py). Any of them would hold the
        job up until the leader's status timeout; dead, it is a failure like any other,
        seen at once."""
        limit = self.comm.heartbeat_timeout_s or self.comm.timeout_s
        now = time.time()
        for worker, proc in self.workers.items():
            if proc.poll() is not None:
                continue
            stopped = self._stopped_for(worker, proc, now)
            silent = silent_for(self._heartbeat_file(worker), now)
            stall = stalled(self._heartbeat_file(worker))
            if self.comm.stopped_timeout_s and stopped >= self.comm.stopped_timeout_s:
                why = f"stopped for {stopped:.1f} s"
            elif silent is not None and silent > limit:
                why = f"froze (no heartbeat for {silent:.0f} s)"
            elif stall is not None and stall[0] > stall[1]:
                why = (f"is stuck: no progress in its step for {stall[0]:.1f} s, outside any collective "
                       f"(its bound: {stall[1]:.1f} s, comm.stuck_factor x its median step, at least "
                       f"comm.stuck_floor_s)")
            else:
                continue
            self.log(f"worker {worker_key(worker)} {why}; killing it")
            proc.kill()
            proc.wait()
            self.hung.add(worker)

    def _stopped_for(self, worker: Worker, proc, now: float) -> float:
        """Seconds since the worker was first seen stopped at a look (0: running)."""
        if not is_stopped(proc.pid):
            self._stopped_since.pop(worker, None)
            return 0.0
        return now - self._stopped_since.setdefault(worker, now)

    def reap(self) -> bool:
        """Delete the alive keys of exited workers; True if one exited before the job ended."""
        exited = False
        for worker, proc in self.workers.items():
            if proc.poll() is None:
                continue
            if worker not in self._exited:
                # Counted from the process, not from its key: a key that went with an
                # expired lease (etcd away) would hide the exit, and the node would
                # neither leave nor restart.
                ended = self.store.check([keys.DONE])  # etcd away: asked again next tick
                self._exited.add(worker)
                error = self._reported_error(worker)
                # After the job ended an exit is no failure of the node, but an exception a
                # worker reported is still said: it may be what ended the job (its own
                # node's leader saw the worker gone before this loop reaped it).
                if not ended or error:
                    self.log(f"worker {worker_key(worker)} exited with code {proc.returncode}{error}")
                exited = exited or not ended
            key = self.prefix + keys.alive(worker)
            if self.client.get(key)[0] is not None:
                self.client.delete(key)
        return exited

    def _reported_error(self, worker: Worker) -> str:
        """': <the exception>' from the worker's error file, or '' if it wrote none."""
        try:
            data = json.loads(self._error_file(worker).read_text())
            return ": " + str(data["message"]["message"]).splitlines()[0][:300]
        except (OSError, ValueError, KeyError, TypeError):
            return ""

    # ------------------------------------------------------------ stopping
    def serve_kill_requests(self) -> None:
        """SIGKILL the running workers the leader asked for: one read of this node's
        requests (mirrored by the agent: no request), not one per worker."""
        requested = self.store.items_under(keys.kill_requests_of(self.node))
        if not requested:
            return
        for worker in self.running():
            if keys.kill_request(worker) in requested:
                self.workers[worker].send_signal(signal.SIGKILL)

    def stop(self, signum: int) -> None:
        """`signum` to the running workers, then SIGKILL to those still there after the
        shutdown timeout (at once when `signum` is SIGKILL)."""
        for worker in self.running():
            self.workers[worker].send_signal(signum)
        deadline = time.monotonic() + (0 if signum == signal.SIGKILL else self.shutdown_timeout_s)
        for proc in self.workers.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def finish_tails(self, limit_s: float = 5.0) -> None:
        """Let the tee'd output of workers that have exited reach the console (their last
        lines, written as they exit, come after the agent saw them go)."""
        deadline = time.monotonic() + limit_s
        for tail in self._tails:
            tail.join(max(0.0, deadline - time.monotonic()))
