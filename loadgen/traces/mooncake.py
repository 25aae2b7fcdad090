"""Mooncake (Kimi) traces (JSON lines: ``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids``).

``hash_ids`` names the prompt's 512-token blocks; two requests that list the same leading
hash ids share that prefix. Prompts are synthetic token ids built block by block from the
hash ids (:func:`loadgen.traces.base.synthetic_token_ids`), so shared hash ids give
identical leading token ids and prefix caching behaves as in the recorded workload. The
last block may be partial (``input_length`` need not be a multiple of 512). Arrival offsets
are ``timestamp / 1000`` seconds. Lengths follow the policy in :mod:`loadgen.traces.base`;
note that most Mooncake prompts are longer than 4,096 tokens, so pass a larger
``max_model_len`` (or None) to keep them.
"""

from __future__ import annotations

import json
from pathlib import Path

from loadgen.traces._io import open_text
from loadgen.traces.base import (
    DEFAULT_MAX_MODEL_LEN,
    MOONCAKE_BLOCK_SIZE_TOKENS,
    LengthPolicy,
    LoadedTrace,
    TraceRequest,
    row_block_keys,
    synthetic_token_ids,
)

_HASH_ID_MASK = (1 << 62) - 1


def _prompt_token_ids(
    line_index: int, hash_ids: list[int], num_tokens: int, block_size_tokens: int, seed: int
) -> tuple[int, ...]:
    """Token ids block by block from the hash ids; blocks past the listed ids are row-private."""
    num_blocks = -(-num_tokens // block_size_tokens)
    # Hash ids stay below bit 62 so they cannot meet a row-private key.
    keys = [h & _HASH_ID_MASK for h in hash_ids[:num_blocks]]
    if len(keys) < num_blocks:
        keys.extend(row_block_keys(line_index, num_blocks - len(keys), first_block=len(keys)))
    return synthetic_token_ids(keys, num_tokens, block_size_tokens=block_size_tokens, seed=seed)


def _parse_line(line: str) -> tuple[float, int, int, list[int]] | None:
    """(timestamp_ms, input_length, output_length, hash_ids), or None when malformed."""
    try:
        record = json.loads(line)
        hash_ids = [int(h) for h in record.get("hash_ids", [])]
        return (
            float(record["timestamp"]),
            int(record["input_length"]),
            int(record["output_length"]),
            hash_ids,
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def read_mooncake(
    path: str | Path,
    *,
    limit: int | None = None,
    seed: int = 0,
    max_model_len: int | None = DEFAULT_MAX_MODEL_LEN,
    block_size_tokens: int = MOONCAKE_BLOCK_SIZE_TOKENS,
) -> LoadedTrace:
    """Read a Mooncake JSONL trace; stop after ``limit`` kept requests (None: read all).

    ``trace_id`` is the 0-based line number among non-blank lines. A line that is not valid
    JSON with the four fields (e.g. a truncated last line) is skipped as malformed.
    """
    policy = LengthPolicy(max_model_len)
    requests: list[TraceRequest] = []
    with open_text(path) as handle:
        line_index = -1
        for line in handle:
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            line_index += 1
            parsed = _parse_line(line)
            if parsed is None:
                policy.count_invalid()
                continue
            timestamp_ms, prompt_tokens, output_tokens, hash_ids = parsed
            fitted = policy.try_fit(prompt_tokens, output_tokens)
            if fitted is None:
                continue
            requests.append(
                TraceRequest(
                    prompt=_prompt_token_ids(
                        line_index, hash_ids, prompt_tokens, block_size_tokens, seed
                    ),
                    prompt_tokens=prompt_tokens,
                    true_output_tokens=fitted[0],
                    arrival_offset_s=timestamp_ms / 1000.0,
                    trace_id=str(line_index),
                )
            )
    policy.log_summary(str(path))
    return LoadedTrace(requests=requests, stats=policy.stats())
