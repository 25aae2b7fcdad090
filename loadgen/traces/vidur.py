"""Vidur / Sarathi-Serve length traces (CSV).

Columns: ``num_prefill_tokens``, ``num_decode_tokens`` (required); ``arrived_at`` (seconds,
optional: the splitwise_* files carry it); ``num_predicted_decode_tokens`` (optional: a
predicted output length shipped with the trace, e.g. the Block artifact's
sharegpt-val-10k-predicted-len.csv, which has CR+LF line endings); ``num_total_tokens`` and
``pd_ratio`` are ignored. The traces have no text, so prompts are synthetic token ids of
the recorded length, unique per row. Lengths follow the policy in :mod:`loadgen.traces.base`.
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

REQUIRED_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")


def read_vidur(
    path: str | Path,
    *,
    limit: int | None = None,
    seed: int = 0,
    max_model_len: int | None = DEFAULT_MAX_MODEL_LEN,
) -> LoadedTrace:
    """Read a Vidur-style CSV; stop after ``limit`` kept requests (None: read all).

    ``trace_id`` is the 0-based data-row number. Arrival offsets are the ``arrived_at``
    values (rebased by :func:`loadgen.traces.load_trace`), None without that column.
    """
    policy = LengthPolicy(max_model_len)
    requests: list[TraceRequest] = []
    for row_index, row in iter_trace_rows(path, REQUIRED_COLUMNS, "a Vidur trace"):
        if limit is not None and len(requests) >= limit:
            break
        prompt_tokens = parse_int(row.get("num_prefill_tokens"))
        output_tokens = parse_int(row.get("num_decode_tokens"))
        if prompt_tokens is None or output_tokens is None:
            policy.count_invalid()
            continue
        predicted = parse_int(row.get("num_predicted_decode_tokens"))
        fitted = policy.try_fit(prompt_tokens, output_tokens, predicted)
        if fitted is None:
            continue
        true_output_tokens, predicted = fitted
        requests.append(row_request(row_index, prompt_tokens, true_output_tokens, parse_float(row.get("arrived_at")),
                                    seed=seed, predicted_output_tokens=predicted))
    policy.log_summary(str(path))
    return LoadedTrace(requests=requests, stats=policy.stats())
