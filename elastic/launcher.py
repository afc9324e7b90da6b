"""`planaria-run`: torchrun's command line, with in-place recovery for Planaria jobs.

    planaria-run [torchrun's options] -m planaria.train CONFIG.yaml [section.key=value ...]
    planaria-run [torchrun's options] your_script.py [args]

The options are parsed by torchrun's own parser (`torch.distributed.run.get_args_parser`),
so every flag, default, `PET_*` environment form and error message is torchrun's.

- A Planaria training job (`-m planaria.train`) runs under Planaria's agents: the node's
  workers recover in place when others fail, and new nodes are absorbed
  (`planaria.elastic.agent`). The job's store lives in etcd: `--rdzv-endpoint HOST:PORT`
  names it (`--rdzv-backend` etcd3 or etcd, both meaning the v3 API), and `--standalone`
  starts a private one on loopback. `--rdzv-id` is the run id; epoch 0 waits for the
  minimum of `--nnodes MIN:MAX` nodes (`join_timeout`, `last_call_timeout` in
  `--rdzv-conf` as torchrun's), and a plan uses at most MAX: more nodes wait as spares,
  their workers started, and replace failed nodes. With `--standalone` and
  `parallel.tp = 1`, each of the `--nproc-per-node` workers is a node of its own (a
  stage needs its whole node, so this is what lets a single machine lose one worker
  and go on), with a GPU of its own; otherwise the `--nproc-per-node` workers are one
  node's tp group. Several machines (`--nnodes` above 1) need one `--rdzv-id`.
  Planaria workers take their ranks from each epoch's plan, not from `RANK`.
  `--max-restarts N`: a node whose worker died starts its workers again, up to N
  times, and they rejoin as new capacity (torchrun restarts every worker of the job
  instead). `--log-dir`, `-r`, `-t`, `--local-ranks-filter` as torchrun's, in its
  layout (`planaria.elastic.worker_output`). `--signals-to-handle` and `--shutdown-timeout` (torch 2.12+) as torchrun's;
  a signal ends the job on this machine with exit code 128 + its number (torchrun: 1,
  with the SignalException's traceback). `--rdzv-conf` takes etcd's TLS and
  credentials: `ca_cert`, `cert_cert`, `cert_key` (or torch's `cacert`, `cert`, `key`),
  `user`, `password`; and `lease_ttl` (seconds, default 5). Every other option of
  torchrun's is honoured or refused with a word on what to do instead
  (`planaria.elastic.torchrun_options`): none is ignored.
- Any other script gets torchrun's behaviour (`torch.distributed.run.run`), including
  `--rdzv-backend etcd3`, Planaria's rendezvous on etcd 3.5+; with it, peers are also
  watched through etcd leases, so a peer node that freezes or vanishes restarts the
  world within `lease_ttl` seconds rather than after a collective timeout
  (`planaria.elastic.peer_watch`).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import uuid

from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
from torch.distributed.run import determine_local_world_size, get_args_parser
from torch.distributed.run import run as torchrun

from planaria.elastic.torchrun_options import node_bounds, refusals
from planaria.elastic.worker_output import ranks_filter, std_of

PLANARIA_MODULE = "planaria.train"


def main(argv: list[str] | None = None) -> int:
    parser = get_args_parser()
    parser.prog = "planaria-run"
    args = parser.parse_args(argv)
    if not (args.module and args.training_script == PLANARIA_MODULE):
        return run_torchrun(args)
    return run_planaria(args, parser)


def run_torchrun(args) -> int:
    """torchrun's `run`, with peers watched through etcd leases under `--rdzv-backend etcd3`
    (`planaria.elastic.peer_watch`). Raises ChildFailedError on failure, as torchrun does."""
    watch = _peer_watch(args)
    ok = False
    try:
        torchrun(args)
        ok = True
    finally:
        if watch is not None:
            watch.finish(ok)
    return 0


def _peer_watch(args):
    if args.rdzv_backend != "etcd3" or not args.rdzv_endpoint:
        return None
    from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
    from planaria.elastic.peer_watch import PeerWatch

    tls, lease_ttl = etcd_options(args.rdzv_conf)
    endpoint = args.rdzv_endpoint if ":" in args.rdzv_endpoint else f"{args.rdzv_endpoint}:2379"
    conf = _parse_rendezvous_config(args.rdzv_conf or "")
    prefix = f"{conf.get('key_prefix', '/planaria/torchrun/').rstrip('/')}/{args.rdzv_id}"
    client = EtcdClient(EtcdSettings(endpoint=endpoint, **tls))
    watch = PeerWatch(client, prefix, f"{socket.gethostname()}-{os.getpid()}", ttl_s=lease_ttl,
                      log=lambda line: print(line, file=sys.stderr, flush=True))
    watch.start()
    return watch


def one_gpu_each(nproc: int, backend: str, environ=os.environ) -> list[dict[str, str]]:
    """The environment of each of `--standalone`'s one-worker nodes: its own GPU, the i-th
    of those visible (each agent's worker is its node's local rank 0, so without this
    every worker would take the first GPU). Nothing to set where no GPU is visible."""
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        return [{} for _ in range(nproc)]
    if nproc > gpus and backend in ("auto", "nccl"):
        raise ValueError(f"--nproc-per-node={nproc} but {gpus} GPU(s) visible, and NCCL needs a GPU "
                         f"per worker: start at most {gpus}, or set comm.backend=gloo")
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in listed.split(",")][:gpus] if listed else [str(i) for i in range(gpus)]
    return [{"CUDA_VISIBLE_DEVICES": ids[i % gpus]} for i in range(nproc)]


def _nproc(value: str) -> int:
    """`--nproc-per-node` as torchrun reads it ("gpu", "cpu", "auto" or a number)."""
    try:
        nproc = determine_local_world_size(value)
    except ValueError as err:
        raise ValueError(f"--nproc-per-node {value}: {err}") from err
    if nproc < 1:
        raise ValueError(f"--nproc-per-node {value}: at least one worker per node")
    return nproc


_TLS_ALIASES = {"cacert": "ca_cert", "cert": "cert_cert", "key": "cert_key"}
"""torch's own etcd rendezvous names for the TLS files."""


def etcd_options(rdzv_conf: str) -> tuple[dict[str, str], int]:
    """(EtcdSettings' TLS and credential fields, lease TTL) from `--rdzv-conf`."""
    conf = _parse_rendezvous_config(rdzv_conf or "")
    settings = {_TLS_ALIASES.get(k, k): v for k, v in conf.items()
                if _TLS_ALIASES.get(k, k) in ("ca_cert", "cert_cert", "cert_key", "user", "password")}
    return settings, int(conf.get("lease_ttl", 5))


def agent_flags(args, tls: dict[str, str], lease_ttl: int, run_log_dir: str | None = None) -> list[str]:
    """The agent's options that carry torchrun's: restarts, monitoring, rendezvous
    timeouts, signals, shutdown, output, TLS."""
    flags = ["--max-restarts", str(args.max_restarts), "--lease-ttl", str(lease_ttl),
             "--signals-to-handle", args.signals_to_handle, "--monitor-interval", str(args.monitor_interval)]
    conf = _parse_rendezvous_config(args.rdzv_conf or "")
    join = conf.get("join_timeout", conf.get("timeout"))
    if join is not None:
        flags += ["--join-timeout", join]
    if "last_call_timeout" in conf:
        flags += ["--last-call-timeout", conf["last_call_timeout"]]
    # torchrun's parser has --shutdown-timeout from torch 2.12 on; before, the agent's default.
    if getattr(args, "shutdown_timeout", None) is not None:
        flags += ["--shutdown-timeout", str(args.shutdown_timeout)]
    if run_log_dir is not None:
        flags += ["--run-log-dir", run_log_dir, "--redirects", args.redirects, "--tee", args.tee,
                  "--local-ranks-filter", args.local_ranks_filter]
    if getattr(args, "local_addr", None):  # torchrun's: the address other nodes reach this one at
        flags += ["--local-addr", args.local_addr]
    for name, flag in (("ca_cert", "--etcd-ca-cert"), ("cert_cert", "--etcd-cert"),
                       ("cert_key", "--etcd-key"), ("user", "--etcd-user")):
        if name in tls:
            flags += [flag, tls[name]]
    return flags


def run_log_dir(args, run_id: str) -> str | None:
    """torchrun's <log dir>/<run id>_<random> (a temporary log dir when -r, -t or
    --local-ranks-filter come without one), or None when no option asks for files."""
    if not (args.log_dir or args.redirects != "0" or args.tee != "0" or args.local_ranks_filter):
        return None
    base = args.log_dir or tempfile.mkdtemp(prefix="torchelastic_")
    os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{run_id}_", dir=base)


def _check_options(args, parser) -> None:
    """ValueError naming every torchrun option set that a Planaria job does not use, and
    any malformed output or timeout choice, before anything starts."""
    conf = _parse_rendezvous_config(args.rdzv_conf or "")
    problems = refusals(args, parser, conf)
    for flag, value in (("--redirects", args.redirects), ("--tee", args.tee)):
        try:
            std_of(value, 0)
        except ValueError as err:
            problems.append(f"{flag} {err}")
    try:
        ranks_filter(args.local_ranks_filter)
        node_bounds(args.nnodes)
        for key in ("join_timeout", "timeout", "last_call_timeout", "lease_ttl"):
            if key in conf and float(conf[key]) < 0:
                raise ValueError(f"--rdzv-conf {key}={conf[key]}: must be 0 or more seconds")
    except ValueError as err:
        problems.append(str(err))
    if problems:
        raise ValueError("; ".join(problems))


def run_planaria(args, parser=None) -> int:
    from planaria.elastic.agent_options import parse_signals
    from planaria.elastic.etcd_client import EtcdSettings
    from planaria.elastic.etcd_server import EmbeddedEtcd
    from planaria.elastic.metrics import agent_port_env
    from planaria.runtime.config.loading import load_config
    from planaria.runtime.config.hf_config import check_init_from

    config, *overrides = args.training_script_args or [None]
    if config is None:
        print("planaria-run: -m planaria.train needs a config: -m planaria.train CONFIG.yaml", file=sys.stderr)
        return 2
    try:
        _check_options(args, parser or get_args_parser())
        cfg = load_config(config, overrides)
        check_init_from(cfg)  # before any worker starts: a missing tensor fails here, in one line
        signals = parse_signals(args.signals_to_handle)
        tls, lease_ttl = etcd_options(args.rdzv_conf)
        EtcdSettings(**tls)  # refuse missing TLS files before anything starts
        nproc = _nproc(str(args.nproc_per_node))
        # PLANARIA_METRICS_PORT: the agents of one machine cannot share a port; agent i takes PORT + i
        ports = agent_port_env(os.environ, nproc if args.standalone and cfg.parallel.tp == 1 else 1)
    except ValueError as err:
        print(f"planaria-run: {err}", file=sys.stderr)
        return 2
    min_nodes, max_nodes = node_bounds(args.nnodes)
    given_id = args.rdzv_id not in (None, "", "none")
    if not (given_id or args.standalone) and max_nodes > 1:
        # Each machine would invent its own run id and wait for the others forever.
        print("planaria-run: a job of several machines needs one run id: give every machine the "
              "same --rdzv-id", file=sys.stderr)
        return 2
    run_id = args.rdzv_id if given_id else f"run-{uuid.uuid4().hex[:8]}"
    server = None
    if args.standalone:
        server = EmbeddedEtcd().start()
        endpoint = server.endpoint
        print(f"planaria-run: standalone etcd on {endpoint}, run id {run_id}", flush=True)
    else:
        if args.rdzv_backend not in ("etcd3", "etcd", "etcd-v2") or not args.rdzv_endpoint:
            print("planaria-run: a Planaria job needs etcd: give --rdzv-backend etcd3 --rdzv-endpoint "
                  "HOST:PORT, or --standalone for a private one", file=sys.stderr)
            return 2
        endpoint = args.rdzv_endpoint if ":" in args.rdzv_endpoint else f"{args.rdzv_endpoint}:2379"
    per_node = cfg.parallel.tp
    if args.standalone and per_node == 1:
        nodes, min_nodes, max_nodes = [f"{socket.gethostname()}-{i}" for i in range(nproc)], nproc, nproc
        try:
            devices = [dict(gpu, **port) for gpu, port in zip(one_gpu_each(nproc, cfg.comm.backend), ports)]
        except ValueError as err:
            print(f"planaria-run: {err}", file=sys.stderr)
            return 2
    else:
        if nproc != per_node:
            print(f"planaria-run: --nproc-per-node={nproc} but parallel.tp={per_node}; a node's "
                  "workers are one stage's tp group, so they must be equal", file=sys.stderr)
            return 2
        nodes = [f"{socket.gethostname()}-{args.node_rank if args.node_rank is not None else os.getpid()}"]
        devices = [{}]  # the node's workers take their GPUs by local rank
    flags = agent_flags(args, tls, lease_ttl, run_log_dir(args, run_id))
    offsets = [i * per_node for i in range(len(nodes))]  # each agent's first worker's local rank
    env = dict(os.environ, **({"PLANARIA_ETCD_PASSWORD": tls["password"]} if "password" in tls else {}))
    agents = [subprocess.Popen(
        [sys.executable, "-m", "planaria.elastic.agent", "--node", node, "--nproc-per-node",
         str(per_node), "--etcd", endpoint, "--run-id", run_id, "--nnodes", f"{min_nodes}:{max_nodes}",
         "--local-rank-offset", str(offset), *flags, config, *overrides], env=dict(env, **device))
        for node, device, offset in zip(nodes, devices, offsets)]
    received: list[int] = []

    def forward(signum, frame) -> None:  # the agents stop their workers and leave
        received.append(signum)
        for agent in agents:
            if agent.poll() is None:
                agent.send_signal(signum)

    for signum in signals:
        signal.signal(signum, forward)
    try:
        codes = [agent.wait() for agent in agents]
    finally:
        if server is not None:
            server.stop()
    if received:
        return 128 + received[0]
    # The job succeeded if it ended "ok": agents whose node left it exit 1 on purpose.
    return 0 if 0 in codes else max(codes)


if __name__ == "__main__":
    sys.exit(main())
