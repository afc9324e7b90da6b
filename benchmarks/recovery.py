"""Recovery time: Planaria's in-place recovery against a torchrun-style restart from a checkpoint.

    python benchmarks/recovery.py [--repeats 3] [--steps 34] [--kill-after 29]
                                  [--checkpoint-every 20] [--set section.key=value ...]
                                  [--json out.json]

One job (configs/tiny.yaml with 8 blocks of d_model 256, seq 128, batch 16 in
microbatches of 2, float32, gloo, 4 worker processes as 2 pipelines of 2 stages,
checkpoints every --checkpoint-every steps) is run twice per repeat, side by side:

  planaria  `LocalJob` (the controller in this process, one process per node). When
            iteration --kill-after has committed, node3 (pipeline 1's last stage) is
            SIGKILLed. The three survivors recover in place.
  torchrun  `torchrun --standalone --nproc-per-node=4 --max-restarts=1
            --monitor-interval=0.1 -m planaria.train` with the same plan (pp=2, dp=2)
            and checkpoints: rank 3 is SIGKILLed at the same point; torchrun stops the
            other workers, starts four new ones, and they resume from the newest
            checkpoint, re-running the steps since.

The checkpoint interval. By default both sides checkpoint every 20 steps and the kill
comes 10 steps after a checkpoint (iteration 29 committed, the checkpoint of 19 the
newest): half an interval, the expected loss of a failure at a random moment. That
favours torchrun: production jobs checkpoint far less often than every 20 steps
(torchtitan's shipped configs use 500; writing a large model's state to shared storage
takes minutes, so jobs checkpoint every hour or so), and its loss grows with the
interval while Planaria's does not (it never reads a checkpoint here).

Reported per run, from the kill: the time to the first completed step after it, the
time until the job is back where it was (the first commit of an iteration it had not
committed before the kill), and, for Planaria, until it trains again (the new epoch's
layers in place: what remains of the first is the interrupted iteration, one whole step
on the survivors). The fault-free step time (median between commits before the kill)
is given beside them, and the steps re-run, counted on both sides the same way from
the steps the job logged (Planaria: the workers' commit logs; torchrun: metrics.jsonl):
the last step committed before the kill, minus the first step the resumed job commits,
plus one; 0 when the resumed job's first step is a new one. The step interrupted by the
kill was never committed, so it is in neither count; a roll-forward (a survivor applying
a step its peers committed, without computing it) is not a re-run. For Planaria, the first is split into:
  detection     the kill until the controller sees the process gone;
  statuses      until every survivor reported its status (their collectives failed);
  planning      the exactly-once rule, the planner, the transfers;
  rendezvous    the record published until every survivor joined the new process group;
  transfer      the layer state copied from replicas (bytes and bandwidth reported);
  re-run        until the first commit of the new epoch (the interrupted iteration).
Medians over repeats; the ratio is torchrun / Planaria.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from planaria.chaos.report import write_json_atomically
from planaria.runtime.contract import keys
from planaria.runtime.contract.epochs import EpochTiming
from planaria.runtime.contract.logs import COMMITS, CommitEntry, log_path, read_logs

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny.yaml"
JOB = ["model.n_layers=8", "model.d_model=256", "model.n_heads=4", "model.seq_len=128",
       "train.global_batch=16", "train.micro_batch=2", "train.dtype=float32", "train.recompute=false",
       "data.source=synthetic", "comm.backend=gloo", "parallel.tp=1", "train.log_every=1000",
       "output.save_final=false"]
PLANARIA = ["fault_tolerance.f=1", "parallel.min_stages=2"]
TORCHRUN = ["parallel.pp=2", "parallel.dp=2"]
NODES = 4


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _commits(out: Path) -> list[CommitEntry]:
    return [entry for entries in read_logs(out, COMMITS, CommitEntry).values() for entry in entries]


def run_planaria(job_args: list[str], steps: int, kill_after: int, out: Path) -> dict:
    from planaria.elastic.local_job import LocalJob

    job = LocalJob(CONFIG, [*job_args, *PLANARIA, f"train.steps={steps}"], nodes=NODES, out_dir=out,
                   log=lambda message: None)
    killed = {}

    def kill_when_committed(job, elapsed):
        if killed:
            return
        log = log_path(out, COMMITS, "node3.0")
        if log.exists() and any(CommitEntry.from_json(line).step >= kill_after
                                for line in log.read_text().splitlines() if line.strip()):
            killed["time"] = time.time()
            job.kill(("node3", 0))

    result = job.run(900, actions=kill_when_committed)
    if result.outcome != "ok" or not killed:
        raise RuntimeError(f"planaria run: {result.outcome}; killed: {bool(killed)}\n{job.logs()}")
    (event,) = result.controller.events
    timings = [EpochTiming.from_json(job.store.get(keys.epoch_timing(1, (f"node{i}", 0)))) for i in range(3)]
    t_kill = killed["time"]
    before = max(e.step for e in _commits(out) if e.time <= t_kill)
    after = [e for e in _commits(out) if e.time > t_kill]
    resumed = [e.step for e in after if e.epoch >= 1 and not e.rolled_forward]
    back = min(e.time for e in after if e.step > before)
    rendezvous = max(t.rendezvous_s for t in timings)
    transfer = max(t.transfer_s for t in timings)
    # The first commit of the new epoch (a worker may log a commit of the old epoch a
    # moment after the kill).
    first = min(e.time for e in after if e.epoch >= 1)
    received = sum(t.bytes_received for t in timings)
    seconds = max(t.transfer_seconds or 0.0 for t in timings)
    return {
        "first_step_s": first - t_kill, "back_s": back - t_kill,
        "steps_rerun": steps_rerun(before, resumed),
        "training_s": transfer - t_kill, "step_s": _step_before([(e.step, e.time) for e in _commits(out)], t_kill),
        "detection_s": event.detected_s - t_kill, "statuses_s": event.statuses_s - event.detected_s,
        "planning_s": event.published_s - event.statuses_s, "rendezvous_s": rendezvous - event.published_s,
        "transfer_s": transfer - rendezvous, "rerun_s": first - transfer,
        "bytes_moved": received, "transfer_bandwidth": received / seconds if seconds else 0.0,
        "first_iteration": event.first_iteration, "last_committed_before_kill": before,
    }


def steps_rerun(before: int, resumed: list[int]) -> int:
    """The steps committed before the kill and committed again after it: `before` (the
    last step committed before the kill) minus the first of `resumed` (the steps the
    resumed job committed), plus one; 0 when the resumed job starts past `before`."""
    if not resumed:
        raise RuntimeError("the job committed no step after the kill")
    return max(0, before - min(resumed) + 1)


def _step_before(commits: list[tuple[int, float]], t_kill: float) -> float:
    """The median time between consecutive commits, (step, time), before the kill (the
    job's step)."""
    times = sorted({step: at for step, at in commits if at <= t_kill}.items())
    return statistics.median(b[1] - a[1] for a, b in zip(times, times[1:]))


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def _rank_of(pid: int) -> int | None:
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(item[5:]) for item in env if item.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def torchrun_command(job_args: list[str], steps: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NODES}",
            "--max-restarts=1", "--monitor-interval=0.1", "-m", "planaria.train", str(CONFIG),
            *job_args, *TORCHRUN, f"train.steps={steps}", f"output.dir={out}"]


def run_torchrun(job_args: list[str], steps: int, kill_after: int, out: Path) -> dict:
    cmd = torchrun_command(job_args, steps, out)
    log = open(out.parent / f"{out.name}-torchrun.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    metrics, t_kill = out / "metrics.jsonl", None
    try:
        while t_kill is None and proc.poll() is None:
            if metrics.exists() and any(json.loads(line)["step"] >= kill_after
                                        for line in metrics.read_text().splitlines() if line.strip()):
                victims = [p for p in _children(proc.pid) if _rank_of(p) == NODES - 1]
                if victims:
                    t_kill = time.time()
                    os.kill(victims[0], signal.SIGKILL)
            time.sleep(0.02)
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    if proc.returncode != 0 or t_kill is None:
        raise RuntimeError(f"torchrun run failed (exit {proc.returncode}); see {log.name}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    before = max(r["step"] for r in records if r["time"] <= t_kill)
    after = [r for r in records if r["time"] > t_kill]
    restarted = [r for r in after if r["step"] <= before] or after  # re-run steps come first
    first = min(r["time"] for r in restarted)
    back = min(r["time"] for r in after if r["step"] > before)
    rerun = steps_rerun(before, [r["step"] for r in after])
    return {"first_step_s": first - t_kill, "back_s": back - t_kill,
            "step_s": _step_before([(r["step"], r["time"]) for r in records], t_kill),
            "steps_rerun": rerun, "last_committed_before_kill": before,
            "checkpoint_iteration": before - rerun}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=34)
    parser.add_argument("--kill-after", type=int, default=29,
                        help="kill once this iteration has committed (default 29: ten steps after a checkpoint)")
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="extra config overrides for both jobs")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if not 0 <= args.kill_after < args.steps - 2:
        parser.error("--kill-after must leave at least two steps after it")
    job_args = [*JOB, *args.set, f"checkpoint.every={args.checkpoint_every}"]
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"torchrun side: {shlex.join(torchrun_command(job_args, args.steps, Path('OUT')))}")
    runs = {"planaria": [], "torchrun": []}
    with tempfile.TemporaryDirectory(prefix="planaria-recovery-") as tmp:
        for r in range(args.repeats):
            order = ("planaria", "torchrun") if r % 2 == 0 else ("torchrun", "planaria")
            for side in order:
                out = Path(tmp) / f"{side}-{r}"
                result = (run_planaria(job_args, args.steps, args.kill_after, out) if side == "planaria"
                          else run_torchrun(job_args, args.steps, args.kill_after, out))
                runs[side].append(result)
                print(f"repeat {r + 1} {side}: first step after the kill {result['first_step_s']:.2f} s, "
                      f"back where it was {result['back_s']:.2f} s", flush=True)
    report(runs)
    if args.json:
        write_json_atomically(Path(args.json), runs)
    return 0


def report(runs: dict) -> None:
    med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
           for side, rs in runs.items()}
    p, t = med["planaria"], med["torchrun"]
    print("\n| | Planaria (in place) | torchrun restart + checkpoint | ratio torchrun / Planaria |")
    print("|---|---:|---:|---:|")
    for key, label in (("first_step_s", "kill → first completed step (s)"),
                       ("back_s", "kill → back where it was (s)")):
        print(f"| {label} | {p[key]:.2f} | {t[key]:.2f} | {t[key] / p[key]:.1f}x |")
    print(f"| kill → training again (s) | {p['training_s']:.2f} | | |")
    print(f"| steps re-run | {p['steps_rerun']:.0f} | {t['steps_rerun']:.0f} | |")
    print(f"| fault-free step (s) | {p['step_s']:.2f} | {t['step_s']:.2f} | |")
    print("\nPlanaria's recovery, split (medians, s):")
    print("| detection | statuses | planning | rendezvous | transfer | re-run | bytes moved | bandwidth |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {p['detection_s']:.3f} | {p['statuses_s']:.3f} | {p['planning_s']:.3f} | "
          f"{p['rendezvous_s']:.3f} | {p['transfer_s']:.3f} | {p['rerun_s']:.3f} | "
          f"{p['bytes_moved'] / 2**20:.1f} MiB | {p['transfer_bandwidth'] / 2**20:.0f} MiB/s |")


if __name__ == "__main__":
    sys.exit(main())
