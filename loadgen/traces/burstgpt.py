"""BurstGPT traces (CSV: ``Timestamp, Model, Request tokens, Response tokens, Total tokens,
Log Type``).

``Timestamp`` is seconds since the start of the log; arrival offsets are taken relative to
the first data row. Rows with 0 response tokens are failed requests in BurstGPT's log and
are skipped (counted as malformed in the stats), as are rows with 0 request tokens.
``model`` optionally keeps only rows of one ``Model`` value (e.g. "ChatGPT" or "GPT-4").
There is no text: prompts are synthetic token ids, unique per row. Lengths follow the
policy in :mod:`loadgen.traces.base`.
"""

from __future__ import annotations

from pathlib import Path

from loadgen.traces._io import iter_trace_rows, parse_float, parse_int
from loadgen.traces.base import (
    DEFAULT_MAX_MODEL_LEN,
    LengthPolicy,
    LoadedTrace,
    TraceRequest,
    row_request,
)

REQUIRED_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


def read_burstgpt(
    path: str | Path,
    *,
    limit: int | None = None,
    seed: int = 0,
    max_model_len: int | None = DEFAULT_MAX_MODEL_LEN,
    model: str | None = None,
) -> LoadedTrace:
    """Read a BurstGPT CSV; stop after ``limit`` kept requests (None: read all).

    ``trace_id`` is the 0-based data-row number. Rows of other models (when ``model`` is
    given) are passed over without being counted.
    """
    policy = LengthPolicy(max_model_len)
    requests: list[TraceRequest] = []
    first_at_s: float | None = None
    for row_index, row in iter_trace_rows(path, REQUIRED_COLUMNS, "a BurstGPT trace"):
        if limit is not None and len(requests) >= limit:
            break
        if model is not None and row.get("Model") != model:
            continue
        arrived_at_s = parse_float(row.get("Timestamp"))
        prompt_tokens = parse_int(row.get("Request tokens"))
        output_tokens = parse_int(row.get("Response tokens"))
        if arrived_at_s is None or prompt_tokens is None or output_tokens is None:
            policy.count_invalid()
            continue
        if first_at_s is None:
            first_at_s = arrived_at_s
        fitted = policy.try_fit(prompt_tokens, output_tokens)
        if fitted is None:
            continue
        requests.append(row_request(row_index, prompt_tokens, fitted[0], arrived_at_s - first_at_s, seed=seed))
    policy.log_summary(str(path))
    return LoadedTrace(requests=requests, stats=policy.stats())
