"""The command line of a node's agent, `python -m planaria.elastic.agent`: its options,
their defaults (several are torchrun's, several can come from the environment, as
`planaria-run` passes them), and the settings they make.

Apart from the agent so that the launcher can read options as the agent does
(`parse_signals`) without loading the agent. Imports no torch (a node's agent loads it).
"""
from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from planaria.elastic.etcd_client import EtcdSettings
from planaria.elastic.metrics import PORT_ENV, port_number
from planaria.elastic.preemption import SOURCES
from planaria.elastic.worker_output import OutputSpec, ranks_filter, std_of

POLL_S = 0.1
"""How often the agent looks at its workers and the job, by default (--monitor-interval)."""
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""torchrun's --signals-to-handle."""


def node_range(text: str) -> tuple[int, int | None]:
    """`--nnodes`: "N" (at least N, no maximum) or "MIN:MAX", as torchrun writes it."""
    try:
        low, _, high = text.partition(":")
        bounds = int(low), int(high) if high else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN:MAX (numbers of nodes)") from None
    if bounds[0] < 1 or (bounds[1] is not None and bounds[1] < bounds[0]):
        raise argparse.ArgumentTypeError(f"{text!r}: MIN must be at least 1 and MAX at least MIN")
    return bounds


def parse_signals(names: str) -> list[signal.Signals]:
    """torchrun's --signals-to-handle: comma-separated names, such as SIGTERM,SIGUSR1."""
    found = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        try:
            found.append(signal.Signals[name])
        except KeyError:
            raise ValueError(f"unknown signal {name!r} in --signals-to-handle; give names such as "
                             f"SIGTERM,SIGUSR1") from None
    return found


def _seconds(text: str) -> float:
    """A positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds above 0")
    return value


def etcd_timeouts(timeout_s: float) -> dict:
    """EtcdSettings' per-request timeout and the keep-alive of its streams, which follows
    it: a stream's member is pinged every 2 x `timeout_s` (10 s at least: etcd refuses
    pings more often than 5 s) and must answer within `timeout_s`, so that an etcd whose
    answers take longer than 5 s (far away, or loaded) does not have every watch and
    lease stream of every node broken and reopened again and again."""
    return {"timeout_s": timeout_s, "keepalive_s": max(10.0, 2 * timeout_s)}


def _metrics_port(text: str) -> int:
    try:
        return port_number(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def agent_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m planaria.elastic.agent",
                                     description="Run one node's agent of an elastic Planaria job.")
    parser.add_argument("--node", required=True, help="this node's name, unique in the job")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--etcd", required=True, help="etcd endpoint host:port")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--nnodes", type=node_range, required=True, metavar="MIN[:MAX]",
                        help="nodes to wait for before epoch 0; the most a plan uses (beyond it, nodes wait "
                             "as spares and replace failed ones; default: no maximum)")
    parser.add_argument("--join-timeout", type=float, default=600.0,
                        help="seconds for MIN nodes to come before the job fails (default 600, torchrun's)")
    parser.add_argument("--last-call-timeout", type=float, default=0.0,
                        help="seconds to wait for more nodes, up to MAX, once MIN are here (default 0: "
                             "start at once; later nodes join at a step boundary)")
    parser.add_argument("--monitor-interval", type=float, default=POLL_S,
                        help=f"seconds between looks at the workers and the job (default {POLL_S})")
    parser.add_argument("--lease-ttl", type=int, default=5, help="seconds (default 5)")
    parser.add_argument("--hardware", default="h100", help="cost model preset for the planner")
    parser.add_argument("--etcd-retry", type=float, default=30.0,
                        help="seconds to retry an unreachable etcd while starting (default 30)")
    parser.add_argument("--etcd-timeout", type=_seconds, default=5.0,
                        help="seconds an etcd request may take before it is retried, and a watch or "
                             "lease stream's member may take to answer a ping (default 5)")
    parser.add_argument("--etcd-outage-limit", type=float, default=0.0,
                        help="seconds a running job waits for etcd to come back before this agent "
                             "gives up and stops its workers (default 0: as long as it takes)")
    parser.add_argument("--etcd-ca-cert", default=None, help="CA certificate (PEM) for TLS to etcd")
    parser.add_argument("--etcd-cert", default=None, help="client certificate (PEM) for TLS to etcd")
    parser.add_argument("--etcd-key", default=None, help="client key (PEM) for TLS to etcd")
    parser.add_argument("--etcd-user", default=None,
                        help="etcd user name; the password is read from PLANARIA_ETCD_PASSWORD")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="times this node's workers are started again after one of them dies, "
                             "rejoining the job as new capacity (default 0: the node leaves)")
    parser.add_argument("--signals-to-handle", default=DEFAULT_SIGNALS,
                        help=f"signals that stop this node's workers and take the node out (default {DEFAULT_SIGNALS})")
    parser.add_argument("--shutdown-timeout", type=float,
                        default=float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30)),
                        help="seconds stopped workers get before SIGKILL (default 30, or "
                             "TORCH_ELASTIC_SHUTDOWN_TIMEOUT)")
    parser.add_argument("--preemption-notice", choices=SOURCES,
                        default=os.environ.get("PLANARIA_PREEMPTION_NOTICE", "signal"),
                        help="where this node learns that it will be preempted: signal (the signals of "
                             "--preemption-signals, as Kubernetes and Slurm send them), aws, gcp or azure "
                             "(the cloud's instance metadata); the node then leaves at a step boundary and "
                             "hands its layers over (default signal, or PLANARIA_PREEMPTION_NOTICE)")
    parser.add_argument("--preemption-grace", type=float,
                        default=float(os.environ.get("PLANARIA_PREEMPTION_GRACE", 30)),
                        help="seconds between a notice signal and the node's end (the scheduler's grace "
                             "period: Kubernetes' terminationGracePeriodSeconds, Slurm's --signal); 0: the "
                             "signal stops the node at once (default 30, or PLANARIA_PREEMPTION_GRACE)")
    parser.add_argument("--preemption-signals", default=os.environ.get("PLANARIA_PREEMPTION_SIGNALS", "SIGTERM"),
                        help="the signals read as a notice under --preemption-notice signal; a second one "
                             "stops the node at once (default SIGTERM)")
    parser.add_argument("--preemption-endpoint", default=os.environ.get("PLANARIA_PREEMPTION_ENDPOINT"),
                        help="the cloud's metadata address (default: the cloud's documented one)")
    parser.add_argument("--local-addr", default=None,
                        help="the address other nodes reach this one at (default: that of "
                             "GLOO_SOCKET_IFNAME's interface, else this host's route to etcd)")
    parser.add_argument("--metrics-port", type=_metrics_port, default=os.environ.get(PORT_ENV, "0"),
                        help="serve Prometheus metrics on this port, at the --local-addr address "
                             f"(docs/monitoring.md; default 0: off, or {PORT_ENV})")
    parser.add_argument("--no-node-relay", dest="node_relay", action="store_false",
                        default=os.environ.get("PLANARIA_NODE_RELAY", "1") != "0",
                        help="let each worker reach etcd itself, not through this agent's relay, which "
                             "reads, follows and writes for all of the node's workers at once "
                             "(docs/control_plane.md, 'At scale'; or PLANARIA_NODE_RELAY=0)")
    parser.add_argument("--log-dir", default=None,
                        help="write each worker's output to DIR/<node>.<local>.log (default: this output)")
    parser.add_argument("--run-log-dir", default=None,
                        help="torchrun's --log-dir layout: DIR/attempt_<n>/<local rank>/{stdout,stderr}.log and "
                             "error.json (DIR: <log dir>/<run id>_<random>, shared by a machine's agents)")
    parser.add_argument("--redirects", default="0", help="torchrun's -r, with --run-log-dir (default 0)")
    parser.add_argument("--tee", default="0", help="torchrun's -t, with --run-log-dir (default 0)")
    parser.add_argument("--local-ranks-filter", default="", help="torchrun's, with --run-log-dir")
    parser.add_argument("--local-rank-offset", type=int, default=0,
                        help="the machine-wide local rank of this node's first worker (default 0)")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", default=[])
    return parser


def etcd_settings(args: argparse.Namespace) -> EtcdSettings:
    """etcd's endpoint, TLS and credentials: the options given, else PLANARIA_ETCD_*
    (the password, and etcd's request limits, only from PLANARIA_ETCD_PASSWORD,
    PLANARIA_ETCD_MAX_REQUEST_BYTES and PLANARIA_ETCD_MAX_TXN_OPS)."""
    given = {"ca_cert": args.etcd_ca_cert, "cert_cert": args.etcd_cert,
             "cert_key": args.etcd_key, "user": args.etcd_user}
    from_env = EtcdSettings.from_env(args.etcd)
    return EtcdSettings(endpoint=args.etcd, retry_s=args.etcd_retry, **{
        name: value if value is not None else getattr(from_env, name) for name, value in given.items()},
        password=from_env.password, max_request_bytes=from_env.max_request_bytes,
        max_txn_ops=from_env.max_txn_ops, **etcd_timeouts(args.etcd_timeout))


def output_spec(args: argparse.Namespace) -> OutputSpec | None:
    """torchrun's output options, with --run-log-dir; None without (--log-dir or the console)."""
    if not args.run_log_dir:
        return None
    std_of(args.redirects, 0), std_of(args.tee, 0)  # refuse a malformed choice now
    return OutputSpec(Path(args.run_log_dir), args.redirects, args.tee,
                      ranks_filter(args.local_ranks_filter), args.local_rank_offset)
