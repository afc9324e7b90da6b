"""Time from a node's death to its detection, with the agents' default lease settings.

    python benchmarks/detection.py [--repeats 3] [--lease-ttl 5]

A job of 4 agents (one worker each, configs/tiny.yaml, 2 pipelines of 2 stages) on an
embedded etcd. Once it trains, a node that is not the leader is SIGKILLed whole (its
agent and its worker: a process group, as a machine vanishes). Measured from the kill,
by watching etcd from this process:

  lease      the node's keys vanish: its lease expired (the lease's TTL bounds it; this
             is how a dead node is seen when nothing else notices it)
  new epoch  the leader published the next epoch: the survivors' collectives failed as
             the dead worker's sockets closed, they reported, the controller re-planned

Medians over repeats.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = ["train.steps=400", "data.source=synthetic", "fault_tolerance.f=1", "parallel.min_stages=2",
       "comm.backend=gloo", "train.log_every=100000", "output.save_final=false"]


def one_run(endpoint: str, ttl: int, out: Path, run_id: str) -> dict:
    from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
    from planaria.runtime.contract import keys
    from planaria.runtime.contract.logs import COMMITS, log_path

    client = EtcdClient(EtcdSettings(endpoint=endpoint))
    prefix = keys.run_prefix(run_id)
    agents = {}
    for i in range(4):
        node = f"node{i}"
        agents[node] = subprocess.Popen(
            [sys.executable, "-m", "planaria.elastic.agent", "--node", node, "--etcd", endpoint,
             "--run-id", run_id, "--nnodes", "4", "--lease-ttl", str(ttl), "--log-dir", str(out / "logs"),
             str(REPO / "configs" / "tiny.yaml"), *JOB, f"output.dir={out}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        commits = log_path(out, COMMITS, "node0.0")
        deadline = time.monotonic() + 120
        while not (commits.exists() and len(commits.read_text().splitlines()) >= 3):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job did not start training; see {out / 'logs'}")
            time.sleep(0.05)
        leader = client.get(prefix + keys.LEADER)[0].decode()
        victim = next(n for n in ("node3", "node2", "node1") if n != leader)
        t0 = time.time()
        os.killpg(agents[victim].pid, signal.SIGKILL)
        lease = epoch = None
        while lease is None or epoch is None:
            now = time.time()
            if lease is None and client.get(prefix + keys.alive((victim, 0)))[0] is None:
                lease = now - t0
            if epoch is None and (client.get(prefix + keys.EPOCH)[0] or b"0") != b"0":
                epoch = now - t0
            if now - t0 > 120:
                raise RuntimeError("no detection within 120 s")
            time.sleep(0.01)
        return {"lease_s": lease, "new_epoch_s": epoch}
    finally:
        for agent in agents.values():
            try:
                os.killpg(agent.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            agent.wait()


def main(argv: list[str] | None = None) -> int:
    from planaria.elastic.etcd_server import EmbeddedEtcd

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lease-ttl", type=int, default=5, help="the agents' default is 5 s")
    args = parser.parse_args(argv)
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    runs = []
    with EmbeddedEtcd() as etcd, tempfile.TemporaryDirectory(prefix="planaria-detect-") as tmp:
        for r in range(args.repeats):
            result = one_run(etcd.endpoint, args.lease_ttl, Path(tmp) / str(r), f"detect-{r}")
            runs.append(result)
            print(f"repeat {r + 1}: lease expired after {result['lease_s']:.2f} s, new epoch after "
                  f"{result['new_epoch_s']:.2f} s", flush=True)
    lease = statistics.median(r["lease_s"] for r in runs)
    epoch = statistics.median(r["new_epoch_s"] for r in runs)
    print(f"\n| lease TTL | node's keys gone (lease) | next epoch published |\n|---:|---:|---:|\n"
          f"| {args.lease_ttl} s | {lease:.2f} s | {epoch:.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
