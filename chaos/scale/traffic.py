"""Whether simulated workers make a real worker's requests: two store traces compared,
worker by worker and key by key.

Both traces are written by `planaria.runtime.worker.store_trace.TracingStore`: a real
job's under `PLANARIA_STORE_TRACE`, the scale harness's under its `trace_dir`. Two runs
of the same plan and faults never make the same requests in the same numbers: a poll
asks as often as the time it waits allows. `per_key` keeps what does not depend on time
(module constants say what is set aside, and why); `differences` compares two runs'
requests, `size_differences` the sizes of the records they write.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

RENDEZVOUS = re.compile(r"^epoch/\d+/pg/")
"""The process groups' bootstrap keys: their values' sizes are the plan's (a gloo
address: 154 bytes and 8 per rank of the group; an NCCL id: 128), compared exactly."""
RECONFIGURE = re.compile(r"^epoch/\d+/reconfigure$")
"""The control plane's word that an epoch is over. Each worker asks for it from its
epoch watcher (a `check` every 0.2 s) and, during a rendezvous, whether to give up (a
`check` every 10 ms); it reads the word (`get`) only when a check found it before the
epoch ended on that worker. Whether that happens is timing: a stop for a join is agreed
in the commit all-reduce, so every worker stops after the same step whichever of them
saw the word; after a peer died, each worker's own collective fails at once, and the
word that follows (the controller declares the epoch failed on the first status it
reads) may or may not reach a watcher before the epoch is torn down. So a `get` of it
is set aside, and only the checks are compared."""

HANDED = re.compile(r"^epoch/(\d+)/handed/")
"""A leaving worker's word that its layers landed in an epoch (`keys.epoch_handed_off`).
After it the worker waits for that epoch's first step (`leaving.LEAVE_LINGER_S`) and
asks for the epoch's end (a `check` of `RECONFIGURE`) only when the step did not come
in time: whether it does on a loaded machine is timing, so that check is set aside."""


RECORD_SIZE_FACTOR = 1.5
"""How far the size of a record's value (anything written outside the rendezvous) may be
from a real worker's: their values hold numbers and messages whose width varies from run
to run (times, losses, pids, a collective's error), and a status after a failure lists
one round of peer snapshots or two, as the exchange of the last step was over or not
when the peer died (381 or 526 bytes in the test's job). A field the simulation leaves
out shows: its statuses were 2.5 times smaller than the real ones before it kept peer
snapshots."""


def read_trace(path: str | Path) -> list[dict]:
    """A trace's operations in the order they were requested (a line cut short by a
    killed worker is dropped: it is the last)."""
    ops = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            ops.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return ops


def read_traces(directory: str | Path) -> dict[str, list[dict]]:
    """{worker name ("node.local"): its operations} of every trace in `directory`."""
    return {path.name.removesuffix(".jsonl"): read_trace(path) for path in sorted(Path(directory).glob("*.jsonl"))}


def label(op: dict, key: str) -> str | None:
    """What of `op` on `key` is compared: its kind, with a rendezvous value's size and the
    error it failed with, if any; None for what is set aside (`RECONFIGURE`). The size of
    a record (a status, a timing, the progress: JSON of times, losses and pids) is not
    the same in two runs: `size_differences` compares it within `RECORD_SIZE_FACTOR`."""
    if op["op"] == "get" and RECONFIGURE.match(key):
        return None
    failed = f"!{op['error']}" if "error" in op else ""
    if "bytes" in op and RENDEZVOUS.match(key):
        return f"{op['op']}({op['bytes']}){failed}"
    return op["op"] + failed


READS = ("check", "get", "get_if_present")
"""Reads, which a followed key's mirror answers without a request (`EtcdKeyValue.follow`)."""


def per_key(ops: list[dict]) -> dict[str, list[str]]:
    """{key: its operations in order}, consecutive repeats collapsed (a poll's `check
    check check get` is `check get`, the progress's puts one `put`: how many a wait or a
    publisher makes is how long it waited or trained), keys in order of first use.

    A key followed (`follow`: a read and a watch) is read from its mirror until it is
    unfollowed: those reads are no requests, and how many of them two pollers of the same
    key make (the epoch watcher, a rendezvous's abandonment) is timing, so they are set
    aside; so is `unfollow`, the end of a watch's stream, which a killed process never
    gets to (its stream ends with its connection). So are the reads of an epoch's end
    after the worker's word that it left that epoch (`HANDED`)."""
    sequences: dict[str, list[str]] = {}
    followed: set[str] = set()
    handed: set[str] = set()  # (the `RECONFIGURE` keys of epochs this worker left: `HANDED`)
    for op in ops:
        for key in op.get("keys") or ([op["key"]] if "key" in op else [""]):
            if op["op"] == "unfollow":
                followed.discard(key)
                continue
            if op["op"] in READS and (key in followed or key in handed):
                continue
            if (left := HANDED.match(key)) and op["op"] == "set":
                handed.add(f"epoch/{left.group(1)}/reconfigure")
            if op["op"] == "follow" and "error" not in op:
                followed.add(key)
            item = label(op, key)
            if item is None:
                continue
            sequence = sequences.setdefault(key, [])
            if not sequence or sequence[-1] != item:
                sequence.append(item)
    return sequences


def differences(real: dict[str, list[dict]], simulated: dict[str, list[dict]], limit: int = 12) -> list[str]:
    """Where two runs' traces differ, readable: workers only one run has, then for each
    worker the first `limit` keys whose normalised operations differ (in the order the
    real worker first used them). Empty when they agree."""
    found = [f"worker {w}: only in the {side} run" for side, (a, b) in
             (("real", (real, simulated)), ("simulated", (simulated, real))) for w in sorted(set(a) - set(b))]
    for worker in sorted(set(real) & set(simulated)):
        found += _worker_differences(worker, per_key(real[worker]), per_key(simulated[worker]), limit)
    return found


def record_sizes(ops: list[dict]) -> dict[str, int]:
    """{key: the largest value written to it} of the records written in `ops` (the
    rendezvous's values are compared by `per_key`)."""
    sizes: dict[str, int] = {}
    for op in ops:
        if "bytes" in op and not RENDEZVOUS.match(op["key"]):
            sizes[op["key"]] = max(sizes.get(op["key"], 0), op["bytes"])
    return sizes


def size_differences(real: dict[str, list[dict]], simulated: dict[str, list[dict]],
                     factor: float = RECORD_SIZE_FACTOR) -> list[str]:
    """The records that both runs' workers wrote whose sizes are more than `factor` apart."""
    found = []
    for worker in sorted(set(real) & set(simulated)):
        ours, theirs = record_sizes(real[worker]), record_sizes(simulated[worker])
        for key in [k for k in ours if k in theirs]:
            if not ours[key] / factor <= theirs[key] <= ours[key] * factor:
                found.append(f"{worker} {key}: real {ours[key]} bytes, simulated {theirs[key]}")
    return found


def _worker_differences(worker: str, real: dict[str, list[str]], simulated: dict[str, list[str]],
                        limit: int) -> list[str]:
    keys = [*real, *(k for k in simulated if k not in real)]
    differing = [k for k in keys if real.get(k) != simulated.get(k)]
    lines = [f"{worker} {k}: real {_show(real.get(k))} != simulated {_show(simulated.get(k))}"
             for k in differing[:limit]]
    if len(differing) > limit:
        lines.append(f"{worker}: and {len(differing) - limit} more key(s)")
    return lines


def _show(sequence: list[str] | None) -> str:
    return "(never used)" if sequence is None else " ".join(sequence)
