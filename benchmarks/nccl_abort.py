"""How long releasing an epoch's NCCL communicators takes: torch's abort, one group after
another, against Planaria's, every group at once (docs/gpu.md, "Figures").

    python benchmarks/nccl_abort.py [--groups 1 2 4] [--ways one-by-one threads] [--rounds 3]
                                    [--json out.json]
    python benchmarks/nccl_abort.py --backend gloo --rounds 1    # the script itself, on CPU

Each measurement is a fresh process on GPU 0 (an aborted communicator must not share a
process with the next measurement): a one-process world made as an epoch's are
(`group_options`: non-blocking communicators; `env.nccl_recovery`: Planaria's NCCL
environment, where the caller set none), `groups - 1` subgroups of it, an all-reduce on
every group (so that every communicator is connected), then the abort, timed:

  one-by-one  torch's `_abort_process_group()`: `abort()` on each group in turn;
  threads     `abort_concurrently(registered_groups())`: `abort()` on every group at
              once, a thread each, as `CommunicatorAbort.release` does.

Prints each process's time and, per (groups, way), the median of the rounds. The rounds
alternate the ways, so that the card's drift spreads over both. A variable of NCCL's or
torch's set for the command (`NCCL_CUMEM_ENABLE=0 python benchmarks/nccl_abort.py`)
reaches every process. `--backend gloo` runs the same steps on CPU, where an abort does
nothing (gloo has none): it checks the script, not NCCL.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

WAYS = ("one-by-one", "threads")


def measure(backend: str, groups: int, way: str) -> float:
    """In this process: the world and its subgroups, an all-reduce on each, the abort;
    the abort's seconds."""
    import torch
    import torch.distributed as dist

    from planaria.runtime.contract import env
    from planaria.runtime.parallel.release import abort_concurrently, group_options, registered_groups

    device = torch.device("cpu")
    if backend == "nccl":
        env.nccl_recovery(os.environ, timeout_s=60)
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1,
                                timeout=timedelta(seconds=60), pg_options=group_options(backend))
        made = [None, *(dist.new_group([0], pg_options=group_options(backend)) for _ in range(groups - 1))]
        for group in made:  # None: the world
            dist.all_reduce(torch.ones(4, device=device), group=group)
        if backend == "nccl":
            torch.cuda.synchronize()
        found = registered_groups()
        if found is None or len(found) != groups:
            raise RuntimeError(f"expected {groups} registered group(s), found {found}")
        started = time.monotonic()
        if way == "one-by-one":
            dist.distributed_c10d._abort_process_group()
        else:
            aborted = abort_concurrently(found)
            if aborted != groups:
                raise RuntimeError(f"{groups - aborted} of {groups} abort(s) failed")
        return time.monotonic() - started


def run_once(backend: str, groups: int, way: str) -> float:
    """One measurement in a fresh process."""
    proc = subprocess.run([sys.executable, __file__, "--backend", backend, "--worker", str(groups), way],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0")))
    if proc.returncode != 0:
        raise RuntimeError(f"{groups} group(s), {way}: exit {proc.returncode}\n{proc.stdout[-2000:]}"
                           f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["abort_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--json", type=Path, help="also write the times here")
    parser.add_argument("--worker", nargs=2, metavar=("GROUPS", "WAY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        groups, way = int(args.worker[0]), args.worker[1]
        print(json.dumps({"abort_s": measure(args.backend, groups, way)}))
        return 0
    if any(g < 1 for g in args.groups) or args.rounds < 1:
        parser.error("--groups and --rounds must be at least 1")
    if args.backend == "nccl":
        import torch
        import torch.distributed as dist

        if not torch.cuda.is_available() or not dist.is_nccl_available():
            parser.error("needs a GPU and a torch with NCCL; --backend gloo checks the script on CPU")
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    times: dict[str, list[float]] = {}
    for r in range(args.rounds):
        ways = args.ways if r % 2 == 0 else args.ways[::-1]
        for groups in args.groups:
            for way in ways:
                seconds = run_once(args.backend, groups, way)
                times.setdefault(f"{groups} {way}", []).append(seconds)
                print(f"round {r + 1}: {groups} group(s), {way}: {seconds:.3f} s", flush=True)
    print(f"\n| groups | {' | '.join(args.ways)} |\n|---:|{'---:|' * len(args.ways)}")
    for groups in args.groups:
        cells = [f"{statistics.median(times[f'{groups} {way}']):.2f} s" for way in args.ways]
        print(f"| {groups} | {' | '.join(cells)} |")
    if args.json:
        args.json.write_text(json.dumps({"backend": args.backend, "times": times}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
