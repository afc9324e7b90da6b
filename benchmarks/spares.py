"""A failed node replaced by a spare (`--nnodes MIN:MAX`) against one replaced by a new node.

    python benchmarks/spares.py [--repeats 3]

A job of 4 nodes (one worker each, configs/tiny.yaml, 2 pipelines of 2 stages), agents
on an embedded etcd. Once it trains, a node that is not the leader is SIGKILLed whole
(agent and worker: a process group, as a machine vanishes). Two ways back to 4 nodes:

  spare       5 agents under `--nnodes 4:4`: the fifth waits as a spare, its worker
              started; the recovery plans it in at once.
  new node    4 agents under `--nnodes 4`: at the kill, a fifth agent is started (what a
              cluster manager does when it replaces a machine); the survivors recover on
              3 nodes, and the new node joins once its worker has started (Python, torch,
              the model) at the next step boundary.

Measured from the kill, from the workers' commit logs and the epoch records in etcd:

  first step     the first step committed after the kill (any plan)
  back to 4      the first step committed by a plan of 4 nodes again

The two setups alternate, medians over repeats; the last line is the ratio.
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
JOB = ["train.steps=100000", "data.source=synthetic", "fault_tolerance.f=1", "parallel.min_stages=2",
       "comm.backend=gloo", "train.log_every=100000", "output.save_final=false"]
NODES = 4


def _agent(endpoint: str, run_id: str, node: str, nnodes: str, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "planaria.elastic.agent", "--node", node, "--etcd", endpoint, "--run-id", run_id,
         "--nnodes", nnodes, "--log-dir", str(out / "logs"), str(REPO / "configs" / "tiny.yaml"), *JOB,
         f"output.dir={out}"],
        stdout=open(out / f"agent-{node}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"))


def _commits(out: Path):
    from planaria.runtime.contract.logs import COMMITS, CommitEntry, read_logs

    return [entry for entries in read_logs(out, COMMITS, CommitEntry).values() for entry in entries]


def _plan_sizes(client, prefix: str) -> dict[int, int]:
    from planaria.runtime.contract import keys
    from planaria.runtime.contract.epochs import EpochRecord

    sizes, epoch = {}, 0
    while (text := client.get(prefix + keys.epoch_record(epoch))[0]) is not None:
        sizes[epoch] = len(EpochRecord.from_json(text).plan.nodes())
        epoch += 1
    return sizes


def one_run(endpoint: str, out: Path, run_id: str, spare: bool) -> dict:
    from planaria.elastic.etcd_client import EtcdClient, EtcdSettings
    from planaria.runtime.contract import keys
    from planaria.runtime.contract.epochs import EpochRecord

    out.mkdir(parents=True)
    client = EtcdClient(EtcdSettings(endpoint=endpoint))
    prefix = keys.run_prefix(run_id)
    nnodes = f"{NODES}:{NODES}" if spare else str(NODES)
    agents = {f"node{i}": _agent(endpoint, run_id, f"node{i}", nnodes, out) for i in range(NODES + spare)}
    try:
        deadline = time.monotonic() + 180
        while len(_commits(out)) < 4 * NODES:  # a few steps of the first plan
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job did not start training; see {out}")
            time.sleep(0.1)
        if spare and client.get(prefix + keys.SPARES)[0] in (None, b"[]"):
            raise RuntimeError("no spare waiting: the fifth node was planned in")
        leader = client.get(prefix + keys.LEADER)[0].decode()
        epoch = int(client.get(prefix + keys.EPOCH)[0])
        planned = EpochRecord.from_json(client.get(prefix + keys.epoch_record(epoch))[0]).plan.nodes()
        victim = max(n for n in planned if n != leader)  # a node that trains (not the spare), not the leader
        t0 = time.time()
        os.killpg(agents[victim].pid, signal.SIGKILL)
        if not spare:
            agents["node4"] = _agent(endpoint, run_id, "node4", nnodes, out)
        first = full = None
        deadline = time.monotonic() + 180
        while full is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"not back to {NODES} nodes within 180 s; see {out}")
            time.sleep(0.2)
            sizes = _plan_sizes(client, prefix)
            after = [c for c in _commits(out) if c.epoch > epoch and c.time > t0]
            if after:
                first = min(c.time for c in after) - t0
            back = [c.time for c in after if sizes.get(c.epoch) == NODES]
            if back:
                full = min(back) - t0
        return {"first_step_s": first, "back_to_full_s": full}
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
    args = parser.parse_args(argv)
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    runs: dict[str, list[dict]] = {"spare": [], "new node": []}
    with EmbeddedEtcd() as etcd, tempfile.TemporaryDirectory(prefix="planaria-spares-") as tmp:
        for r in range(args.repeats):
            for name in ("spare", "new node"):
                result = one_run(etcd.endpoint, Path(tmp) / f"{r}-{name.replace(' ', '-')}",
                                 f"spares-{r}-{name.replace(' ', '-')}", spare=name == "spare")
                runs[name].append(result)
                print(f"repeat {r + 1}, {name}: first step after {result['first_step_s']:.2f} s, back to "
                      f"{NODES} nodes after {result['back_to_full_s']:.2f} s", flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print(f"\n| | spare (`--nnodes {NODES}:{NODES}`, 5 nodes) | new node started at the kill | new / spare |\n"
          "|---|---:|---:|---:|")
    for key, label in (("first_step_s", "kill → first step"), ("back_to_full_s", f"kill → back to {NODES} nodes")):
        a, b = med["spare"][key], med["new node"][key]
        print(f"| {label} | {a:.2f} s | {b:.2f} s | {b / a:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
