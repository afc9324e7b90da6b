"""Releasing an epoch's blocked collectives when the control plane declares the epoch failed.

A collective waits for every peer of its group. A peer that dies closes its sockets and
gloo fails the others' operations at once; a peer that stops answering without closing
anything (a frozen process, a node cut off the network, a stuck kernel) leaves them
waiting until the operation's timeout (`comm.timeout_s`, minutes). Once the controller
has decided that the epoch failed, that wait is lost time for the whole job. A worker's
epoch watcher (`planaria.runtime.worker.elastic_worker`) sees the decision and calls
`release()` from its thread; the main thread's collective then fails as if a peer had
died, and the worker goes down its usual failure path (tear down, report its status).

How a blocked operation is released depends on the backend:

- **gloo** (`SocketRelease`). torch's `ProcessGroup.abort()` and `shutdown()` are
  empty for gloo (the `Backend` defaults; gloo has no abort), and neither they nor
  `destroy_process_group` return a blocked `wait()` (measured on torch 2.13). What gloo
  does notice at once is its connection closing: `shutdown(SHUT_RDWR)` on a connected
  socket wakes every read and write pending on it, and gloo fails the operations on
  that pair with "Connection closed by peer", the very error a dead peer gives. The
  sockets released are the TCP sockets this process opened since the epoch began,
  less listening ones (shutting gloo's listener down aborts the process) and less
  connections to the control plane's store (they must outlive the epoch). This is
  also what makes a worker's own release spread: its peers see its connections
  close. torchft's alternative, a process group run in a child process that is killed
  to abort, costs a pipe round trip and a shared-memory copy per operation (the
  pipeline's small sends included) and seconds to start a group; this costs nothing
  until it is used.
- **nccl** (`CommunicatorAbort`): `ncclCommAbort` on every communicator of the
  process, all at once from a thread each (`abort_concurrently` says why not torch's
  `_abort_process_group`, which aborts them one by one), with torch's own error
  handling told to abort communicators and leave the process alone
  (`planaria.runtime.contract.env.NCCL_RECOVERY`, docs/gpu.md).

Nothing here runs on the step's path: a release is built when an epoch starts (one
listing of the process's descriptors) and used only when an epoch fails.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

log = logging.getLogger(__name__)


def socket_inodes() -> dict[int, int]:
    """This process's sockets: {inode: file descriptor}, from /proc/self/fd."""
    found = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no procfs: nothing can be released this way
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (or the listing's own descriptor)
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(name)
    return found


def plain_ip(address: str) -> str:
    """An IP address as compared here: an IPv4 peer of an IPv6 socket ("::ffff:10.0.0.2")
    as the IPv4 address it is."""
    return address.removeprefix("::ffff:")


def _shut_down(fd: int, inode: int, keep_ports: Collection[int],
               only_to: tuple[Collection[str], int] | None = None) -> bool:
    """Shut one socket down if it is a connected TCP socket of the epoch (with `only_to`,
    (addresses, port): one connected to that port at one of those addresses). The descriptor
    is duplicated first and the copy checked to be the same socket, so that a number
    closed and reused since the listing is never touched; the copy is closed after."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        if os.fstat(dup).st_ino != inode:
            os.close(dup)
            return False
        sock = socket.socket(fileno=dup)  # owns `dup` now
    except OSError:
        os.close(dup)
        return False
    with sock:
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                return False
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return False  # a listener: gloo aborts the process if it fails
            peer = sock.getpeername()
            if only_to is not None and (peer[1] != only_to[1] or plain_ip(peer[0]) not in only_to[0]):
                return False
            if peer[1] in keep_ports or sock.getsockname()[1] in keep_ports:
                return False  # the control plane's connection (either end of it)
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:  # not connected, or closed meanwhile
            return False


class SocketRelease:
    """Releases gloo's blocked operations of one epoch by shutting its connections down
    (module docstring). Made before the epoch's first process group, so that it knows
    which sockets were there already."""

    def __init__(self, keep_ports: Collection[int] = ()):
        self.keep_ports = frozenset(keep_ports)
        self._before = frozenset(socket_inodes())
        self._lock = threading.Lock()
        self.released = False

    def keep(self, port: int) -> None:
        """Leave connections to or from `port` alone too: the next epoch's bootstrap store,
        connected to while this epoch trains (`prepared_groups`), which that epoch needs
        whether or not this one fails."""
        with self._lock:
            self.keep_ports = self.keep_ports | {port}

    def release(self) -> str:
        """Shut down the epoch's connections; says how many. Safe from any thread, at any
        time, more than once."""
        with self._lock:
            self.released = True
            count = shut_down_sockets(lambda inode: inode not in self._before, self.keep_ports)
            return f"{count} connection(s) shut down"


def shut_down_sockets(which: Callable[[int], bool], keep_ports: Collection[int] = (),
                      only_to: tuple[Collection[str], int] | None = None) -> int:
    """Shut down this process's connected TCP sockets whose inode `which` accepts (never a
    listener, nor a connection to `keep_ports`; with `only_to`, (addresses, port), only
    connections to that port at one of those IP addresses); how many were."""
    return sum(_shut_down(fd, inode, keep_ports, only_to) for inode, fd in socket_inodes().items() if which(inode))


class CommunicatorAbort:
    """Releases NCCL's blocked operations of one epoch by aborting every communicator of
    the process (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.released = False

    def keep(self, port: int) -> None:
        """(Sockets are not what an abort touches: `SocketRelease.keep`.)"""

    def release(self) -> str:
        """Abort the process's communicators; says how many."""
        with self._lock:
            self.released = True
            if not dist.is_initialized():
                return "no communicator yet"
            groups = registered_groups()
            if groups is None:  # a torch without the registry read below: its own abort, one by one
                try:
                    dist.distributed_c10d._abort_process_group()
                except (RuntimeError, ValueError) as err:  # destroyed meanwhile: nothing left to abort
                    log.warning("abort of the epoch's communicators: %s", err)
                    return f"nothing aborted: {err}"
                return "communicators aborted"
            return f"{abort_concurrently(groups)} communicator(s) aborted"


def registered_groups() -> list[dist.ProcessGroup] | None:
    """Every process group of this process, the world's included (torch's registry, a
    private field read as `_abort_process_group` reads it); None where it is missing."""
    names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
    return None if names is None else list(names)  # list() of a dict: one step under the GIL


def abort_concurrently(groups: Collection[dist.ProcessGroup]) -> int:
    """`abort()` every group at once, one thread each; returns how many aborted.

    Why not torch's `_abort_process_group()`: it aborts the groups one after another,
    and each NCCL abort takes about a second whatever the group (measured on an H200,
    torch 2.11, NCCL 2.28: 1.0 s for one group, 3.9 s for four, docs/gpu.md), so a survivor
    of an epoch with several groups waited seconds more for every group it had. Side by
    side the aborts overlap: four groups in 1.0 s. Concurrent aborts also keep what
    torch's NCCL group around the aborts is for (pytorch/pytorch#119797): no abort waits
    for another communicator's kernel to stop, since every one is aborted at once.
    The registry is left to `destroy_process_group` on the main thread, which tears the
    epoch down after its collective fails."""
    if not groups:
        return 0
    with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="planaria-abort") as pool:
        aborts = [pool.submit(group.abort) for group in groups]
    # (a group destroyed meanwhile, or aborted already: nothing left to do for it)
    failures = [err for err in (a.exception() for a in aborts) if err is not None]
    for err in failures:
        log.warning("abort of one of the epoch's communicators: %s", err)
    return len(aborts) - len(failures)


def group_options(backend: str):
    """Options for an epoch's process groups of `backend`: for NCCL, non-blocking
    communicators (`ncclConfig_t.blocking = 0`, as torchft makes them), whose creation
    and abort return instead of blocking the thread, so that a communicator still
    connecting to a dead peer can be aborted like any other (each then waits at most
    TORCH_NCCL_NONBLOCKING_TIMEOUT, `env.nccl_recovery`); None (torch's defaults) for gloo."""
    if backend != "nccl":
        return None
    if not dist.is_nccl_available():
        raise RuntimeError("comm.backend is nccl, but this torch has no NCCL (a CPU build?); "
                           "use comm.backend=gloo, or install a CUDA build of torch")
    options = dist.ProcessGroupNCCL.Options()
    options.config.blocking = 0
    return options


def epoch_release(backend: str, keep_ports: Collection[int] = ()) -> SocketRelease | CommunicatorAbort:
    """The release for an epoch of `backend` ("gloo" or "nccl"), made before its groups."""
    if backend == "nccl":
        return CommunicatorAbort()
    if backend == "gloo":
        return SocketRelease(keep_ports)
    raise ValueError(f"no way to release collectives of backend {backend!r}; use gloo or nccl")
