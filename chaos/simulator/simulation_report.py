"""What `planaria simulate` prints: per policy ETTR, tokens, tokens per dollar and time to
a token target, as a table, as JSON, and as a plot of throughput over the trace."""
from __future__ import annotations

import json
import math
from pathlib import Path

from planaria.chaos.simulator.runner import POLICIES, Simulation
from planaria.chaos.simulator.simulation import ACCOUNTS, SimResult


def policy_summary(sim: Simulation, result: SimResult, target_tokens: float) -> dict:
    gpus = sim.gpus_per_node
    gpu_hours = sim.availability.node_seconds() * gpus / 3600
    cost = gpu_hours * sim.prices.spot
    total = sum(result.accounts.values()) or 1.0
    reconfigurations = sum(1 for e in result.events if e["downtime_s"] > 0)
    return {
        "ettr": result.ettr,
        "tokens": result.tokens,
        "tokens_per_s": result.tokens / result.duration_s if result.duration_s else 0.0,
        "gpu_hours": gpu_hours,
        "cost_usd": cost,
        "tokens_per_dollar": result.tokens / cost if cost else 0.0,
        "time_to_target_s": result.time_to_tokens(target_tokens),
        "n0": sim.n0.get(result.policy),
        "checkpoint_every_s": None if math.isinf(result.checkpoint_every_s) else result.checkpoint_every_s,
        "checkpoints": result.checkpoints,
        "checkpoint_loads": result.checkpoint_loads,
        "reconfigurations": reconfigurations,
        "downtime_s": sum(e["downtime_s"] for e in result.events),
        "stalls": len(result.stalled_at),
        "stalled_at_s": list(result.stalled_at),
        "node_seconds": {a: result.accounts[a] for a in ACCOUNTS},
        "node_seconds_share": {a: result.accounts[a] / total for a in ACCOUNTS},
    }


def summary(sim: Simulation, target_tokens: float) -> dict:
    av = sim.availability
    gpus = sim.gpus_per_node
    on_demand_tokens = sim.fault_free_tokens_per_s * av.duration_s
    on_demand_cost = av.peak * gpus * av.duration_s / 3600 * sim.prices.on_demand
    policies = {name: policy_summary(sim, result, target_tokens) for name, result in sim.results.items()}
    for name, reason in sim.unfit.items():
        policies[name] = {"fits": False, "reason": reason, "ettr": 0.0, "tokens": 0.0, "tokens_per_dollar": 0.0,
                          "time_to_target_s": None}
    return {
        "trace": {"name": av.name, "duration_s": av.duration_s, "peak_nodes": av.peak,
                  "smallest_nodes": av.smallest, "removals": av.removals,
                  "changes": len(av.changes), "node_hours": av.node_seconds() / 3600},
        "model": {"name": sim.job.name, "parameters": sim.job.shape.parameters,
                  "global_batch": sim.job.global_batch, "seq_len": sim.job.shape.seq_len},
        "hardware": sim.hardware, "gpus_per_node": gpus, "fault_tolerance": sim.fault_tolerance,
        "prices_per_gpu_hour": {"spot": sim.prices.spot, "on_demand": sim.prices.on_demand},
        "target_tokens": target_tokens,
        "calibration": sim.calibration.as_dict(),
        "policies": {name: policies[name] for name in POLICIES if name in policies},
        "on_demand": {"nodes": av.peak, "tokens": on_demand_tokens,
                      "tokens_per_dollar": on_demand_tokens / on_demand_cost if on_demand_cost else 0.0,
                      "note": "fault-free, Planaria's plan on the trace's peak node count, on-demand price"},
    }


def to_json(data: dict) -> str:
    return json.dumps(data, indent=2, default=lambda v: None if isinstance(v, float) and math.isinf(v) else v)


def _hours(seconds: float | None) -> str:
    if seconds is None:
        return "not reached"
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def print_table(data: dict, console) -> None:
    from rich.table import Table

    t = data["trace"]
    console.print(f"[bold]{data['model']['name']}[/] ({data['model']['parameters'] / 1e9:.1f}B parameters) on "
                  f"{data['hardware']} x {data['gpus_per_node']} per node, f={data['fault_tolerance']} | trace "
                  f"{t['name']}: {t['duration_s'] / 3600:.1f} h, {t['smallest_nodes']}-{t['peak_nodes']} nodes, "
                  f"{t['removals']} removals")
    table = Table(show_header=True, header_style="bold")
    for column in ("policy", "ETTR", "tokens", "tokens/s", "tokens/$ (spot)",
                   f"time to {data['target_tokens']:.3g} tokens", "n0", "ckpt every", "ckpt loads",
                   "reconfig.", "stalls"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, p in data["policies"].items():
        if p.get("fits") is False:
            table.add_row(name, "-", "-", "-", "-", "-", "-", "-", "-", "-", "does not fit (below)")
            continue
        every = p["checkpoint_every_s"]
        table.add_row(name, f"{p['ettr']:.3f}", f"{p['tokens']:.3e}", f"{p['tokens_per_s']:,.0f}",
                      f"{p['tokens_per_dollar']:,.0f}", _hours(p["time_to_target_s"]), str(p["n0"]),
                      "-" if every is None else f"{every / 60:.1f} min", str(p["checkpoint_loads"]),
                      str(p["reconfigurations"]), str(p["stalls"]))
    console.print(table)
    for name, p in data["policies"].items():
        if p.get("stalls"):
            when = ", ".join(_hours(t) for t in p["stalled_at_s"][:8]) + (" ..." if p["stalls"] > 8 else "")
            console.print(f"[yellow]{name} stalled {p['stalls']} time(s): fewer than n0={p['n0']} live nodes "
                          f"held the model, at {when}[/]")
    od = data["on_demand"]
    console.print(f"on demand, no faults, {od['nodes']} nodes: {od['tokens']:.3e} tokens, "
                  f"{od['tokens_per_dollar']:,.0f} tokens/$")


def _binned(series, duration_s: float, bins: int) -> tuple[list[float], list[float]]:
    """Time-weighted mean of a step function (time, value, ...) over equal bins."""
    width = duration_s / bins
    points = [(t, v) for t, v, *_ in series] + [(duration_s, 0.0)]
    sums = [0.0] * bins
    for (t0, v), (t1, _) in zip(points, points[1:]):
        b = int(t0 // width)
        while t0 < t1 and b < bins:
            end = min(t1, (b + 1) * width)
            sums[b] += v * (end - t0)
            t0, b = end, b + 1
    return [(i + 0.5) * width for i in range(bins)], [x / width for x in sums]


def plot(sim: Simulation, path: Path, bins: int = 120) -> None:
    """Per policy: throughput averaged over short windows (time down counts as zero) with the
    live nodes behind it, and the tokens kept so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, kept) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True,
                                   gridspec_kw={"height_ratios": [3, 2]})
    duration = sim.availability.duration_s
    for name, result in sim.results.items():
        centres, rates = _binned(result.series, duration, bins)
        ax.plot([c / 3600 for c in centres], rates, label=name, linewidth=1.2)
        kept.plot([t / 3600 for t, _ in [(0.0, 0.0), *result.token_times]],
                  [k for _, k in [(0.0, 0.0), *result.token_times]], label=name, linewidth=1.2)
    ax.set_ylabel(f"tokens/s (mean over {duration / bins / 60:.0f} min)")
    ax.set_ylim(bottom=0)
    nodes = ax.twinx()
    counts = sim.availability.counts() + [(duration, sim.availability.counts()[-1][1])]
    nodes.step([c[0] / 3600 for c in counts], [c[1] for c in counts], where="post", color="grey",
               alpha=0.35, label="live nodes")
    nodes.set_ylabel("live nodes")
    nodes.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    extra = nodes.get_legend_handles_labels()
    ax.legend(handles + extra[0], labels + extra[1], loc="lower left", fontsize=8)
    kept.set_ylabel("tokens kept")
    kept.set_xlabel("hours")
    kept.legend(loc="upper left", fontsize=8)
    ax.set_title(f"{sim.job.name} on {sim.availability.name} ({sim.hardware}, f={sim.fault_tolerance})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
