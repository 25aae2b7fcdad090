"""Azure LLM inference trace 2023 (CSV: ``TIMESTAMP, ContextTokens, GeneratedTokens``).

``TIMESTAMP`` is a wall-clock datetime string with up to 7 fractional digits
("2023-11-16 18:17:03.9799600"); arrival offsets are seconds since the first data row.
There is no text: prompts are synthetic token ids of ``ContextTokens`` length, unique per
row. Lengths follow the policy in :mod:`loadgen.traces.base`.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from loadgen.traces._io import iter_trace_rows, parse_int
from loadgen.traces.base import (
    DEFAULT_MAX_MODEL_LEN,
    LengthPolicy,
    LoadedTrace,
    TraceRequest,
    row_request,
)

REQUIRED_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def parse_azure_timestamp(text: str) -> datetime:
    """Parse "YYYY-MM-DD HH:MM:SS[.fffffff]" (fractions past microseconds are dropped)."""
    text = text.strip()
    if "." in text:
        head, fraction = text.split(".", 1)
        text = f"{head}.{fraction[:6].ljust(6, '0')}"
    return datetime.fromisoformat(text)


def read_azure(
    path: str | Path,
    *,
    limit: int | None = None,
    seed: int = 0,
    max_model_len: int | None = DEFAULT_MAX_MODEL_LEN,
) -> LoadedTrace:
    """Read an Azure LLM trace CSV; stop after ``limit`` kept requests (None: read all).

    ``trace_id`` is the 0-based data-row number. Rows with an unparsable timestamp or count
    are skipped as malformed.
    """
    policy = LengthPolicy(max_model_len)
    requests: list[TraceRequest] = []
    first_at: datetime | None = None
    for row_index, row in iter_trace_rows(path, REQUIRED_COLUMNS, "an Azure LLM trace"):
        if limit is not None and len(requests) >= limit:
            break
        prompt_tokens = parse_int(row.get("ContextTokens"))
        output_tokens = parse_int(row.get("GeneratedTokens"))
        try:
            arrived_at = parse_azure_timestamp(row.get("TIMESTAMP", ""))
        except ValueError:
            arrived_at = None
        if prompt_tokens is None or output_tokens is None or arrived_at is None:
            policy.count_invalid()
            continue
        if first_at is None:
            first_at = arrived_at
        fitted = policy.try_fit(prompt_tokens, output_tokens)
        if fitted is None:
            continue
        requests.append(row_request(row_index, prompt_tokens, fitted[0], (arrived_at - first_at).total_seconds(),
                                    seed=seed))
    policy.log_summary(str(path))
    return LoadedTrace(requests=requests, stats=policy.stats())
