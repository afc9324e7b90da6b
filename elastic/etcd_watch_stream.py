"""One etcd Watch stream per client, carrying the watches of all its mirrors.

Owns `WatchStream`: the gRPC `Watch` call that an `EtcdClient` keeps open for its
`etcd_watch.Mirror`s, as etcd's own clientv3 does (one bidirectional stream carries many
WatchCreateRequests; each response names its watch by `watch_id`; a WatchCancelRequest
ends one watch and leaves the others). A client reaches it through `watch_stream()`: it
is made with the first mirror and ended with the last one's `close()` (or the client's),
so a process with many mirrors runs one thread per client (the stream's reader, plus
gRPC's thread that feeds it requests), not two per mirror.

How the watches share it:
- creations are serialized: one WatchCreateRequest is outstanding at a time, and the next
  is sent when its `created` answer came. etcd assigns the ids itself (the Python
  protocol files predate the client-chosen `watch_id`), so the `created` answer, whatever
  id it carries, is that of the one request outstanding. etcd sends a watch's events
  only after its `created` answer (its send loop holds them back until then), and never
  reuses an id on a stream (its `nextID` only grows);
- each watch starts from ITS mirror's revision + 1, and a response is applied to the
  mirror its id names; one for an id no longer in use (a watch canceled, or dropped
  after compaction) is ignored;
- compaction of one watch (`compact_revision` for its id) concerns that mirror alone: it
  reads its key or prefix again (one Range, on this thread, on the stream's member) and
  is created again; the others go on. The compacted watch is canceled too, as clientv3
  does: etcd keeps a compacted watcher until it is;
- the stream breaks as a whole (its member killed, frozen until keepalive ends it, cut
  off from its quorum so that `hasleader` ends it, a gRPC error, a watch canceled or
  refused by the server, no `created` answer within the client's `timeout_s`): every
  mirror on it is created again, each from its own revision + 1, on the next member
  that answers, with backoff (0.05 s doubling to 1 s), until the last mirror closes.
  Between attempts, a mirror whose `abort` event is set stops and closes.

Outage lines: once per stream when it breaks and once when it is back, through the
client's `on_outage` (read when said), for the mirrors that were given no `say` of
their own; a mirror given its own `say` is told about its own watch, once when it
breaks and once when it is back (`Mirror` says those lines).

Callbacks run on the stream's reader thread, for every mirror of the client: a slow
one delays the events of all of them. The stream's lock is never held while a callback
runs, so a callback may close its own mirror and create or close others of the client;
it must not wait for a mirror of the same client to change (the thread that would tell
it is the one waiting).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planaria.elastic.etcd_client import EtcdClient
    from planaria.elastic.etcd_watch import Mirror

_log = logging.getLogger("planaria.etcd.watch")

_BACKOFF_FIRST_S, _BACKOFF_MAX_S = 0.05, 1.0
_REQUIRE_LEADER = (("hasleader", "true"),)
"""etcd's require-leader metadata: a member without a leader ends the stream, rather
than keep it open with nothing to send."""
_KEYS_NAMED = 3
"""An outage line names this many of the stream's watches (there may be hundreds)."""


class _Canceled(Exception):
    """The server ended a watch, or the stream, without a gRPC error."""


class WatchStream:
    """The one Watch stream of an `EtcdClient`, shared by its mirrors (see the module
    docstring). `Mirror` attaches itself (`add`) and detaches itself (`remove`); the
    client ends it (`close`) when it closes."""

    def __init__(self, client: "EtcdClient"):
        self._client = client
        self._metadata = client.call_metadata + _REQUIRE_LEADER
        self._lock = threading.Lock()
        self._mirrors: dict["Mirror", None] = {}
        """The mirrors attached, in the order they came (a dict for its order)."""
        self._ended = False
        self._wake = threading.Event()
        """Set when the stream ends: cuts the backoff short."""
        self._thread = threading.Thread(target=self._run, name=f"planaria-watch stream {client.endpoint}",
                                        daemon=True)
        # The call in use, and what is under way on it (None and empty between calls):
        self._call = None
        self._requests: queue.SimpleQueue | None = None
        self._watches: dict[int, "Mirror"] = {}
        """{etcd's watch id: its mirror}, for the watches created on the call in use."""
        self._to_create: deque["Mirror"] = deque()
        self._creating: "Mirror | None" = None
        """The mirror whose creation was asked for (or whose re-read is under way) and
        not yet answered: one at a time, so that the next `created` answer is its."""
        self._creation = 0
        """Counts creations asked for: the no-answer alarm of an earlier one is stale."""
        self._alarm = _Alarm(f"planaria-watch alarm {client.endpoint}")
        self._no_answer: str | None = None
        self._handling = False
        """True while the reader handles a response (a callback may be slow): an answer
        may be waiting unread, so a creation's timer waits longer."""
        self._inflight_read = None
        # Outages:
        self._failures = 0
        self._down_since: float | None = None
        self._said_down = False

    @property
    def ended(self) -> bool:
        """True once the last mirror left, or the client closed: a new mirror needs a new stream."""
        return self._ended

    def on_its_thread(self) -> bool:
        """Whether the caller is the stream's reader (a callback)."""
        return threading.current_thread() is self._thread

    # -- mirrors come and go ----------------------------------------------------------------
    def add(self, mirror: "Mirror") -> bool:
        """Attach `mirror`: its watch is created from its revision + 1 as soon as the stream
        is up and no other creation is outstanding. False if the stream has ended."""
        with self._lock:
            if self._ended:
                return False
            self._mirrors[mirror] = None
            if self._thread.ident is None:  # the first mirror: its reader starts
                self._thread.start()
            elif self._call is not None:
                if self._creating is None and not self._to_create:
                    # Nothing outstanding: ask now. A new mirror has just read, so it needs
                    # no re-read, the one step that must stay on the reader thread.
                    self._creating = mirror
                    self._ask_create(self._call, mirror)
                else:
                    self._to_create.append(mirror)
        return True

    def remove(self, mirror: "Mirror") -> None:
        """Detach `mirror` and cancel its watch; the last one ends the stream and its
        threads (joined, unless this is the reader thread: a callback closing its mirror)."""
        with self._lock:
            if mirror not in self._mirrors:
                return
            del self._mirrors[mirror]
            watch_id = next((wid for wid, m in self._watches.items() if m is mirror), None)
            if watch_id is not None:
                del self._watches[watch_id]
                self._ask_cancel(watch_id)
            if mirror in self._to_create:
                self._to_create.remove(mirror)
            # One being created is canceled when its `created` answer comes (`_created`).
            last = not self._mirrors
            if last:
                self._ended = True
        if last:
            self._stop()

    def close(self) -> None:
        """End the stream and every mirror on it (the client closes)."""
        with self._lock:
            self._ended = True
            mirrors, self._mirrors = list(self._mirrors), {}
        for mirror in mirrors:
            mirror._detached()
        self._stop()

    def _stop(self) -> None:
        """The stream has ended: cut short whatever its thread waits on, and join it."""
        self._wake.set()
        self._alarm.close()
        with self._lock:
            call, read = self._call, self._inflight_read
            if self._requests is not None:
                self._requests.put(None)  # ends gRPC's thread that feeds the call
        for pending in (call, read):
            if pending is not None:
                pending.cancel()
        if self._thread.ident is not None and not self.on_its_thread():
            self._thread.join()

    # -- the reader thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._read_members()
        finally:
            self._alarm.close()  # (however the stream ended: closed, the last mirror gone, aborted)

    def _read_members(self) -> None:
        targets = self._client.stream_targets()  # the client's member in use first
        turn = 0
        while not self._ended:
            member, channel = targets[turn % len(targets)]
            try:
                self._serve(member, channel)
            except Exception as err:
                if self._ended:
                    break
                if isinstance(err, ValueError) and "Channel closed" in str(err):
                    self.close()  # its client was closed: nothing is left to watch with
                    break
                self._broken(member, _describe(err))
                if not isinstance(err, (_Canceled, _grpc_error())):
                    _log.exception("watch stream on %s: unexpected error", member)
            if self._ended:
                break
            turn += 1  # whatever failed there, the next member may answer
            self._failures += 1
            self._stop_aborted()
            if self._ended:
                break
            self._wake.wait(min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2 ** min(self._failures - 1, 8)))

    def _serve(self, member: str, channel) -> None:
        """Open a call on `member`, create every mirror's watch on it and apply what comes,
        until it breaks (raises; returns only if the stream ended meanwhile)."""
        import grpc
        from pyetcd import etcdrpc

        requests: queue.SimpleQueue = queue.SimpleQueue()
        call = etcdrpc.WatchStub(channel).Watch(iter(requests.get, None), metadata=self._metadata)
        with self._lock:
            if self._ended:
                requests.put(None)
                call.cancel()
                return
            self._call, self._requests, self._no_answer = call, requests, None
            self._watches, self._to_create, self._creating = {}, deque(self._mirrors), None
        try:
            self._advance(call, channel)
            for response in call:
                self._handling = True
                try:
                    self._handle(call, member, channel, response)
                finally:
                    self._handling = False
            raise _Canceled("the server ended the stream")
        except grpc.RpcError as err:
            if self._no_answer is not None and not self._ended:
                raise _Canceled(self._no_answer) from err
            raise
        finally:
            requests.put(None)  # ends gRPC's thread that reads the requests
            call.cancel()
            with self._lock:
                self._call = self._requests = self._creating = None
                self._watches, self._to_create = {}, deque()
                self._cancel_timer()
                mirrors = list(self._mirrors)
            for mirror in mirrors:
                mirror._unwatched()

    def _handle(self, call, member: str, channel, response) -> None:
        if response.created:
            self._created(call, member, channel, response)
            return
        with self._lock:
            mirror = self._watches.get(response.watch_id)
        if mirror is None:  # a watch canceled here: its confirmation, or events sent before it
            return
        if response.compact_revision:
            self._compacted(call, channel, mirror, response.watch_id, response.compact_revision)
            return
        if response.canceled:
            reason = response.cancel_reason or "no reason given"
            raise _Canceled(f"the server canceled the watch on {mirror.key}: {reason}")
        mirror._apply(response)

    def _created(self, call, member: str, channel, response) -> None:
        """The answer to the one creation outstanding: its watch is up (or refused)."""
        with self._lock:
            mirror, self._creating = self._creating, None
            self._cancel_timer()
            if mirror is None:
                _log.warning("watch stream on %s: a watch created that was not asked for (id %d)",
                             member, response.watch_id)
                return
            if not response.canceled:
                attached = mirror in self._mirrors
                if attached:
                    self._watches[response.watch_id] = mirror
                else:  # closed while it was being created
                    self._ask_cancel(response.watch_id)
                self._failures = 0
                back_s = None if self._down_since is None else time.monotonic() - self._down_since
                said, self._down_since, self._said_down = self._said_down, None, False
        if response.canceled:  # refused (etcd sends id -1 then): try again elsewhere
            reason = response.cancel_reason or "no reason given"
            raise _Canceled(f"the server refused the watch on {mirror.key}: {reason}")
        if said:
            self._client.on_outage(f"etcd watch stream is back, on {member}, after {back_s:.1f} s")
        if attached:
            mirror._watching(member)
        self._advance(call, channel)

    def _compacted(self, call, channel, mirror: "Mirror", watch_id: int, revision: int) -> None:
        """That mirror's revision is gone: it reads again and is created again; the others
        are untouched."""
        # Not an outage of its own (the member answered): it mostly follows one (the watch
        # re-created from an old revision), and that one's lines tell the story.
        _log.info("watch on %s: revision %d was compacted (etcd keeps from %d); reading it again",
                  mirror.key, mirror.revision + 1, revision)
        mirror._unwatched()
        with self._lock:
            self._watches.pop(watch_id, None)
            self._ask_cancel(watch_id)
            if mirror in self._mirrors:
                mirror._stale = True
                self._to_create.append(mirror)
        self._advance(call, channel)

    def _advance(self, call, channel) -> None:
        """Ask for the next creation, if none is outstanding. On the reader thread only: a
        compacted mirror reads again first (one Range on the stream's member)."""
        while True:
            with self._lock:
                if self._call is not call or self._creating is not None or not self._to_create:
                    return
                mirror = self._creating = self._to_create.popleft()
                if not mirror._stale:
                    self._ask_create(call, mirror)
                    return
            self._reread(mirror, channel)  # raises when it fails: the stream breaks
            with self._lock:
                if self._call is not call:
                    return
                if mirror in self._mirrors:
                    self._ask_create(call, mirror)
                    return
                self._creating = None  # closed during its read: on to the next

    def _reread(self, mirror: "Mirror", channel) -> None:
        """One Range of the mirror's key or prefix on `channel`'s member, applied as a diff."""
        from pyetcd import etcdrpc

        future = etcdrpc.KVStub(channel).Range.future(mirror._range_request(), timeout=self._client.settings.timeout_s,
                                                      metadata=self._metadata)
        mirror.ranges += 1
        with self._lock:
            self._inflight_read = future
        if self._ended:  # `_stop` may have looked before the read was there
            future.cancel()
        try:
            response = future.result()
        finally:
            with self._lock:
                self._inflight_read = None
        mirror._replace([(kv.key, kv.value, kv.mod_revision) for kv in response.kvs], response.header.revision)
        mirror._stale = False

    # -- requests (under the lock) ------------------------------------------------------------
    def _ask_create(self, call, mirror: "Mirror") -> None:
        """Send the creation of `mirror`'s watch, from its revision + 1, on `call`."""
        from pyetcd import etcdrpc

        self._requests.put(etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest(
            key=mirror.key.encode(), range_end=mirror._range_end or b"", start_revision=mirror.revision + 1)))
        mirror.watch_creates += 1
        # A member that does not answer at all (frozen) must not hold the creation until
        # keepalive gives up: it has the client's per-request timeout to confirm it.
        self._creation += 1
        self._arm_timer(call)

    def _arm_timer(self, call) -> None:
        self._alarm.arm(self._client.settings.timeout_s, self._not_answered, call, self._creation)

    def _ask_cancel(self, watch_id: int) -> None:
        from pyetcd import etcdrpc

        if self._requests is not None:
            self._requests.put(etcdrpc.WatchRequest(cancel_request=etcdrpc.WatchCancelRequest(watch_id=watch_id)))

    def _cancel_timer(self) -> None:
        self._alarm.cancel()

    def _not_answered(self, call, creation: int) -> None:
        with self._lock:
            if self._call is not call or self._creating is None or self._creation != creation:
                return
            if self._handling:  # the reader is busy (a slow callback): the answer may be there unread
                self._arm_timer(call)
                return
            self._no_answer = f"no answer within {self._client.settings.timeout_s:g} s"
        call.cancel()

    # -- outages ------------------------------------------------------------------------------
    def _broken(self, member: str, why: str) -> None:
        """Say so, once per outage: for the mirrors without their own `say`, one line on
        the client's `on_outage`; each of the others on its own."""
        with self._lock:
            mirrors = list(self._mirrors)
            if self._down_since is None:
                self._down_since = time.monotonic()
            first = not self._said_down
            shared = [m for m in mirrors if not m._says_own]
            self._said_down = self._said_down or bool(shared)
        if first and shared:
            self._client.on_outage(f"etcd watch stream broke ({member}: {why}); its {_watches(shared)} "
                                   "resume on whichever member answers, each from its own revision")
        for mirror in mirrors:
            if mirror._says_own:
                mirror._down(member, why)

    def _stop_aborted(self) -> None:
        """The mirrors whose abort event is set stop retrying and close; with none left,
        the stream ends."""
        with self._lock:
            stopped = [m for m in self._mirrors if m._abort.is_set()]
            for mirror in stopped:
                del self._mirrors[mirror]
            if stopped and not self._mirrors:
                self._ended = True
        shared = [m for m in stopped if not m._says_own]
        if shared:
            self._client.on_outage(f"etcd watch stream: its {_watches(shared)} stop: "
                                   "their client was told to abort")
        for mirror in stopped:
            mirror._detached(aborted=True)


class _Alarm:
    """Calls `fire(*args)` once the deadline it was last armed with passes, on one thread
    for the stream's life. Every watch's creation arms it and its answer cancels it: a
    `threading.Timer` each was a thread started per creation, some per epoch for every
    node (each node's relay follows the epoch's keys), and where thousands of threads
    share an interpreter (the scale harness's node processes) a thread's start waits
    for all of them."""

    def __init__(self, name: str):
        self._name = name
        self._cond = threading.Condition()
        self._armed: tuple | None = None
        """(deadline, fire, args) while armed."""
        self._closed = False
        self._thread: threading.Thread | None = None

    def arm(self, delay_s: float, fire, *args) -> None:
        with self._cond:
            if self._closed:
                return
            self._armed = (time.monotonic() + delay_s, fire, args)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=self._name)
                self._thread.start()
            self._cond.notify()

    def cancel(self) -> None:
        """Not fired for the deadline armed (a fire under way goes on: `fire` checks)."""
        with self._cond:
            self._armed = None
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed, self._armed = True, None
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._armed is None or time.monotonic() < self._armed[0]):
                    self._cond.wait(None if self._armed is None else self._armed[0] - time.monotonic())
                if self._closed:
                    return
                _, fire, args = self._armed
                self._armed = None
            fire(*args)


def _watches(mirrors: list["Mirror"]) -> str:
    """'3 watches (/a/, /b, /c)', naming a few."""
    keys = ", ".join(m.key for m in mirrors[:_KEYS_NAMED]) + (", ..." if len(mirrors) > _KEYS_NAMED else "")
    return f"{len(mirrors)} watch{'es' if len(mirrors) != 1 else ''} ({keys})"


def _grpc_error() -> type:
    import grpc

    return grpc.RpcError


def _describe(err: BaseException) -> str:
    if isinstance(err, _grpc_error()) and hasattr(err, "code"):
        return f"{err.code().name} {err.details() or ''}".strip()
    return str(err) or type(err).__name__
