"""The tables a chaos run prints at its end (the recoveries, the verdict) and the line it
prints for each reconfiguration as it happens: a `Report` and the leader's epoch events
made readable on a terminal. Reads them only; what they hold is `planaria.chaos.report`'s."""
from __future__ import annotations

from planaria.chaos.report import Recovery, Report
from planaria.runtime.contract.epochs import EpochEvent


def _fmt(value, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}{unit}"
    return f"{value}{unit}"


def format_epoch_event(event: EpochEvent) -> str:
    """One line for a reconfiguration the leader published (`keys.epoch_event`)."""
    who = "; ".join(part for part in (
        f"failed {', '.join(event.failed)}" if event.failed else "",
        f"joined {', '.join(event.joined)}" if event.joined else "",
        f"cut off {', '.join(event.cut_off)}" if event.cut_off else "",
        f"left {', '.join(event.left)}" if event.left else "") if part)
    count = event.transfers
    copies = f"{count} layer cop{'y' if count == 1 else 'ies'} ({event.moved_bytes / 2**20:.2f} MiB)"
    source = {"replicas": copies,
              "memory": f"back to the peer snapshots of step {event.snapshot} ({event.rerun} step(s) again), {copies}",
              "disk": f"back to the checkpoint of step {event.restored} ({event.rerun} step(s) again)"}[event.source]
    return (f"  [cyan]epoch {event.epoch}[/]: {event.reason} ({who or '-'}) -> pipelines of "
            f"{list(event.plan_shape)} stages from step {event.first_iteration}, {source}, "
            f"published {event.published_s - event.detected_s:.2f} s after detection")


def recovery_table(recoveries: list[Recovery]):
    from rich.table import Table

    table = Table(title="recoveries", title_justify="left")
    for column in ("fault", "step", "detect", "release", "plan", "transfer", "total", "pause", "switch", "source",
                   "copies",
                   "moved", "plan shape", "step time"):
        table.add_column(column, justify="left" if column == "fault" else "right", no_wrap=True)
    for r in recoveries:
        table.add_row(r.fault, str(r.step), _fmt(r.detect_s, " s"), _fmt(r.release_s, " s"), _fmt(r.plan_s, " s"),
                      _fmt(r.transfer_s, " s"), _fmt(r.total_s, " s"), _fmt(r.pause_s, " s"), _fmt(r.switch_s, " s"),
                      (f"{r.source} (-{r.rerun})" if r.rerun else r.source) or "-", str(r.transfers),
                      "-" if not r.bytes_moved else f"{r.bytes_moved / 2**20:.2f} MiB",
                      "-" if r.plan_shape is None else str(r.plan_shape),
                      "-" if r.step_time_ratio is None else f"x{r.step_time_ratio:.2f}")

    return table


def recovery_notes(recoveries: list[Recovery]) -> list[str]:
    return [f"{r.fault}: {r.note}" for r in recoveries if r.note]


def verdict_table(report: Report):
    from rich.table import Table

    table = Table(title="verdict", title_justify="left", show_header=False)
    table.add_column(justify="left")
    table.add_column(justify="right")
    diff = "-" if report.max_loss_diff is None else f"{report.max_loss_diff:.2e}"
    rows = [("completed", "yes" if report.completed else f"no ({report.outcome})"),
            ("steps committed", f"{report.steps_committed} of {report.steps}"),
            ("committed steps lost", str(report.committed_steps_lost)),
            ("restores from peer memory", str(report.memory_restores)),
            ("planned leaves (with notice)", str(report.planned_leaves)),
            ("iterations interrupted (failures)", str(report.interrupted)),
            ("checkpoint loads", str(report.checkpoint_loads)),
            ("max loss diff vs reference", diff),
            *([("max validation loss diff vs reference", f"{report.max_val_loss_diff:.2e}")]
              if report.max_val_loss_diff is not None else []),
            ("ETTR", "-" if report.ettr is None else f"{report.ettr:.2f}"),
            ("ETTR against this run's own steps", "-" if report.ettr_own_steps is None else
             f"{report.ettr_own_steps:.2f} ({report.own_step_s:.3f} s a step away from faults, "
             f"reference {report.reference_step_s or 0:.3f} s)"),
            ("wall time", f"{report.wall_s:.1f} s")]
    for name, value in rows:
        table.add_row(name, value)
    return table
