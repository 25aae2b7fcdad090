"""File helpers shared by the readers: transparent gzip, CSV rows with clean header names."""

from __future__ import annotations

import csv
import gzip
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO


def open_text(path: str | Path) -> IO[str]:
    """Open a text file for reading, gunzipping when the name ends in ``.gz``.

    Universal newlines are off (``newline=""``) so the csv module sees CR+LF endings and
    handles them itself; a UTF-8 byte-order mark is dropped.
    """
    path = Path(path)
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return path.open("r", encoding="utf-8-sig", newline="")


def read_csv_header(path: str | Path) -> list[str]:
    """The first row of a CSV file, with names stripped of spaces and line-end characters."""
    with open_text(path) as handle:
        row = next(csv.reader(handle), [])
    return [name.strip() for name in row]


def iter_csv_rows(path: str | Path) -> Iterator[dict[str, str]]:
    """Yield each data row as {stripped column name: stripped value}; blank lines are skipped."""
    with open_text(path) as handle:
        reader = csv.reader(handle)
        header = [name.strip() for name in next(reader, [])]
        for row in reader:
            if not row or all(not cell.strip() for cell in row):
                continue
            yield {name: cell.strip() for name, cell in zip(header, row, strict=False)}


def iter_trace_rows(path: str | Path, required_columns: Sequence[str], kind: str) -> Iterator[tuple[int, dict[str, str]]]:
    """(0-based data-row number, row) of a CSV trace (:func:`iter_csv_rows`); ValueError
    naming ``kind`` and the missing columns when the first row lacks any of ``required_columns``."""
    for row_index, row in enumerate(iter_csv_rows(path)):
        if row_index == 0:
            missing = [name for name in required_columns if name not in row]
            if missing:
                raise ValueError(f"{path}: not {kind}, missing columns {missing}")
        yield row_index, row


def parse_int(text: str | None) -> int | None:
    """An int from a CSV cell ("12", "12.0"); None when empty or not a number."""
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            return None
        return int(value) if value == value and abs(value) != float("inf") else None


def parse_float(text: str | None) -> float | None:
    """A finite float from a CSV cell; None when empty, not a number, NaN or infinite."""
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value == value and abs(value) != float("inf") else None
