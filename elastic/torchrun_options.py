"""What `planaria-run` does with each of torchrun's options in a Planaria job.

A user who moves a command line from torchrun to `planaria-run -m planaria.train` must
get either torchrun's meaning or a refusal that says what Planaria does instead, never
an option silently ignored. Every option of torchrun's parser is listed here, once: in
`HONOURED` (with what it does) or in `REFUSED` (with the message given when it is set
to anything but its default). A test walks the parser and fails on an option in
neither; docs/control_plane.md's table says the same in prose. Other scripts than
`planaria.train` are handed to torchrun itself, which reads every option.
"""
from __future__ import annotations

import argparse

HONOURED: dict[str, str] = {
    "nnodes": "MIN:MAX (or N for N:N): epoch 0 waits for MIN nodes; a plan uses at most MAX; "
              "more nodes wait as spares, their workers started, and replace failed ones",
    "nproc_per_node": "workers per node (with --standalone and parallel.tp = 1, each worker is a node)",
    "rdzv_backend": "etcd3 or etcd (both etcd's v3 API; etcd-v2 read the same): the job's store",
    "rdzv_endpoint": "the etcd endpoint HOST[:PORT]",
    "rdzv_id": "the run id (the job's keys in etcd live under it)",
    "rdzv_conf": "etcd TLS and credentials, lease_ttl, join_timeout, last_call_timeout "
                 "(RDZV_CONF_KEYS); any other key is refused",
    "standalone": "a private etcd on loopback, one node per worker",
    "max_restarts": "restarts of a node's workers, each rejoining the running job as new capacity",
    "monitor_interval": "how often each agent looks at its workers and the job",
    "start_method": "as in torchrun: a module entrypoint always runs as a subprocess (the start "
                    "method applies to function entrypoints only)",
    "module": "-m planaria.train runs a Planaria job (any other module: torchrun itself)",
    "training_script": "planaria.train with -m",
    "training_script_args": "the config file and its section.key=value overrides",
    "log_dir": "torchrun's layout: DIR/<run-id>_<random>/attempt_<n>/<local rank>/"
               "{stdout.log,stderr.log,error.json}; attempt n is the node's restart count",
    "redirects": "as torchrun: a local rank's stdout/stderr to its files under the log dir",
    "tee": "as torchrun: to the files and to the console, lines prefixed [default<local rank>]:",
    "local_ranks_filter": "as torchrun: only these local ranks' output on the console (files whole)",
    "node_rank": "names this machine's node <host>-<node rank>",
    "local_addr": "the address other nodes reach this one at",
    "signals_to_handle": "forwarded to the agents: SIGTERM is a preemption notice, others stop the node",
    "shutdown_timeout": "seconds a stopped worker gets before SIGKILL",
}
"""torchrun option (its argparse `dest`) -> what it does in a Planaria job."""

REFUSED: dict[str, str] = {
    "event_log_handler": "Planaria records a job's events in its etcd store: read them with "
                         "`planaria status` (or its --json), or scrape the agents' --metrics-port",
    "role": "a Planaria job has one role; its workers' ranks come from each epoch's plan",
    "no_python": "a Planaria job runs `python -m planaria.train`; drop --no-python",
    "run_path": "a Planaria job runs `python -m planaria.train`; drop --run-path",
    "master_addr": "a Planaria job's store is etcd: give --rdzv-backend etcd3 --rdzv-endpoint HOST:PORT "
                   "(or --standalone) instead of --master-addr",
    "master_port": "a Planaria job's store is etcd: give --rdzv-backend etcd3 --rdzv-endpoint HOST:PORT "
                   "(or --standalone) instead of --master-port",
    "logs_specs": "a custom LogsSpecs is not loaded; --log-dir, -r, -t and --local-ranks-filter "
                  "write torchrun's default layout",
    "numa_binding": "workers are not bound to NUMA nodes; start planaria-run under numactl instead",
    "virtual_local_rank": "each worker keeps its own LOCAL_RANK (a Planaria job's ranks come from its plans)",
    "duplicate_stdout_filters": "lines are not duplicated to filtered_stdout.log; use -t/--tee and grep "
                                "the per-rank stdout.log files",
    "duplicate_stderr_filters": "lines are not duplicated to filtered_stderr.log; use -t/--tee and grep "
                                "the per-rank stderr.log files",
}
"""torchrun option -> why it is refused (when set to anything but its default), and what to do."""

RDZV_CONF_KEYS: dict[str, str] = {
    "ca_cert": "etcd CA certificate (PEM)", "cacert": "the same (torch's name)",
    "cert_cert": "client certificate (PEM)", "cert": "the same (torch's name)",
    "cert_key": "client key (PEM)", "key": "the same (torch's name)",
    "user": "etcd user name", "password": "etcd password (handed to workers in the environment)",
    "lease_ttl": "seconds a node's registration outlives its agent (default 5)",
    "join_timeout": "seconds for MIN nodes to come before the job fails (default 600, torchrun's)",
    "timeout": "the same as join_timeout (torch's etcd rendezvous' name)",
    "last_call_timeout": "seconds epoch 0 waits for more nodes, up to MAX, once MIN are there "
                         "(default 0: it starts at once and later nodes join at a step boundary)",
    "key_prefix": "where other scripts' peers are watched in etcd (not used by a Planaria job)",
}
"""`--rdzv-conf` keys a Planaria job reads; any other is refused by name."""


def refusals(args: argparse.Namespace, parser: argparse.ArgumentParser, conf: dict[str, str]) -> list[str]:
    """One message per option of `REFUSED` set to other than its default, and per
    `--rdzv-conf` key (`conf`, as torch parses it) that a Planaria job does not read."""
    messages = []
    for action in parser._actions:
        if action.dest in REFUSED and getattr(args, action.dest, action.default) not in (action.default, None, []):
            flag = max(action.option_strings, key=len)
            messages.append(f"{flag} is not used by a Planaria job: {REFUSED[action.dest]}")
    unknown = sorted(set(conf) - set(RDZV_CONF_KEYS))
    if unknown:
        messages.append(f"--rdzv-conf {', '.join(unknown)}: not read by a Planaria job; it reads "
                        f"{', '.join(RDZV_CONF_KEYS)}")
    return messages


def node_bounds(nnodes: str) -> tuple[int, int]:
    """`--nnodes` as torchrun reads it: "N" is N:N, "MIN:MAX" is both."""
    low, _, high = str(nnodes).partition(":")
    try:
        bounds = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"--nnodes {nnodes!r}: expected N or MIN:MAX") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise ValueError(f"--nnodes {nnodes!r}: MIN must be at least 1 and MAX at least MIN")
    return bounds
