"""loadgen.progress: periodic newline-terminated lines when stderr is a file, a bar on a terminal."""

from __future__ import annotations

import io
import os
import select
import subprocess
import sys
from pathlib import Path

from loadgen.progress import ProgressBar, run_progress_printer
from tests.conftest import REPO_ROOT

# A long run in miniature: 40 items, 10 ms apart, a line at most every 50 ms.
_LONG_RUN = """
import time
from loadgen.progress import ProgressBar
with ProgressBar(40, "simulate block@44", line_interval_s=0.05) as bar:
    for _ in range(40):
        time.sleep(0.01)
        bar.update()
"""


def test_progress_into_a_file_is_several_newline_terminated_lines(tmp_path: Path) -> None:
    log_path = tmp_path / "stderr.log"
    with log_path.open("w") as log:
        done = subprocess.run([sys.executable, "-c", _LONG_RUN], stderr=log, cwd=REPO_ROOT, timeout=60)
    assert done.returncode == 0
    text = log_path.read_text()
    lines = text.splitlines(keepends=True)
    assert len(lines) >= 3, text
    assert all(line.endswith("\n") for line in lines)
    assert "\r" not in text and "\x1b" not in text
    assert lines[0].startswith("simulate block@44: 0/40 req (0 %)")
    assert lines[-1].startswith("simulate block@44: 40/40 req (100 %)")


class _FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_lines_are_at_most_one_per_interval_plus_the_last() -> None:
    stream = io.StringIO()
    clock = _FakeClock()
    bar = ProgressBar(100, "run", line_interval_s=10.0, stream=stream, clock=clock)
    for _ in range(100):
        clock.now_s += 1.0  # 100 updates over 100 s: one line per 10 s
        bar.update()
    bar.close()
    bar.update()  # after close: nothing
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 + 10  # the first, then one per 10 s (the last among them)
    assert lines[5] == "run: 50/100 req (50 %), 1.0 req/s, elapsed 0:50, eta 0:50"
    assert lines[-1] == "run: 100/100 req (100 %), 1.0 req/s, elapsed 1:40"


def test_total_can_grow_and_unknown_totals_count_only() -> None:
    stream = io.StringIO()
    clock = _FakeClock()
    bar = ProgressBar(None, "search", unit="run", stream=stream, clock=clock)
    clock.now_s = 20.0
    bar.update(4)
    bar.total = 10
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "search: 0 run, elapsed 0:00"  # no rate over no time
    assert lines[1] == "search: 4 run, 0.2 run/s, elapsed 0:20"
    assert lines[-1].startswith("search: 4/10 run (40 %)")


def test_disabled_writes_nothing() -> None:
    stream = io.StringIO()
    with ProgressBar(10, "quiet", enabled=False, stream=stream) as bar:
        bar.update(10)
    assert stream.getvalue() == ""


def test_run_printer_closes_each_run_with_its_last_line() -> None:
    stream = io.StringIO()
    show = run_progress_printer(stream=stream, line_interval_s=3600.0)
    for done in range(1, 4):
        show("block@8", done, 3)
    show("llumnix@8", 1, 2)
    show("llumnix@8", 2, 2)
    lines = stream.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "block@8: 1/3 req (33 %)", "block@8: 3/3 req (100 %)",
        "llumnix@8: 1/2 req (50 %)", "llumnix@8: 2/2 req (100 %)"]


def _read_available(fd: int) -> bytes:
    data = b""
    while select.select([fd], [], [], 0.2)[0]:
        data += os.read(fd, 65536)
    return data


def test_on_a_terminal_it_draws_a_bar() -> None:
    primary_fd, secondary_fd = os.openpty()
    with os.fdopen(secondary_fd, "w") as terminal:
        with ProgressBar(4, "live", stream=terminal) as bar:
            bar.update(4)
        terminal.flush()
        drawn = _read_available(primary_fd).decode(errors="replace")
    os.close(primary_fd)
    assert "live" in drawn and "4/4" in drawn and "━" in drawn
