"""`planaria demo`: Planaria's point in a few minutes on a laptop.

A small LLaMA-style model (`configs/demo.yaml`) trains on the Python standard
library's source on 4 local nodes. A node is killed, a new one arrives, another node
is killed; the job goes on from the survivors' replicas, without a checkpoint, and the
chaos harness compares every step's loss with the same job run without faults.

The faults are spaced so that the second one comes after the new node has joined: with
pipelines of two stages, 3 nodes hold one replica of each layer, 4 hold two.
"""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.panel import Panel

from planaria.chaos.faults import parse_fault
from planaria.chaos.harness import ChaosSettings, run_chaos
from planaria.runtime.config.loading import load_config

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
NODES = 4
FAULTS = ("kill-node@60:target=3", "add-node@70", "kill-node@230:target=1")


def intro(cfg, steps: int) -> str:
    m = cfg.model
    return (
        f"A LLaMA-style model ({m.n_layers} blocks, d_model {m.d_model}, RMSNorm, rotary attention, "
        f"SwiGLU) trains for {steps} steps on the Python standard library's source, on {NODES} "
        "local nodes: one agent per node and its worker, on a private etcd, every one a real "
        "process. Pipelines have two stages and every layer two replicas.\n\n"
        "While it trains:\n"
        "  step 60   node3 is killed (SIGKILL, agent and worker: a machine that vanishes)\n"
        "  step 70   a new node starts and joins at the next step boundary\n"
        "  step 230  node1 is killed\n\n"
        "Planaria re-plans the pipelines for the nodes left and copies the lost layers (weights "
        "and optimizer state) from their replicas, with no checkpoint. First the same job runs "
        "without faults as the reference (cached after the first demo); then the one with faults, "
        "compared step by step.")


def outro(out: Path, report) -> str:
    same = ("the same losses, bit for bit" if report.max_loss_diff == 0
            else f"losses within {report.max_loss_diff:.1e}")
    return (
        "What happened: each fault cost a few seconds (detect, re-plan, copy: the table above), "
        f"and the job went on with the very optimizer steps of the run without faults ({same}). "
        "No committed step was lost and nothing was reloaded from a checkpoint.\n\n"
        f"The plot: {out / 'report.png'} (loss against the reference, throughput, live nodes)\n"
        f"The numbers: {out / 'report.json'}\n"
        f"The logs of every agent and worker: {out / 'run' / 'logs'}\n\n"
        "Next: docs/chaos.md (every fault kind, random faults, trace replay), "
        "planaria chaos --help.")


def run_demo(out_dir: Path, console: Console, overrides: list[str] | None = None,
             fresh_reference: bool = False) -> int:
    if not CONFIG.is_file():
        console.print(f"planaria demo: {CONFIG} is missing; the demo runs from a clone of the "
                      "repository (pip install -e .)")
        return 2
    overrides = list(overrides or [])
    cfg = load_config(CONFIG, overrides)
    console.print(Panel(intro(cfg, cfg.train.steps), title="planaria demo", expand=False), soft_wrap=False)
    settings = ChaosSettings(CONFIG, overrides, nodes=NODES, faults=[parse_fault(f) for f in FAULTS],
                             out_dir=Path(out_dir), timeout_s=900.0, fresh_reference=fresh_reference)
    report = run_chaos(settings, console)
    ok = report.completed and report.committed_steps_lost == 0
    if ok:
        console.print(Panel(outro(Path(out_dir), report), title="nothing was lost", expand=False),
                      soft_wrap=False)
    else:
        console.print(f"[bold red]the demo's job did not finish cleanly: {report.outcome}[/]; "
                      f"see {Path(out_dir) / 'run' / 'logs'}")
    return 0 if ok else 1
