"""The control plane at scale: etcd's requests and bytes, and the time of each
reconfiguration, for N simulated nodes of G workers (`planaria.chaos.scale`).

    python benchmarks/control_plane_scale.py --nodes 8 64 128 --gpus-per-node 8 --no-peer-snapshots

More nodes than `--nodes-per-process` (64) run in node processes of that many each
(one interpreter's threads carry about 64 simulated nodes of 8 workers);
`--log-dir` keeps every agent's log. At a thousand nodes this machine's two cores,
not the control plane, are the limit: `--step-s`, `--lease-ttl`, `--monitor-interval`,
`--watcher-quiet`, `--relay-margin` and `comm.*` overrides give the simulation room
(docs/benchmarks.md says which were used for which figures), and each fault's line
says where the nodes' CPU went, by kind of thread. For each N, on a fresh three-member etcd: the
job starts (an epoch trained everywhere), a quiet
window measures the steady state, then each fault in turn (a node killed, a node
joining, a planned leave, the leader's node killed, a node cut off by a partition) is
measured from the fault to the next epoch's first step: when it was detected, when the
statuses were in, when the record was published, when every worker held it and had
bootstrapped its groups, and what etcd served meanwhile (its own counters: requests
and bytes, which this machine's load cannot distort). A Markdown table goes to stdout,
the raw figures to --json.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from planaria.chaos.scale.scale_run import Reconfiguration, ScaleHarness
from planaria.chaos.scale.sim_relay import MARGIN_S
from planaria.elastic.agent_options import POLL_S
from planaria.runtime.worker.epoch_watcher import QUIET_S
from planaria.chaos.scale.thread_cpu import difference

FAULTS = ("kill", "join", "leave", "kill-leader", "partition")


def _non_leader(harness: ScaleHarness, skip: int = 0) -> int:
    leader = harness.leader()
    live = [i for i in harness.live() if i != leader]
    return live[-1 - skip]


def run_faults(harness: ScaleHarness, faults, log, on_change=lambda change: None,
               timeout_s: float = 900.0) -> list[Reconfiguration]:
    """Each fault in turn, measured, each given `timeout_s` (`--timeout`, per phase: a
    join at 1,024 nodes outlasted the harness's own 600 s); `on_change` is given each as
    it is measured."""
    changes = []
    for fault in faults:
        reconfigure = functools.partial(harness.reconfigure, timeout_s=timeout_s)
        if fault == "kill":
            victim = _non_leader(harness)
            change = reconfigure(lambda: harness.kill_node(victim), "node killed")
        elif fault == "join":
            change = reconfigure(harness.add_node, "node joins")
        elif fault == "leave":
            victim = _non_leader(harness)
            # A notice just inside the controller's window (`PlannedLeaves.leaving`: a leave
            # needs two of the job's measured steps and 3 s, and is planned from 10 s more
            # than that): acted on at once, rather than a training-long wait for its deadline
            # to come near. The measured step is the sleep and the wait for the other ranks,
            # up to 15% longer than --step-s at 1,024 nodes: with 2 steps + 5 s, that made
            # the notice too short for a planned leave, which went down the failure path.
            # Sized from the step the controller measures (`measured_step_s`), not --step-s.
            grace = 2.3 * harness.measured_step_s() + 8.0
            log(f"  planned leave: node{victim} noticed, {grace:.0f} s of grace")
            change = reconfigure(lambda: harness.notice(victim, grace), "planned leave")
        elif fault == "kill-leader":
            change = reconfigure(harness.kill_leader, "leader's node killed")
        elif fault == "partition":
            victim = _non_leader(harness)
            heals = []
            change = reconfigure(lambda: heals.append(harness.partition([victim])), "node cut off")
            heals[0]()
        else:
            raise ValueError(f"unknown fault {fault!r}; choose from {', '.join(FAULTS)}")
        failed = change.notes.get("failed_epochs")
        log(f"  {change.kind}: epoch {change.epoch}, {change.etcd.total} requests, "
            f"bootstrapped {change.bootstrapped_s:.2f} s after the fault"
            + (f" (epochs {failed} failed on the way)" if failed else ""))
        log("    the nodes' CPU s by thread: " + _top(change.cpu_by_kind))
        changes.append(change)
        on_change(change)
        time.sleep(harness.step_s * 3)  # the new epoch trains a few steps: a join is deferred until it has
    return changes


def _top(cpu_by_kind: dict[str, float], kinds: int = 8) -> str:
    """The kinds of thread that spent the most CPU, in a line."""
    top = sorted(cpu_by_kind.items(), key=lambda kv: -kv[1])[:kinds]
    return ", ".join(f"{kind} {cpu:.1f}" for kind, cpu in top)


def measure(nodes: int, relay: bool, args, log, save=lambda: None, result: dict | None = None) -> dict:
    """One N: the start, the steady state and each fault. The figures are filled in as
    they come, and `save` is called after each step: a run that fails at a thousand nodes
    still leaves what it measured (in `result`, when given)."""
    result = {} if result is None else result
    overrides = [*([] if args.peer_snapshots else ["checkpoint.memory_every=0"]), *args.overrides]
    result.update({"nodes": nodes, "gpus_per_node": args.gpus_per_node, "node_relay": relay,
              "lease_ttl_s": args.lease_ttl, "relay_margin_s": args.relay_margin,
              "monitor_interval_s": args.monitor_interval, "watcher_quiet_s": args.watcher_quiet,
              "step_s": args.step_s, "niceness": args.nice, "etcd_retry_s": args.etcd_retry,
              "etcd_timeout_s": args.etcd_timeout, "idle": args.idle,
              "peer_snapshots": args.peer_snapshots, "overrides": args.overrides,
              "changes": []})
    with ScaleHarness(nodes=nodes, gpus_per_node=args.gpus_per_node, config=args.config, step_s=args.step_s,
                      backend=args.backend, node_relay=relay, overrides=overrides, lease_ttl_s=args.lease_ttl,
                      relay_margin_s=args.relay_margin, monitor_interval_s=args.monitor_interval,
                      watcher_quiet_s=args.watcher_quiet, join_timeout_s=args.join_timeout,
                      niceness=args.nice, etcd_retry_s=args.etcd_retry, etcd_timeout_s=args.etcd_timeout,
                      idle=args.idle,
                      log_dir=_log_dir(args.log_dir, nodes, relay),
                      processes=_processes(nodes, args.nodes_per_process), log=log) as harness:
        started = time.monotonic()
        cpu = harness.harness_cpu()
        harness.start(timeout_s=args.timeout)
        result.update(first_epoch=harness.epoch(), start_s=time.monotonic() - started, processes=harness.processes,
                      start_cpu_by_kind=harness.nodes.cpu_by_kind())
        log(f"{nodes} nodes x {args.gpus_per_node}, node relay {'on' if relay else 'off'}: epoch "
            f"{result['first_epoch']} bootstrapped and trained {result['start_s']:.1f} s after the start")
        log("    the nodes' CPU s by thread: " + _top(result["start_cpu_by_kind"]))
        time.sleep(args.step_s * 3)
        by_kind = harness.nodes.cpu_by_kind()
        quiet, window = harness.steady(args.steady_s)
        result.update(steady_window_s=window, steady_cpu_by_kind=difference(harness.nodes.cpu_by_kind(), by_kind),
                      steady={"requests": dict(quiet.requests), "received_bytes": quiet.received_bytes,
                              "sent_bytes": quiet.sent_bytes})
        log(f"  steady: {quiet.total / window:.1f} requests/s ({dict(quiet.requests)} in {window:.1f} s)")
        log("    the nodes' CPU s by thread: " + _top(result["steady_cpu_by_kind"]))
        save()

        def measured(change: Reconfiguration) -> None:
            result["changes"].append({**asdict(change), "etcd": {
                "requests": dict(change.etcd.requests), "received_bytes": change.etcd.received_bytes,
                "sent_bytes": change.etcd.sent_bytes}})
            result.update(harness_cpu_s=harness.harness_cpu() - cpu, wall_s=time.monotonic() - started)
            save()
        run_faults(harness, args.faults, log, measured, timeout_s=args.timeout)
    return result


def _write_json(path: str, results: list[dict]) -> None:
    """The figures so far, replaced whole (a reader never sees half a file)."""
    partial = Path(path + ".partial")
    partial.write_text(json.dumps([r for r in results if r], indent=1))
    os.replace(partial, path)


def _log_dir(root: str | None, nodes: int, relay: bool):
    """Where a run's logs are kept (etcd's, each agent's), if asked."""
    return None if root is None else Path(root) / f"{nodes}-nodes-relay-{'on' if relay else 'off'}"


def _processes(nodes: int, per_process: int) -> int:
    """The node processes for `nodes` nodes: one (the harness's own) up to `per_process`."""
    return 1 if nodes <= per_process else -(-nodes // per_process)


def table(results: list[dict]) -> str:
    lines = ["| nodes x GPUs | node relay | steady req/s (per node) | steady KB/s | fault | requests (per node) | "
             "MB | detected | statuses | published | all hold record | all bootstrapped | largest write |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        n, window = r["nodes"], r["steady_window_s"]
        steady = sum(r["steady"]["requests"].values()) / window
        kb = (r["steady"]["received_bytes"] + r["steady"]["sent_bytes"]) / window / 1e3
        for i, c in enumerate(r["changes"]):
            total = sum(c["etcd"]["requests"].values())
            mb = (c["etcd"]["received_bytes"] + c["etcd"]["sent_bytes"]) / 1e6
            relay = "on" if r.get("node_relay", True) else "off"
            head = (f"| {n} x {r['gpus_per_node']} | {relay} | {steady:.1f} ({steady / n:.2f}) | {kb:.0f} |" if i == 0
                    else "| | | | |")
            lines.append(f"{head} {c['kind']} | {total} ({total / n:.1f}) | {mb:.2f} | {c['detected_s']:.2f} | "
                         f"{c['statuses_s']:.2f} | {c['published_s']:.2f} | {c['records_held_s']:.2f} | "
                         f"{c['bootstrapped_s']:.2f} | {c['largest_write'] / 1024:.0f} KiB |")
    return "\n".join(lines)


def cpu_table(results: list[dict]) -> str:
    """Where the two cores went during each reconfiguration: the harness process (every
    simulated agent, relay and worker), the leading agent's thread (its controller and
    planner) and etcd's members, against the time from the fault to the first step."""
    lines = ["| nodes x GPUs | node relay | fault | fault to first step (s) | harness CPU s | "
             "leader's thread CPU s | etcd CPU s |", "|---|---|---|---|---|---|---|"]
    for r in results:
        relay = "on" if r.get("node_relay", True) else "off"
        for c in r["changes"]:
            lines.append(f"| {r['nodes']} x {r['gpus_per_node']} | {relay} | {c['kind']} | {c['first_step_s']:.2f} | "
                         f"{c['controller_cpu_s']:.1f} | {c.get('leader_cpu_s', 0.0):.2f} | "
                         f"{c.get('etcd_cpu_s', 0.0):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--config", default="configs/llama3-70b.yaml")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                        help="whose bootstrap the simulated workers replay (default nccl: a GPU job's)")
    parser.add_argument("--step-s", type=float, default=2.0, help="a simulated step's length")
    parser.add_argument("--steady-s", type=float, default=20.0, help="the quiet window")
    parser.add_argument("--faults", nargs="*", default=list(FAULTS), choices=FAULTS)
    parser.add_argument("--timeout", type=float, default=900.0, help="per phase")
    parser.add_argument("--relay", choices=("on", "off", "both"), default="on",
                        help="each node's workers reach etcd through their agent's relay (on, the default), "
                             "each through its own client (off, --no-node-relay), or both in turn for each N")
    parser.add_argument("--no-peer-snapshots", dest="peer_snapshots", action="store_false",
                        help="checkpoint.memory_every=0: no peer-snapshot group, whose gloo full mesh over "
                             "every rank makes each rank read every other's address (N^2 reads of rank 0's "
                             "epoch store: 67 million at 8,192 workers)")
    parser.add_argument("--lease-ttl", type=int, default=5,
                        help="the agents' lease TTL in seconds (default 5, the agent's own): longer where "
                             "this machine's cores, simulating thousands of workers, are slower to renew "
                             "a lease than a node's own CPUs would be")
    parser.add_argument("--relay-margin", type=float, default=MARGIN_S,
                        help=f"how long past its own wait a simulated worker's call to its node's relay may "
                             f"take (default {MARGIN_S:.0f} s, a real worker's): more where the machine is saturated")
    parser.add_argument("--monitor-interval", type=float, default=POLL_S,
                        help=f"how often each agent looks at its workers and the job (default {POLL_S:g} s, "
                             "the agent's own): longer where a thousand agents' looks would take this "
                             "machine's cores")
    parser.add_argument("--watcher-quiet", type=float, default=QUIET_S,
                        help=f"how long each worker's epoch watcher waits for a word before it asks its "
                             f"node's relay again (default {QUIET_S:g} s, a real worker's; requests to the "
                             "relay, none to etcd); other than the default, its waits for an epoch and "
                             "its rendezvous's abandon watch wait as long")
    parser.add_argument("--join-timeout", type=float, default=600.0,
                        help="the agents' join_timeout: how long the first nodes wait for all N to come")
    parser.add_argument("--etcd-retry", type=float, default=30.0,
                        help="how long each agent retries an etcd request before it gives up (the "
                             "agent's --etcd-retry, default 30 s)")
    parser.add_argument("--etcd-timeout", type=float, default=5.0,
                        help="each agent's etcd request timeout and its streams' ping timeout (the "
                             "agent's --etcd-timeout, default 5 s)")
    parser.add_argument("--nice", type=int, default=0,
                        help="the node processes' niceness: above 0, etcd's members are scheduled before "
                             "the simulated nodes' threads (the CPU each spends is measured either way)")
    parser.add_argument("--idle", action="store_true",
                        help="the node processes under SCHED_IDLE: they run on what CPU etcd's members "
                             "and the harness leave (stronger than --nice where hundreds of their threads "
                             "are runnable at once)")
    parser.add_argument("--nodes-per-process", type=int, default=64,
                        help="more nodes than this run in node processes of this many each (one "
                             "interpreter's threads carry about 64 simulated nodes of 8 workers)")
    parser.add_argument("--json", help="write the raw figures here")
    parser.add_argument("overrides", nargs="*", help="config overrides for the job (key=value), e.g. "
                        "comm.connect_timeout_s=300 where the machine is saturated")
    parser.add_argument("--log-dir", help="keep etcd's and every agent's logs here, one directory per run")
    args = parser.parse_args(argv)
    # A stopped run still stops its etcd members and removes their data (the harness's exit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    relays = {"on": [True], "off": [False], "both": [False, True]}[args.relay]
    results: list[dict] = []

    def save() -> None:
        if args.json:
            _write_json(args.json, results)
    for n in args.nodes:
        for relay in relays:
            results.append({})  # this N's figures, filled in as they come
            measure(n, relay, args, log, save=save, result=results[-1])
            save()
    print(table(results))
    print()
    print(cpu_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
