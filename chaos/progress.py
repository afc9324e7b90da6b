"""Live progress of a chaos run: a bar on a terminal, a line every twentieth of the run
(and whenever the live nodes change) in a log; faults and notes print above either."""
from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RunProgress:
    def __init__(self, console: Console, steps: int):
        self.console, self.steps = console, steps
        self.every = max(1, steps // 20)
        self._shown: tuple[int, int] | None = None
        self._rate: list[tuple[float, int]] = []
        self._bar: Progress | None = None
        if console.is_terminal:
            self._bar = Progress(TextColumn("  step"), MofNCompleteColumn(), BarColumn(),
                                 TextColumn("live nodes {task.fields[live]} | {task.fields[rate]}"),
                                 TimeElapsedColumn(), console=console)
            self._task = self._bar.add_task("train", total=steps, live="-", rate="")

    def __enter__(self) -> "RunProgress":
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def _steps_per_s(self, committed: int) -> str:
        """Over the last ten seconds or so: what the job is doing now, not on average."""
        now = time.time()
        self._rate.append((now, committed))
        while len(self._rate) > 2 and now - self._rate[1][0] > 10:
            self._rate.pop(0)
        (t0, c0), (t1, c1) = self._rate[0], self._rate[-1]
        return f"{(c1 - c0) / (t1 - t0):.1f} steps/s" if t1 > t0 and c0 > 0 else ""

    def update(self, committed: int, live: int) -> None:
        rate = self._steps_per_s(committed)
        if self._bar is not None:
            self._bar.update(self._task, completed=committed, live=live, rate=rate)
            return
        last = self._shown
        if (last is None or live != last[1] or committed // self.every != last[0] // self.every
                or (committed == self.steps and last[0] != committed)):
            self._shown = (committed, live)
            self.console.print(f"  step {committed}/{self.steps} | live nodes {live}"
                               f"{f' | {rate}' if rate else ''}")

    def note(self, text: str) -> None:
        self.console.print(text)
