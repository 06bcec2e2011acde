"""What a run prints: the short tables every benchmark and run ends with, and the live progress
display while it serves.

Tables always carry a title and a header row. The progress display (rich) draws only when stdout
is a terminal: piped into a file or another program, a run prints its tables and nothing else.
"""

from __future__ import annotations

import contextlib
import sys
import time


def print_table(title: str, headers: list[str], cells: list[list[str]], width: int = 200) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="right")
    for row in cells:
        table.add_row(*row)
    Console(width=width).print(table)


def interactive() -> bool:
    """Whether stdout is a terminal (the progress display and status lines draw only then)."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed stdout
        return False


@contextlib.contextmanager
def status(text: str):
    """``with status("starting the engine"):`` a spinner line while it runs, on a terminal; nothing
    otherwise."""
    if not interactive():
        yield
        return
    from rich.console import Console

    with Console().status(text, spinner="dots"):
        yield


class ServeProgress:
    """Live progress of one serve: requests finished of the total (or, for a timed closed loop,
    seconds served of its duration), output tok/s so far, the decode batch, elapsed time. Feed it
    engine step records (``on_step``) and finished requests (``on_request``). Draws nothing when
    stdout is not a terminal (``enabled`` False); ``refresh_s`` throttles redraws so that a fast
    engine pays nothing measurable for it."""

    def __init__(self, total: int | None, title: str, *, duration_s: float | None = None,
                 refresh_s: float = 0.25, enabled: bool | None = None):
        self.enabled = interactive() if enabled is None else enabled
        self.total, self.duration_s = total, duration_s
        self.tokens = self.done = 0
        self._refresh_s = refresh_s
        self._t0 = self._last = time.perf_counter()
        self._batch = 0
        self._progress = None
        if not self.enabled:
            return
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                  TextColumn("{task.fields[count]}"), TextColumn("{task.fields[stats]}"),
                                  TimeElapsedColumn(), transient=True)
        bar_total = duration_s if duration_s is not None else total
        self._task = self._progress.add_task(title, total=bar_total, count=self._count(), stats="")

    def _count(self) -> str:
        if self.duration_s is not None:
            return f"{min(time.perf_counter() - self._t0, self.duration_s):.0f}/{self.duration_s:g} s, {self.done} requests"
        return f"{self.done}/{self.total if self.total is not None else '?'} requests"

    def __enter__(self) -> "ServeProgress":
        self._t0 = self._last = time.perf_counter()
        if self._progress is not None:
            self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def tok_per_s(self) -> float:
        dt = time.perf_counter() - self._t0
        return self.tokens / dt if dt > 0 else 0.0

    def on_request(self, rec: dict) -> None:
        self.done += 1
        self._draw(force=True)

    def on_step(self, rec: dict) -> None:
        self.tokens += int(rec.get("committed", 0) or 0)
        self._batch = rec.get("decode_bs", self._batch)
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if self._progress is None:
            return
        now = time.perf_counter()
        if not force and now - self._last < self._refresh_s:
            return
        self._last = now
        completed = min(now - self._t0, self.duration_s) if self.duration_s is not None else self.done
        self._progress.update(self._task, completed=completed, count=self._count(),
                              stats=f"{self.tok_per_s():7.1f} tok/s  batch {self._batch}")
