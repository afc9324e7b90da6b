"""A local mirror of one etcd key or prefix, kept current by a watch: reads that cost no request.

Owns `Mirror` (and `Change`, what its callbacks are told): the list-then-watch pattern
of etcd's own `clientv3/mirror` (and of Kubernetes' reflectors), made to survive what
a long-lived stream meets. Its watch travels on its client's one Watch stream, shared by
all the client's mirrors (`etcd_watch_stream.WatchStream`, as clientv3 multiplexes its
watches). Torch-free: agents use it.

What a mirror guarantees:
- it starts with ONE read (a Range) that gives the current values and the revision they
  are at, and watches from that revision + 1: nothing written between the read and the
  watch is missed;
- events are applied in revision order, each once; `revision` is the revision up to
  which every change of the key or prefix is in the view;
- a broken stream (its member killed, frozen or cut off from the others, a gRPC error,
  the watch canceled by the server) is re-created from the last applied revision + 1,
  on the next member that answers, with backoff (0.05 s doubling to 1 s), forever: until
  `close()` or the mirror's `abort` event. The stream breaks for all its mirrors at once,
  and each resumes from its own revision. It is said once when it breaks and once when
  it is back: once per stream on the client's `on_outage`, or, for a mirror given its
  own `say`, once for that mirror's watch;
- if that revision has been compacted meanwhile, it reads the whole key or prefix again
  (one Range) and applies the difference, deletions included, then watches from there;
  the client's other mirrors are not disturbed;
- while nothing changes it makes no request at all: `ranges` and `watch_creates` count
  what it asked for (the first read and the first watch, then a watch per recovery and
  a read per compaction met), so a benchmark or a test can check it against etcd's own
  metrics.

Why its own stream rather than pyetcd's `add_watch_callback`: pyetcd's `Watcher` is one
stream per client, bound to the channel of the member in use when it was made. When that
member dies, its callbacks get the gRPC error once and the watch is gone: no
re-creation, no revision to resume from (a caller that adds it again without
`start_revision` misses what changed meanwhile, and the first re-add fails on the dead
member, which only a failed call marks as failed). A failover of the client's unary
calls replaces the Watcher, but the old stream is only half-closed and keeps delivering.
Its requests carry no `hasleader` metadata, and its channels no keepalive: a watch on a
member cut off from its quorum, or on one that froze, stays open and silent. Compaction
reaches the callback as an exception and the watch is dropped. So Planaria keeps its
own stream, one per client for all its mirrors (`etcd_watch_stream`), on the client's
channels (`EtcdClient.stream_targets`: one connection per member), and handles each of
those cases.

Can the stream go silent without an error? Measured on etcd 3.5, without the two
defences below a stream stays open and silent: on a SIGSTOPped member for as long as it
is stopped (30 s, gRPC's default settings), on a member that lost its quorum for as
long as we looked (15 s; etcd has no reason to end it). With them, neither happens:
- keepalive pings (`EtcdSettings.keepalive_s`, 10 s, answer within half that) while a
  call is open end a stream whose member froze or whose network vanished without a
  reset: tested with SIGSTOP;
- the `hasleader` metadata (etcd's `WithRequireLeader`) makes a member that has lost its
  leader end the stream ("etcdserver: no leader", after about three election timeouts)
  and refuse new ones: tested by killing two members of three.
So there is no periodic safety re-read, and no progress notifications either: their only
use here would be to keep a quiet watch's revision recent, saving one Range when it is
re-created after a compaction, and etcd has had bugs in them (etcd-io/etcd#15220, #20221:
notifications, and then events, at revisions out of line, on a watch re-created on a
member that lags): a mirror takes its revision only from events and reads, and skips an
event at or below it.
"""
from __future__ import annotations

import logging
import threading
import time
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, TypeVar

if TYPE_CHECKING:
    from planaria.elastic.etcd_client import EtcdClient

_log = logging.getLogger("planaria.etcd.watch")
T = TypeVar("T")


class Change(NamedTuple):
    """One change of the view, as callbacks are told it."""

    name: str
    """The key without the watched prefix ('' for a watched key itself)."""
    value: bytes | None
    """None: the key was deleted."""
    revision: int
    """The change's etcd revision (after a re-read: a key's mod revision, or for a
    deletion the revision of the read)."""


class Mirror:
    """{name: value} of one key (its name is '') or of the keys under a prefix (names
    relative to it, as `EtcdClient.items_with_prefix` gives them), kept current by a
    watch. See the module's docstring for what it guarantees.

    Reads (`value`, `items`, `len`) and waits (`wait_until`, `wait_for_value`,
    `wait_for_count`) make no request. Callbacks (`on_change`) run on the thread of the
    client's watch stream, shared by all the client's mirrors, after the view holds the
    changes: keep them short (the events of every mirror of the client wait for them),
    and do not wait on a mirror of the same client in one (closing or creating one is
    fine). A context manager; `close()` cancels the watch (the stream and its thread end
    with the client's last mirror).

    The constructor reads through the client (retried for its `retry_s`, raising
    `EtcdUnavailable` after it, like any call); from then on the stream retries as long
    as it takes."""

    def __init__(self, client: "EtcdClient", key: str, *, prefix: bool = False,
                 on_change: Callable[[list[Change]], None] | None = None,
                 abort: threading.Event | None = None, say: Callable[[str], None] | None = None):
        """`on_change`: a callback (see `on_change`) that also hears the first read, as the
        changes from an empty view: with it, what it is told adds up to the view, with no
        change between the read and a later registration to miss. `abort` (default: the
        client's) set: a broken watch stops retrying and the mirror closes. `say(line)`
        is told when this mirror's watch breaks and when it is back; without it, the
        stream tells the client's `on_outage`, once for all the mirrors that have none."""
        from pyetcd.utils import prefix_range_end

        if prefix and not key:
            raise ValueError("a mirror's prefix must not be empty (that would mirror all of etcd)")
        self.key, self.prefix = key, prefix
        self._range_end = prefix_range_end(key.encode()) if prefix else None
        self._abort = abort if abort is not None else client.abort
        self._say = say
        self._says_own = say is not None
        """Whether it says its own outage lines (else the stream says one for all such)."""
        self._cond = threading.Condition()
        self._view: dict[str, bytes] = {}
        self._revision = 0
        self._member: str | None = None
        self._callbacks: list[Callable[[list[Change]], None]] = [on_change] if on_change else []
        self._closed = threading.Event()
        self._telling = 0
        """Batches being told to callbacks now: `close()` waits for them to end."""
        self._stale = False
        """Set by the stream when the watch's revision was compacted: read again first."""
        self._down_since: float | None = None
        self.aborted = False
        """True once the abort event stopped a broken watch (the mirror is then closed)."""
        self.ranges = 0
        """Range requests made: the first read, then one per re-read after compaction."""
        self.watch_creates = 0
        """Watches asked for: the first, then one per re-creation."""
        entries, revision = client.read_range(key, self._range_end)
        self.ranges += 1
        self._replace(entries, revision)
        while True:  # a stream whose last mirror just closed takes none: the client makes another
            self._stream = client.watch_stream()
            if self._stream.add(self):
                break

    # -- reading the view (no request) ----------------------------------------------------
    def value(self, name: str = "") -> bytes | None:
        """The value of `name` ('' for a watched key itself); None when absent."""
        with self._cond:
            return self._view.get(name)

    def items(self) -> dict[str, bytes]:
        """A copy of the view."""
        with self._cond:
            return dict(self._view)

    def __len__(self) -> int:
        with self._cond:
            return len(self._view)

    @property
    def revision(self) -> int:
        """Every change up to this etcd revision is in the view."""
        with self._cond:
            return self._revision

    @property
    def member(self) -> str | None:
        """host:port of the member the watch is on; None while it is not watching."""
        with self._cond:
            return self._member

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    # -- waiting (woken by events, no request) --------------------------------------------
    def wait_until(self, predicate: Callable[[Mapping[str, bytes]], T], timeout_s: float | None) -> T:
        """Wait until `predicate(view)` is true, for up to `timeout_s` (None: no limit), and
        return its last result (false on a timeout or when the mirror is closed). The view
        it is given is read-only and valid only during the call."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                result = predicate(MappingProxyType(self._view))
                if result or self._closed.is_set():
                    return result
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return result
                self._cond.wait(left)

    def wait_for_value(self, name: str = "", timeout_s: float | None = None) -> bytes | None:
        """The value of `name` once it exists; None if it did not within `timeout_s`."""
        return self.wait_until(lambda view: view.get(name), timeout_s)

    def wait_for_count(self, at_least: int, timeout_s: float | None = None) -> bool:
        """Whether the view held at least `at_least` keys within `timeout_s`."""
        return self.wait_until(lambda view: len(view) >= at_least, timeout_s)

    def wait_watching(self, timeout_s: float | None = None) -> bool:
        """Whether the watch was up within `timeout_s` (the view is current from then on,
        not only since the last read)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._member is not None or self._closed.is_set(),
                                       timeout_s) and self._member is not None

    # -- callbacks -------------------------------------------------------------------------
    def on_change(self, callback: Callable[[list[Change]], None]) -> Callable[[], None]:
        """Call `callback(changes)`, on the client's watch stream's thread, with each batch
        of changes (one watch response, or the difference a re-read found). Returns what
        unregisters it. An exception in it is logged, and the mirror goes on."""
        with self._cond:
            self._callbacks.append(callback)

        def unregister() -> None:
            with self._cond:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)
        return unregister

    # -- closing ---------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel the watch (the view stays readable). Once it returns no callback of this
        mirror runs, unless it is called from one. The client's last mirror ends the
        stream and its threads."""
        with self._cond:
            self._closed.set()
            self._member = None
            self._cond.notify_all()
        self._stream.remove(self)
        if not self._stream.on_its_thread():  # a callback may close its mirror (or another)
            with self._cond:
                self._cond.wait_for(lambda: self._telling == 0)

    def __enter__(self) -> "Mirror":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- told by the stream ----------------------------------------------------------------
    def _range_request(self):
        """The Range that reads the whole key or prefix (a re-read after compaction)."""
        from pyetcd import etcdrpc

        return etcdrpc.RangeRequest(key=self.key.encode(), range_end=self._range_end or b"")

    def _watching(self, member: str) -> None:
        """Its watch is up on `member`."""
        with self._cond:
            self._member = member
            self._cond.notify_all()
        if self._down_since is not None:
            away_s, self._down_since = time.monotonic() - self._down_since, None
            self._say(f"watch on {self.key} is back, on {member}, after {away_s:.1f} s")

    def _unwatched(self) -> None:
        """Its watch is down (the stream broke, or its revision was compacted)."""
        with self._cond:
            self._member = None
            self._cond.notify_all()

    def _down(self, member: str, why: str) -> None:
        """The stream broke: said once per outage (a mirror with its own `say` only)."""
        if self._down_since is not None:
            return
        self._down_since = time.monotonic()
        self._say(f"watch on {self.key} broke ({member}: {why}); watching again from revision "
                  f"{self.revision + 1} on whichever member answers")

    def _detached(self, aborted: bool = False) -> None:
        """The stream let it go: its abort event was set while the stream was broken, or the
        client closed."""
        with self._cond:
            self.aborted = self.aborted or aborted
            self._closed.set()
            self._member = None
            self._cond.notify_all()
        if aborted and self._says_own:
            self._say(f"watch on {self.key} stops: its client was told to abort")

    # -- applying changes ------------------------------------------------------------------
    def _name(self, key: bytes) -> str:
        return key.decode()[len(self.key):] if self.prefix else ""

    def _apply(self, response) -> None:
        from pyetcd.etcdrpc import kv_pb2

        if not response.events:  # its header's revision promises nothing
            return
        changes = []
        with self._cond:
            if self._closed.is_set():  # closed while the response was on its way
                return
            applied = self._revision  # a revision's events all come in one response
            for event in response.events:
                if event.kv.mod_revision <= applied:  # applied already (or etcd-io/etcd#20221)
                    continue
                name = self._name(event.kv.key)
                if event.type == kv_pb2.Event.DELETE:
                    self._view.pop(name, None)
                    changes.append(Change(name, None, event.kv.mod_revision))
                else:
                    self._view[name] = event.kv.value
                    changes.append(Change(name, event.kv.value, event.kv.mod_revision))
            # The header's revision may be ahead of events still to come (etcd batches a
            # lagging watcher's events): only the last event's revision is certain.
            self._revision = max(applied, response.events[-1].kv.mod_revision)
            self._telling += 1
            self._cond.notify_all()
        self._tell(changes)

    def _replace(self, entries: list[tuple[bytes, bytes, int]], revision: int) -> None:
        """Make the view what a read at `revision` found, telling callbacks the difference."""
        fresh = {self._name(key): value for key, value, _ in entries}
        changed_at = {self._name(key): mod for key, _, mod in entries}
        with self._cond:
            if self._closed.is_set():
                return
            changes = [Change(name, value, changed_at[name]) for name, value in fresh.items()
                       if self._view.get(name) != value]
            changes += [Change(name, None, revision) for name in self._view if name not in fresh]
            self._view, self._revision = fresh, revision
            self._telling += 1
            self._cond.notify_all()
        self._tell(sorted(changes, key=lambda change: change.revision))

    def _tell(self, changes: list[Change]) -> None:
        """Tell the callbacks (counted in `_telling` by the caller, under the lock that saw
        the mirror open)."""
        try:
            if not changes:
                return
            with self._cond:
                callbacks = list(self._callbacks)
            for callback in callbacks:
                try:
                    callback(changes)
                except Exception:
                    _log.exception("watch on %s: a callback failed", self.key)
        finally:
            with self._cond:
                self._telling -= 1
                self._cond.notify_all()
