"""Progress of long runs on stderr: a bar on a terminal, periodic lines anywhere else.

On a terminal a rich progress bar redraws in place. Redrawing in place into a file or a
pipe (a CI log, ``2> run.log``) makes one endless line of carriage returns that no one can
read or tail, so there :class:`ProgressBar` writes instead one newline-terminated line at
most every ``line_interval_s`` (default 10 s) while the work advances, and a last one when
it closes::

    simulate block@44 seed 1: 1,500/6,000 req (25 %), 310.2 req/s, elapsed 0:04, eta 0:14

Every long run in the project reports through this module (the simulations, ``blockq
bench`` and the demo), so all of them behave the same in a terminal and in a log.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

DEFAULT_LINE_INTERVAL_S = 10.0
MIN_RATE_ELAPSED_S = 1.0  # lines written sooner after the start show no rate


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal (False for files, pipes, closed streams)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def _clock_text(seconds: float) -> str:
    """``m:ss`` (or ``h:mm:ss``) of a duration."""
    minutes, secs = divmod(int(max(0.0, seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class _LineRenderer:
    """Periodic plain lines: at most one every ``line_interval_s`` of ``clock``, plus the last."""

    def __init__(self, stream: TextIO, unit: str, line_interval_s: float, clock: Callable[[], float]) -> None:
        self.stream = stream
        self.unit = unit
        self.line_interval_s = line_interval_s
        self.clock = clock
        self.started_at_s = clock()
        self.written_at_s: float | None = None
        self.written_state: tuple[str, int, int | None] | None = None

    def show(self, description: str, completed: int, total: int | None, *, final: bool = False) -> None:
        now_s = self.clock()
        if not final and self.written_at_s is not None and now_s - self.written_at_s < self.line_interval_s:
            return
        state = (description, completed, total)
        if final and state == self.written_state:  # the last periodic line already said it
            return
        self.written_at_s = now_s
        self.written_state = state
        self.stream.write(self.line(description, completed, total, now_s - self.started_at_s) + "\n")
        self.stream.flush()

    def line(self, description: str, completed: int, total: int | None, elapsed_s: float) -> str:
        head = f"{description}: " if description else ""
        rate_per_s = completed / elapsed_s if elapsed_s > 0 else 0.0
        if total:
            counts = f"{completed:,}/{total:,} {self.unit} ({100 * completed / total:.0f} %)"
        else:
            counts = f"{completed:,} {self.unit}"
        if elapsed_s < MIN_RATE_ELAPSED_S:  # a rate over a few milliseconds says nothing
            return f"{head}{counts}, elapsed {_clock_text(elapsed_s)}"
        text = f"{head}{counts}, {rate_per_s:,.1f} {self.unit}/s, elapsed {_clock_text(elapsed_s)}"
        if total and 0 < completed < total and rate_per_s > 0:
            text += f", eta {_clock_text((total - completed) / rate_per_s)}"
        return text

    def close(self) -> None:
        pass


class _RichRenderer:
    """A rich bar redrawn in place (its own refresh thread, stopped by :meth:`close`)."""

    def __init__(self, stream: TextIO, unit: str) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
            console=Console(file=stream), refresh_per_second=4)
        self.task_id = self.progress.add_task("", total=None)
        self.progress.start()

    def show(self, description: str, completed: int, total: int | None, *, final: bool = False) -> None:
        self.progress.update(self.task_id, description=description, completed=completed, total=total,
                             refresh=final)

    def close(self) -> None:
        self.progress.stop()


class ProgressBar:
    """Progress of ``total`` items (None: unknown) on ``stream`` (default stderr).

    ``enabled`` False shows nothing. ``total`` may grow while running (a search that
    decides on more runs). Use it as a context manager, or call :meth:`close`, which
    writes the final state once; later updates are ignored.
    """

    def __init__(self, total: int | None = None, description: str = "", *, completed: int = 0, unit: str = "req",
                 enabled: bool = True, stream: TextIO | None = None,
                 line_interval_s: float = DEFAULT_LINE_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if line_interval_s <= 0:
            raise ValueError(f"line_interval_s: must be > 0 (got {line_interval_s})")
        stream = stream if stream is not None else sys.stderr
        self._total = total
        self.description = description
        self.completed = completed
        self._renderer: _LineRenderer | _RichRenderer | None = None
        if enabled:
            self._renderer = (_RichRenderer(stream, unit) if is_terminal(stream)
                              else _LineRenderer(stream, unit, line_interval_s, clock))
            self._show()

    @property
    def total(self) -> int | None:
        return self._total

    @total.setter
    def total(self, value: int | None) -> None:
        self._total = value
        self._show()

    def set_description(self, description: str) -> None:
        self.description = description
        self._show()

    def update(self, num_items: int = 1) -> None:
        """``num_items`` more are done."""
        self.set_completed(self.completed + num_items)

    def set_completed(self, completed: int, total: int | None = None) -> None:
        """``completed`` are done (of ``total``, when given)."""
        self.completed = completed
        if total is not None:
            self._total = total
        self._show()

    def close(self) -> None:
        if self._renderer is None:
            return
        self._renderer.show(self.description, self.completed, self._total, final=True)
        self._renderer.close()
        self._renderer = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _show(self) -> None:
        if self._renderer is not None:
            self._renderer.show(self.description, self.completed, self._total)


def run_progress_printer(*, enabled: bool = True, stream: TextIO | None = None,
                         line_interval_s: float = DEFAULT_LINE_INTERVAL_S) -> Callable[[str, int, int], None]:
    """A callback ``(run label, done, total)`` for runs one after another: one bar per run,
    closed when the run is done or when a run with another label reports."""
    current: dict[str, ProgressBar] = {}

    def show(run: str, done: int, total: int) -> None:
        bar = current.get(run)
        if bar is None:
            for previous in current.values():
                previous.close()
            current.clear()
            bar = current[run] = ProgressBar(total, run, completed=done, enabled=enabled, stream=stream,
                                             line_interval_s=line_interval_s)
        else:
            bar.set_completed(done, total)
        if done >= total:
            bar.close()
            current.clear()

    return show
