"""The chaos report's plot, `report.png`: loss against the reference with the faults
marked, throughput over time, and the nodes live and training over time. Drawn from a
`Report` alone (`load_report` reads one back from report.json)."""
from __future__ import annotations

import math
import os
from pathlib import Path

from planaria.chaos.report import InjectedFault, Report


def plot_report(report: Report, path: Path) -> Path:
    """Three panels sharing nothing but a purpose: loss against the reference with the
    faults marked (by step), throughput over time and live nodes over time."""
    faults = report.faults
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_rate, ax_nodes) = plt.subplots(3, 1, figsize=(9, 10), constrained_layout=True)
    ref = sorted(report.reference_losses.items())
    run = sorted(report.losses.items())
    ax_loss.plot([i for i, _ in ref], [v for _, v in ref], color="0.6", linewidth=3, label="reference (no faults)")
    ax_loss.plot([i for i, _ in run], [v for _, v in run], color="tab:blue", linewidth=1.2, label="with faults")
    named = len(faults) <= 12  # a soak's dozens of faults are marked, not named
    for k, fault in enumerate(faults):
        ax_loss.axvline(fault.step, color="tab:red", linestyle="--", linewidth=0.8 if named else 0.5,
                        label=None if named or k else f"faults ({len(faults)})")
        if named:
            ax_loss.annotate(fault.fault.split(":")[0], (fault.step, 1), xycoords=("data", "axes fraction"),
                             rotation=90, va="top", ha="right", fontsize=8, color="tab:red")
    ax_loss.set(xlabel="step", ylabel="loss", title="Loss against the fault-free reference")
    ax_loss.legend(loc="lower left")

    # Throughput: steps committed per bin of about a twentieth of the run; the last,
    # partial bin is divided by its own width.
    times = [t for t, _ in report.commit_times]
    span = times[-1] - times[0] if times else 0.0
    if span > 0:
        bin_s = max(0.5, span / 20)
        edges = [times[0] + k * bin_s for k in range(max(1, math.ceil(span / bin_s)))]
        bounds = edges[1:] + [times[-1]]
        counts = [sum(1 for t in times if lo <= t < hi or t == hi == times[-1]) / (hi - lo)
                  for lo, hi in zip(edges, bounds)]
        ax_rate.step(edges + [times[-1]], counts + counts[-1:], where="post", color="tab:green")
    ax_rate.set(xlabel="seconds since the first step", ylabel="steps / s", title="Throughput")

    end = times[-1] if times else None
    nodes = [(t, n) for t, n in report.live_nodes if end is None or t <= end]
    if nodes:
        ax_nodes.step([t for t, _ in nodes], [n for _, n in nodes], where="post", color="tab:purple",
                      label="live (agents running)")
        training = [(t, n) for t, n in report.training_nodes if end is None or t <= end]
        if training:
            ax_nodes.step([t for t, _ in training] + [end], [n for _, n in training] + [training[-1][1]],
                          where="post", color="tab:orange", linestyle="--", label="training (in the plan)")
        ax_nodes.set_ylim(0, max(n for _, n in nodes) + 1)
        ax_nodes.legend(loc="lower left")
    ax_nodes.set(xlabel="seconds since the first step", ylabel="nodes", title="Nodes")
    ax_nodes.yaxis.get_major_locator().set_params(integer=True)
    ax_nodes.sharex(ax_rate)
    if times:  # the start-up before the first step (minutes on a large model) is not the story
        ax_rate.set_xlim(left=-1.0, right=times[-1] + 0.5)
    for fault in faults:
        moment = _since_first_commit(report, fault)
        if moment is not None:
            for ax in (ax_rate, ax_nodes):
                ax.axvline(moment, color="tab:red", linestyle="--", linewidth=0.8)
    # Rendered beside it, then renamed over it: a crash never leaves half a picture.
    partial = Path(path).with_name(f".{Path(path).name}.partial")
    fig.savefig(partial, dpi=110, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)
    os.replace(partial, path)
    return path


def _since_first_commit(report: Report, fault: InjectedFault) -> float | None:
    return None if report.first_commit_time is None else fault.time - report.first_commit_time
