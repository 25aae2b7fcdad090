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

from loadgen.traces._io import iter_csv_rows, parse_float, parse_int
from loadgen.traces.base import (
    DEFAULT_MAX_MODEL_LEN,
    LengthPolicy,
    LoadedTrace,
    TraceRequest,
    row_token_ids,
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
    for row_index, row in enumerate(iter_csv_rows(path)):
        if limit is not None and len(requests) >= limit:
            break
        if row_index == 0:
            missing = [name for name in REQUIRED_COLUMNS if name not in row]
            if missing:
                raise ValueError(f"{path}: not a BurstGPT trace, missing columns {missing}")
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
        requests.append(
            TraceRequest(
                prompt=row_token_ids(row_index, prompt_tokens, seed=seed),
                prompt_tokens=prompt_tokens,
                true_output_tokens=fitted[0],
                arrival_offset_s=arrived_at_s - first_at_s,
                trace_id=str(row_index),
            )
        )
    policy.log_summary(str(path))
    return LoadedTrace(requests=requests, stats=policy.stats())
