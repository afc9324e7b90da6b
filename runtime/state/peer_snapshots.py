"""Peer snapshots: committed layer state kept in the host memory of other nodes (docs/recovery.md).

Replicas cover f failures at once; more, and some layer can lose every replica. Then,
rather than the disk checkpoint, the job goes back to a recent step whose state peers
keep in their memory (Gemini, SOSP 2023, over Oobleck's replicas). Every
`checkpoint.memory_every` steps, right after the step:

1. each worker copies the shards it holds to its own host memory (`flatten_shard`:
   parameters and AdamW state, one flat tensor per dtype), at once, on the training
   thread: it is what the worker restores from should its layers have to go back;
2. a background thread sends the shards this worker owns (first of their replica
   group) to the workers `planaria.templates.snapshots.snapshot_placement` names on
   other nodes, and receives the ones placed on it, over a gloo group of the epoch's
   own (host memory moves over TCP even in an NCCL job; the training groups are never
   touched from that thread). The group connects on a thread of its own while the
   epoch's first steps train, on the epoch's rendezvous store and outside torch's
   registry of groups: a failed epoch leaves a connection still in flight behind (it
   ends on the abandoned store, or at its connect timeout) without waiting for it, and
   nothing of it reaches the next epoch's groups. The connection, its gloo threads
   and the exchange thread run at idle priority (`SCHED_IDLE`): they take only CPU
   time training leaves (its waits on peers, the pipeline's bubbles), so on a host
   whose cores training keeps busy the exchange slows down, not the step. A
   connection still under way after `CONNECT_AT_IDLE_S` goes on at normal priority:
   under training that left no CPU idle it starved past its peers' connect timeout;
3. the commit of every later step carries, from every worker, whether its exchange is
   still going on, or its group still connecting (`busy`: one more number in the
   commit's all-reduce, so all workers learn the same count). When none is, a round is taken at that step if one is due,
   and every round before it is known whole on every keeper; when some is, no round
   is taken at that step, anywhere: training never waits for an exchange, and a link
   too slow for one round a step stretches the interval instead (`skipped` counts it).

So a worker keeps the newest round known whole everywhere and anything newer (two
rounds at most, one of them in flight). A round still arriving when a failure strikes
is never reported (its received shards count only once all have arrived), so a restore
never reads a half-written copy; the round before it is whole everywhere. An exchange
that fails (a peer gone: the epoch fails too; or a timeout on a slow link) leaves the
worker `busy` until the epoch ends: no round is taken in it any more, and training
goes on.

Workers report what they keep in their status (`SnapshotHeld`); the controller picks
the newest step whose every shard some survivor keeps, and workers restore from it
(`planaria.runtime.state.transfer.restore_from_snapshots`).
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Iterable

import torch
import torch.distributed as dist

from planaria.runtime.contract.exactly_once import CommitRecord, SnapshotHeld
from planaria.runtime.contract.logs import error_line
from planaria.runtime.parallel.release import shut_down_sockets, socket_inodes
from planaria.runtime.state.transfer import by_dtype, layer_state_tensors
from planaria.templates.snapshots import Shard, owners, snapshot_placement

if TYPE_CHECKING:
    from planaria.runtime.parallel.engine import Engine

FlatShard = tuple[torch.Tensor, ...]
"""A shard's parameters and AdamW state (`layer_state_tensors` order), one flat CPU
tensor per dtype in order of first appearance."""

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HEADER = 2 * len(_DTYPES)
"""A message's header: (dtype code, number of elements) per flat tensor, -1 padded."""


def flatten_shard(engine: "Engine", layer: int, into: FlatShard | None = None) -> FlatShard:
    """A CPU copy of the shard of `layer` this worker holds, flat per dtype; written into
    `into` (a forgotten round's copy of the same shard) when given, which spares the
    allocation and the first touch of fresh pages at every step."""
    tensors = layer_state_tensors(engine.shard(layer), stepped=True)
    groups = [[t.detach().reshape(-1).to("cpu") for t in group] for _, group in by_dtype(tensors)]
    if into is not None and [t.dtype for t in into] == [g[0].dtype for g in groups] \
            and [t.numel() for t in into] == [sum(p.numel() for p in g) for g in groups]:
        return tuple(torch.cat(g, out=out) for g, out in zip(groups, into))
    # torch.cat always copies (a one-tensor `_flatten_dense_tensors` would be a view of
    # the live parameter, which the next step changes).
    return tuple(torch.cat(g) for g in groups)


def exchanges_snapshots(every: int, plan) -> bool:
    """Whether an epoch of `plan` exchanges peer snapshots taken every `every` steps (0:
    none), over a group of its own: only across more than one node."""
    return every > 0 and len(plan.nodes()) >= 2


@dataclass(frozen=True)
class ConnectedGroup:
    """A snapshot group made ahead of its epoch (`PeerSnapshots.group_maker`), and the
    inodes of its connections (shut down should an exchange outlive a failed epoch)."""

    group: object
    sockets: set[int]


@dataclass
class SnapshotRound:
    """One step's snapshot as this worker keeps it."""

    commit: CommitRecord
    epoch: int
    shards: dict[Shard, FlatShard] = field(default_factory=dict)
    """Its own shards from the start; the received ones added all at once, when whole."""

    @property
    def step(self) -> int:
        return self.commit.iteration

    def held(self) -> SnapshotHeld:
        return SnapshotHeld(commit=self.commit, epoch=self.epoch, shards=tuple(sorted(self.shards)))


class PeerSnapshots:
    """A worker's side of peer snapshots (module docstring)."""

    def __init__(self, every: int, copies: int, *, timeout_s: float, connect_timeout_s: float,
                 log: Callable[[str], None] = lambda message: None):
        self.every, self.copies = every, copies
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.log = log
        self.rounds: dict[int, SnapshotRound] = {}
        self._lock = threading.Lock()  # rounds: read by the status, filled by the exchange
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peer-snapshots",
                                        initializer=_idle_priority)
        self._inflight: Future | None = None
        self._inflight_step = self._inflight_epoch = -1
        self._spare: dict[Shard, FlatShard] = {}
        """Copies of forgotten rounds, written over by the next round's (one per shard)."""
        self._group: Future | None = None
        """The epoch's gloo group for the exchange (`_connect`), being made on a thread."""
        self._connect_began, self._threads_before, self._hurried = 0.0, set(), False
        """When the group began to connect, the process's threads then, and whether the
        connection was given normal priority since (`_hurry_connection`)."""
        self._sockets: set[int] = set()
        """The inodes of the epoch's group's connections (`_connect`); the exchange in
        flight's group's in `_inflight_sockets`."""
        self._inflight_sockets: set[int] = set()
        self._epoch, self._first = -1, 0
        self._reported = -1
        self._broken = False
        self.taken = self.skipped = 0
        """This epoch's rounds taken, and those due but not taken (some worker's exchange
        was still going on): said when the epoch ends."""
        self._outgoing: dict[int, list[Shard]] = {}
        """Holder rank -> the shards this worker owns that it sends there, in order."""
        self._incoming: dict[int, list[Shard]] = {}
        """Owner rank -> the shards placed on this worker that it receives from there."""

    @property
    def enabled(self) -> bool:
        return self.every > 0

    # ------------------------------------------------------------- epochs
    def begin_epoch(self, engine: "Engine", epoch: int, store: dist.Store | None = None, *,
                    connected: "ConnectedGroup | None" = None) -> None:
        """After the epoch's layers are in place (collective: every worker of the epoch
        makes the snapshot group, over `store`: the epoch's rendezvous store, given up
        when the epoch is; the world's when None). `connected`: the group made with the
        epoch's groups connected ahead (`group_maker`), taken as it is. Rounds of steps
        the plan runs again (it went back to an older step) are of a timeline the job
        left: dropped."""
        plan = engine.plan
        with self._lock:
            self.rounds = {s: r for s, r in self.rounds.items() if s < plan.first_iteration}
        self._epoch, self._first, self._group = epoch, plan.first_iteration, None
        self._outgoing, self._incoming, self._broken = {}, {}, False
        self.taken = self.skipped = 0
        if not self.wants_group(plan):
            return  # one node: its own copies only (nowhere else to keep them)
        self._place(engine.rank, plan)
        if connected is not None:
            # A join's epoch: its group connected ahead, while the epoch before trained. Made
            # here, its connection took the CPU of the epoch's first steps on every worker.
            self._group, self._sockets = Future(), connected.sockets
            self._group.set_result(connected.group)
            return
        # Not waited for: its connection (20-30 ms on 2 busy cores) is off the pause
        # between two epochs; until it is up this worker is `busy` and no round is taken.
        # Made through `dist.new_group` on another thread it had to be waited for at the
        # epoch's end (no group may be made across epochs in torch's registry), and a peer
        # killed while it connected left the survivors' teardown waiting until its
        # connect timeout (a CI failure); made outside the registry, it can be left behind.
        if store is None:
            store = dist.distributed_c10d._get_default_store()
        self._connect_began, self._threads_before, self._hurried = time.monotonic(), _threads(), False
        self._sockets = set()
        self._group = _on_thread(self._connect, dist.PrefixStore("peer-snapshots/", store),
                                 engine.rank, plan.world_size, self._sockets, name=f"peer-snapshots-connect-{epoch}")

    def wants_group(self, plan) -> bool:
        """Whether an epoch of `plan` exchanges snapshots (`exchanges_snapshots`)."""
        return exchanges_snapshots(self.every, plan)

    def group_maker(self, plan) -> "Callable[[dist.Store, int, int], ConnectedGroup] | None":
        """For an epoch of `plan` whose groups are connected ahead
        (`planaria.runtime.parallel.prepared_groups`): what makes its snapshot group
        with them, given their store, the rank and the world's size; None when the epoch
        has no snapshot group. The group goes to `begin_epoch(connected=...)`."""
        return self._make_group if self.wants_group(plan) else None

    def _place(self, rank: int, plan) -> None:
        """The shards this worker sends to and receives from which ranks in this epoch."""
        rank_of = plan.rank_of_worker()
        me = plan.worker(rank)
        owner_of = owners(plan)
        for shard, holders in sorted(snapshot_placement(plan, self.copies).items()):
            for holder in holders:
                if owner_of[shard] == me:
                    self._outgoing.setdefault(rank_of[holder], []).append(shard)
                if holder == me:
                    self._incoming.setdefault(rank_of[owner_of[shard]], []).append(shard)

    def _connect(self, store: dist.Store, rank: int, size: int, sockets: set[int]):
        """The epoch's snapshot group: a gloo backend over every rank of the epoch (its
        ranks are the plan's), made directly rather than through `dist.new_group`, so
        that it is in no registry of torch's (module docstring). It connects under the
        connect timeout, then takes the operations' timeout. On the calling thread, at
        idle priority (`busy` raises it if it takes long); gloo's threads for the group
        are left at idle priority. `sockets` receives the inodes of the sockets opened
        meanwhile, the group's connections (`end_epoch` shuts them down after a failure)."""
        _idle_priority()
        made = self._make_group(store, rank, size)
        sockets.update(made.sockets)
        return made.group

    def _make_group(self, store: dist.Store, rank: int, size: int) -> "ConnectedGroup":
        """The snapshot group connected on the calling thread, its gloo threads at idle
        priority, with the inodes of the sockets opened meanwhile (its connections)."""
        before, opened = _threads(), set(socket_inodes())
        group = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=self.connect_timeout_s))
        group._set_default_timeout(timedelta(seconds=self.timeout_s))  # what torch's _set_pg_timeout calls
        sockets = set(socket_inodes()) - opened
        _idle_priority(_gloo_threads(_threads() - before))
        return ConnectedGroup(group, sockets)

    def _hurry_connection(self) -> None:
        """The group still connecting `CONNECT_AT_IDLE_S` after it began: its thread and
        gloo's threads started since go on at normal priority (once)."""
        if self._hurried or time.monotonic() - self._connect_began < CONNECT_AT_IDLE_S:
            return
        self._hurried = True
        _normal_priority([self._group.thread_id] + _gloo_threads(_threads() - self._threads_before))
        self.log(f"peer snapshots' group of epoch {self._epoch} still connecting after {CONNECT_AT_IDLE_S} s at "
                 "idle priority (no CPU left idle): it goes on at normal priority")

    def end_epoch(self, stopped: bool = False) -> list:
        """As the epoch's groups go: the exchange in flight ends (whole, or failed on a
        peer gone or released: its round then keeps only this worker's own shards); a
        group still connecting is left behind (a peer gone, or an epoch that failed at
        once: it fails on its own, and no exchange waits on it). Returns the group when
        it connected, for the caller to retire with the epoch's others.

        `stopped`: the epoch stopped at a step boundary every worker agreed on, so its
        peers are alive and the exchange completes: it goes on while the next epoch
        begins (it holds its group), instead of adding its remaining time to the pause
        (up to a step on two busy cores; a whole round of a large model's state over the
        network). Until it ends, the next epoch counts this worker busy."""
        connected = []
        if self._group is not None and not self._group.done():
            self.log(f"peer snapshots' group of epoch {self._epoch} not connected yet; left behind")
        elif self._group is not None and self._group.exception() is not None:
            self._log_failed_connect()
        elif self._group is not None:
            connected.append(self._group.result())
        if self._inflight is not None and not stopped:
            self._release_exchange()
            try:
                self._inflight.result()
            except Exception as err:  # the epoch failed; its status says why
                self.log(f"peer snapshot of step {self._inflight_step} not sent whole: "
                         f"{error_line(err)}")
            self._inflight = None
        self._group = None
        if self.enabled and self._epoch >= 0 and self._reported != self._epoch:
            self._reported = self._epoch  # once per epoch (an epoch that failed on entry ends here again)
            self.log(f"peer snapshots of epoch {self._epoch}: {self.taken} round(s) taken, {self.skipped} due "
                     "but skipped (an exchange still going on, or the group connecting)")
        return connected

    def _release_exchange(self, grace_s: float = 0.2) -> None:
        """After a failure, an exchange under way may wait on a live peer whose own exchange
        failed on the dead one (it never sends the rest), while that peer's epoch end
        waits on its exchange in turn: both until the operations' timeout (minutes), their
        workers stuck in their epoch's end. One still going on after `grace_s` has its
        group's connections shut down (as a release does), so that it fails at once, and
        the peers' with it."""
        try:
            self._inflight.result(timeout=grace_s)
        except Exception:  # done (whole or failed: said by the caller), or still going on
            pass
        if not self._inflight.done():
            count = shut_down_sockets(self._inflight_sockets.__contains__)
            self.log(f"peer snapshot of step {self._inflight_step} still being exchanged as the epoch failed; "
                     f"its {count} connection(s) shut down")

    def _log_failed_connect(self) -> None:
        err = self._group.exception()
        self.log(f"peer snapshots' group of epoch {self._epoch} not made: "
                 f"{error_line(err)}; "
                 "no peer snapshots until the next epoch")

    # -------------------------------------------------------------- steps
    def busy(self) -> bool:
        """Asked before each commit: is this worker's exchange still going on, or its group
        still connecting (or did either fail in this epoch)? Never waits."""
        if self._group is not None and not self._group.done():
            self._hurry_connection()
            return True
        if self._group is not None and self._group.exception() is not None:
            self._log_failed_connect()
            self._broken, self._group = True, None
        if self._inflight is not None and self._inflight.done():
            future, self._inflight = self._inflight, None
            try:
                future.result()
            except Exception as err:  # noqa: BLE001 - no more rounds this epoch; training goes on
                # (one that went on past the stop of an earlier epoch says nothing of this one's)
                self._broken = self._broken or self._inflight_epoch == self._epoch
                self.log(f"peer snapshot of step {self._inflight_step} not sent whole "
                         f"({error_line(err)}); "
                         "no more peer snapshots until the next epoch")
        return self._inflight is not None or self._broken

    def after_step(self, engine: "Engine", busy: int, ends_epoch: bool) -> None:
        """After each committed step of this epoch (the step's commit record is the
        engine's; `busy`: the workers whose exchange its commit found going on;
        `ends_epoch`: the job's last step, or one the workers agreed to stop after, where
        no round is taken: it would be waited for as the epoch ends)."""
        step = engine.last_stepped
        due = self.enabled and (step + 1) % self.every == 0 and not ends_epoch
        if busy:
            self.skipped += due
            if due and self.skipped == 1:
                self.log(f"peer snapshot of step {step} skipped: {busy} worker(s) still sending the last "
                         "one, or connecting (a link too slow for the interval stretches it)")
            return
        self._forget_before(step)
        if not due:
            return
        own = {(layer, engine.tp.rank): flatten_shard(engine, layer, self._spare.pop((layer, engine.tp.rank), None))
               for layer in engine.held_layers()}
        current = SnapshotRound(engine.last_commit, self._epoch, own)
        self.taken += 1
        with self._lock:
            self.rounds[step] = current
        if self._group is not None and (self._outgoing or self._incoming):
            self._inflight_step, self._inflight_epoch, self._inflight_sockets = step, self._epoch, self._sockets
            self._inflight = self._pool.submit(self._exchange, self._group.result(), current,
                                               self._outgoing, self._incoming)

    def _forget_before(self, step: int) -> None:
        """Rounds of this epoch before `step` are whole on every keeper (no exchange was
        going on anywhere at the commit of `step`): keep the newest of them, and what is newer."""
        whole = [s for s, r in self.rounds.items() if r.epoch == self._epoch and self._first <= s < step]
        if whole:
            newest = max(whole)
            with self._lock:
                forgotten = [r for s, r in self.rounds.items() if s < newest]
                self.rounds = {s: r for s, r in self.rounds.items() if s >= newest}
            # Their copies are no longer read by anyone (no restore is under way in an
            # epoch that trains, and the exchange in flight uses the newest round's): the
            # next round writes into them.
            for old in forgotten:
                self._spare.update(old.shards)

    # ------------------------------------------------------------ reports
    def held(self) -> tuple[SnapshotHeld, ...]:
        """What this worker keeps, for its status."""
        with self._lock:
            return tuple(r.held() for _, r in sorted(self.rounds.items()))

    def shards_of(self, held: SnapshotHeld) -> dict[Shard, FlatShard]:
        """The shards this worker keeps of the round `held` names (step and epoch)."""
        with self._lock:
            found = self.rounds.get(held.step)
            if found is None or found.epoch != held.epoch:
                return {}
            return dict(found.shards)

    # ----------------------------------------------------------- exchange
    def _exchange(self, group, current: SnapshotRound, outgoing: dict[int, list[Shard]],
                  incoming: dict[int, list[Shard]]) -> None:
        """Send this worker's owned shards to their holders and receive the ones placed
        here: headers first (each message's dtypes and sizes), then the data. The round
        takes the received shards only once every one has arrived."""
        sends = [(peer, i, current.shards[shard]) for peer, shards in outgoing.items()
                 for i, shard in enumerate(shards)]
        headers = {(peer, i): torch.empty(_HEADER, dtype=torch.int64) for peer, shards in incoming.items()
                   for i in range(len(shards))}
        # Tags: message i of a pair carries its header as 8i, its flat tensors as 8i+1+j.
        # The group's ranks are the plan's (its backend's own send and recv: it is in no
        # registry for `dist.isend` to look it up in).
        works = [group.send([_header(flat)], peer, 8 * i) for peer, i, flat in sends]
        works += [group.recv([h], peer, 8 * i) for (peer, i), h in headers.items()]
        _wait_all(works)
        buffers = {key: _buffers(h, self._spare.pop(incoming[key[0]][key[1]], None)) for key, h in headers.items()}
        works = [group.send([t], peer, 8 * i + 1 + j) for peer, i, flat in sends for j, t in enumerate(flat)]
        works += [group.recv([t], peer, 8 * i + 1 + j) for (peer, i), flat in buffers.items() for j, t in enumerate(flat)]
        _wait_all(works)
        received = {incoming[peer][i]: flat for (peer, i), flat in buffers.items()}
        with self._lock:
            current.shards.update(received)


CONNECT_AT_IDLE_S = 0.5
"""How long the snapshot group connects at idle priority before it goes on at normal
priority: many times its connection on two busy cores (20-30 ms), far below the
connect timeout its peers wait under (`comm.connect_timeout_s`)."""


def _idle_priority(threads: Iterable[int] = (0,)) -> None:
    """`threads` (the calling one by default, and the threads it starts later) run only
    when a CPU is otherwise idle: Linux's `SCHED_IDLE`, which applies to one thread at a
    time. Elsewhere they run as they are (their calls of this kind would lower the whole
    process)."""
    _set_policy(threads, "SCHED_IDLE")


def _normal_priority(threads: Iterable[int]) -> None:
    """`threads` back to Linux's normal policy (what `_idle_priority` undoes)."""
    _set_policy(threads, "SCHED_OTHER")


def _set_policy(threads: Iterable[int], policy: str) -> None:
    for tid in threads:
        try:
            os.sched_setscheduler(tid, getattr(os, policy), os.sched_param(0))
        except (AttributeError, OSError):  # (not Linux, or a thread that ended meanwhile)
            pass


GLOO_THREADS = frozenset({"gloo_tcp_loop", "pt_gloo_runloop"})
"""The names gloo gives the threads of a group: its transport's event loop, its work queue."""


def _threads() -> set[int]:
    """The ids of this process's threads (Linux's /proc; empty elsewhere)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _gloo_threads(threads: Iterable[int]) -> list[int]:
    """Those of `threads` that gloo started (by their names): a Python thread started
    meanwhile elsewhere in the process is left as it is."""
    found = []
    for tid in threads:
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
                if f.read().strip() in GLOO_THREADS:
                    found.append(tid)
        except OSError:  # ended meanwhile
            continue
    return found


def _wait_all(works: list) -> None:
    for work in works:
        work.wait()


def _on_thread(fn, *args, name: str) -> Future:
    """`fn(*args)` on a new thread; its result, or what it raised, in the returned future,
    whose `thread_id` is the thread's (Linux's id, for its priority). A thread of its
    own, not the exchange pool's: a connection left behind by a failed epoch must not
    hold up the next epoch's exchanges."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(err)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    future.thread_id = thread.native_id
    return future


def _header(flat: FlatShard) -> torch.Tensor:
    header = torch.full((_HEADER,), -1, dtype=torch.int64)
    for j, t in enumerate(flat):
        header[2 * j], header[2 * j + 1] = _DTYPES.index(t.dtype), t.numel()
    return header


def _buffers(header: torch.Tensor, spare: FlatShard | None = None) -> FlatShard:
    """Receive buffers for the message `header` describes: `spare` (a forgotten copy of
    the same shard) when its dtypes and sizes match."""
    values = header.tolist()
    wanted = [(_DTYPES[values[j]], values[j + 1]) for j in range(0, len(values), 2) if values[j] >= 0]
    if spare is not None and [(t.dtype, t.numel()) for t in spare] == wanted:
        return spare
    return tuple(torch.empty(numel, dtype=dtype) for dtype, numel in wanted)
