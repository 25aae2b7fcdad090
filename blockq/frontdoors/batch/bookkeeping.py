"""Small parts of a batch run: progress counters saved at a bounded rate, a token-bucket
rate limiter, and atomic file replacement. No Redis, no rq."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

PROGRESS_SAVE_INTERVAL_S = 0.5


class BatchProgress:
    """done / failed / total of a job; ``save`` receives them at most every 0.5 s
    (and always on ``start`` and ``finish``)."""

    def __init__(self, save: Callable[[dict[str, Any]], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.save = save
        self.clock = clock
        self.values: dict[str, Any] = {"total": 0, "done": 0, "failed": 0, "canceled": False}
        self._saved_at_s = -1e18
        self._dirty = False

    def start(self, *, total: int, done: int, failed: int) -> None:
        self.values.update(total=total, done=done, failed=failed)
        self._flush()

    def add(self, *, done: int = 0, failed: int = 0) -> None:
        self.values["done"] += done
        self.values["failed"] += failed
        self._dirty = True

    def maybe_save(self) -> None:
        if self._dirty and self.clock() - self._saved_at_s >= PROGRESS_SAVE_INTERVAL_S:
            self._flush()

    def finish(self, *, canceled: bool) -> None:
        self.values["canceled"] = canceled
        self._flush()

    def _flush(self) -> None:
        self.save(dict(self.values))
        self._saved_at_s = self.clock()
        self._dirty = False


class RateLimiter:
    """Token bucket of ``rate_per_s`` tokens a second, holding at most one second's worth;
    ``None`` means unlimited."""

    def __init__(self, rate_per_s: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = rate_per_s
        self.clock = clock
        self.capacity = max(1.0, rate_per_s or 0.0)
        self.tokens = 1.0  # start gently: one request, then the steady rate
        self._updated_at_s = clock()

    def _refill(self) -> None:
        now_s = self.clock()
        if self.rate_per_s is not None:
            self.tokens = min(self.capacity, self.tokens + (now_s - self._updated_at_s) * self.rate_per_s)
        self._updated_at_s = now_s

    def take(self, wanted: int) -> int:
        """How many of ``wanted`` may go now (those tokens are spent)."""
        if self.rate_per_s is None:
            return wanted
        self._refill()
        granted = min(wanted, int(self.tokens))
        self.tokens -= granted
        return granted

    def refund(self, count: int) -> None:
        if self.rate_per_s is not None:
            self.tokens = min(self.capacity, self.tokens + count)

    def delay_s(self) -> float:
        """Seconds until the next token (0 when one is available or unlimited)."""
        if self.rate_per_s is None:
            return 0.0
        self._refill()
        return max(0.0, (1.0 - self.tokens) / self.rate_per_s)


def write_lines_atomically(path: Path, lines: Iterable[bytes | str]) -> int:
    """Write ``lines`` (newline-terminated) to a temporary file beside ``path``, fsync it
    and rename it over ``path``: readers see the old file or the whole new one. Returns
    the number of lines written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # Created afresh ("x": O_EXCL, which also refuses a symlink planted under that name),
    # so the write cannot be sent through a link to a file outside the output root.
    tmp.unlink(missing_ok=True)
    num_lines = 0
    try:
        with tmp.open("xb") as file:
            for line in lines:
                file.write(line if isinstance(line, bytes) else line.encode())
                file.write(b"\n")
                num_lines += 1
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
        return num_lines
    finally:
        tmp.unlink(missing_ok=True)
