"""`planaria-run`: torchrun's command line, with in-place recovery for Planaria jobs.

    planaria-run [torchrun's options] -m planaria.train CONFIG.yaml [section.key=value ...]
    planaria-run [torchrun's options] your_script.py [args]

The options are parsed by torchrun's own parser (`torch.distributed.run.get_args_parser`),
so every flag, default, `PET_*` environment form and error message is torchrun's.

- A Planaria training job (`-m planaria.train`) runs under Planaria's agents: the node's
  workers recover in place when others fail, and new nodes are absorbed
  (`planaria.elastic.agent`). The job's store lives in etcd: `--rdzv-endpoint HOST:PORT`
  names it (`--rdzv-backend` etcd3 or etcd, both meaning the v3 API), and `--standalone`
  starts a private one on loopback. `--rdzv-id` is the run id; the minimum of
  `--nnodes MIN:MAX` is how many nodes epoch 0 waits for. With `--standalone` and
  `parallel.tp = 1`, each of the `--nproc-per-node` workers is a node of its own (a
  stage needs its whole node, so this is what lets a single machine lose one worker
  and go on); otherwise the `--nproc-per-node` workers are one node's tp group.
  Planaria workers take their ranks from each epoch's plan, not from `RANK`.
- Any other script gets torchrun's behaviour unchanged (`torch.distributed.run.run`),
  including `--rdzv-backend etcd3`, Planaria's rendezvous on etcd 3.5+.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid

from torch.distributed.run import get_args_parser
from torch.distributed.run import run as torchrun

PLANARIA_MODULE = "planaria.train"


def main(argv: list[str] | None = None) -> int:
    parser = get_args_parser()
    parser.prog = "planaria-run"
    args = parser.parse_args(argv)
    if not (args.module and args.training_script == PLANARIA_MODULE):
        torchrun(args)  # raises ChildFailedError on failure, as torchrun does
        return 0
    return run_planaria(args)


def _nproc(value: str) -> int:
    if value.isdigit():
        return int(value)
    if value in ("gpu", "auto"):
        import torch

        return torch.cuda.device_count() or 1
    return 1  # "cpu", as torchrun counts it here: one worker per node


def run_planaria(args) -> int:
    from planaria.elastic.etcd_server import EmbeddedEtcd
    from planaria.runtime.config import load_config

    config, *overrides = args.training_script_args or [None]
    if config is None:
        print("planaria-run: -m planaria.train needs a config: -m planaria.train CONFIG.yaml", file=sys.stderr)
        return 2
    cfg = load_config(config, overrides)
    nproc = _nproc(str(args.nproc_per_node))
    min_nodes = int(str(args.nnodes).split(":")[0])
    run_id = args.rdzv_id if args.rdzv_id not in (None, "", "none") else f"run-{uuid.uuid4().hex[:8]}"
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
        nodes, min_nodes = [f"{socket.gethostname()}-{i}" for i in range(nproc)], nproc
    else:
        if nproc != per_node:
            print(f"planaria-run: --nproc-per-node={nproc} but parallel.tp={per_node}; a node's "
                  "workers are one stage's tp group, so they must be equal", file=sys.stderr)
            return 2
        nodes = [f"{socket.gethostname()}-{args.node_rank if args.node_rank is not None else os.getpid()}"]
    agents = [subprocess.Popen(
        [sys.executable, "-m", "planaria.elastic.agent", "--node", node, "--nproc-per-node",
         str(per_node), "--etcd", endpoint, "--run-id", run_id, "--nnodes", str(min_nodes),
         config, *overrides]) for node in nodes]
    try:
        codes = [agent.wait() for agent in agents]
    except KeyboardInterrupt:
        for agent in agents:
            agent.terminate()
        codes = [agent.wait() for agent in agents]
    finally:
        if server is not None:
            server.stop()
    # The job succeeded if it ended "ok": agents whose node left it exit 1 on purpose.
    return 0 if 0 in codes else max(codes)


if __name__ == "__main__":
    sys.exit(main())
