"""Kill a worker of a running job and watch the survivors recover in place.

    python examples/recover_in_place.py [--nodes 4] [--kill node3.0:backward@3] [--steps 8]

Starts a local job (a store, the controller, one process per node) training
configs/tiny.yaml with two pipelines of two stages (f = 1), makes one worker SIGKILL
itself at the given phase, and prints the controller's decisions and every worker's
log. Outputs go to runs/recover-in-place/.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from planaria.elastic.local_job import LocalJob

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--kill", default="node3.0:backward@3",
                        help="NODE.LOCAL:PHASE@ITERATION (see planaria.runtime.worker.fault_injection)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=str(REPO / "runs" / "recover-in-place"))
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    job = LocalJob(REPO / "configs" / "tiny.yaml",
                   [f"train.steps={args.steps}", "train.log_every=1", "comm.backend=gloo",
                    "fault_tolerance.f=1", "parallel.min_stages=2", "data.source=synthetic"],
                   nodes=args.nodes, out_dir=out, faults=args.kill)
    plan = job.initial_plan()
    print("epoch 0:", " | ".join(
        " -> ".join(f"{s.node} {s.chunks[0][0]}-{s.chunks[0][1] - 1}" for s in p.stages)
        for p in plan.pipelines))
    result = job.run(timeout_s=600)
    print(f"\noutcome: {result.outcome} in {result.seconds:.1f} s")
    for e in result.controller.events:
        print(f"epoch {e.epoch}: {e.reason}, failed {e.failed}, resumed at iteration "
              f"{e.first_iteration}, {e.transfers} layer transfers "
              f"({(e.published_s - e.detected_s) * 1000:.0f} ms from detection to the new plan)")
    print(job.logs())
    return 0 if result.outcome == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
