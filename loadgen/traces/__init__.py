"""Trace readers: turn a workload file (or "synthetic") into a list of :class:`TraceRequest`.

Formats (one module each): ShareGPT JSON (:mod:`.sharegpt`), Mooncake JSONL
(:mod:`.mooncake`), Azure LLM trace CSV (:mod:`.azure`), Vidur/Sarathi CSV
(:mod:`.vidur`), BurstGPT CSV (:mod:`.burstgpt`) and a seeded generator (:mod:`.synthetic`).
Every reader applies the same length policy (:mod:`.base`): prompts that alone reach
``max_model_len`` are skipped, outputs are clipped to fit, and the counts are logged.
ShareGPT can also be read as multi-turn sessions (``multi_turn``; :func:`group_sessions`
gathers a session's turns).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from blockq.text.tokenizer import TokenCounter
from loadgen.traces._io import open_text, read_csv_header
from loadgen.traces.azure import read_azure
from loadgen.traces.base import (
    DEFAULT_MAX_MODEL_LEN,
    LoadedTrace,
    TraceRequest,
    TraceStats,
    group_sessions,
)
from loadgen.traces.burstgpt import read_burstgpt
from loadgen.traces.mooncake import read_mooncake
from loadgen.traces.sharegpt import read_sharegpt
from loadgen.traces.synthetic import DEFAULT_NUM_REQUESTS, SyntheticTraceConfig, generate_synthetic
from loadgen.traces.vidur import read_vidur

__all__ = [
    "DEFAULT_MAX_MODEL_LEN",
    "TRACE_FORMATS",
    "LoadedTrace",
    "SyntheticTraceConfig",
    "TraceRequest",
    "TraceStats",
    "detect_format",
    "group_sessions",
    "load_trace",
    "load_trace_with_stats",
]

SYNTHETIC_SPEC = "synthetic"
TRACE_FORMATS = ("sharegpt", "mooncake", "azure", "vidur", "burstgpt", "synthetic")


def _split_spec(spec: str) -> tuple[str | None, str]:
    """("format", "path") for "format:path"; (None, spec) otherwise (Windows drives kept)."""
    head, sep, tail = spec.partition(":")
    if sep and head.lower() in TRACE_FORMATS and head.lower() != SYNTHETIC_SPEC:
        return head.lower(), tail
    return None, spec


def detect_format(path: str | Path) -> str:
    """Name the format of a trace file from its name, then its header or first byte.

    ``.json``/``.json.gz`` → sharegpt, ``.jsonl``/``.jsonl.gz`` → mooncake; a CSV is told
    apart by its header (TIMESTAMP + ContextTokens → azure, num_prefill_tokens → vidur,
    "Response tokens" → burstgpt). Raises ValueError when nothing matches.
    """
    path = Path(path)
    name = path.name.lower().removesuffix(".gz")
    if name.endswith(".jsonl"):
        return "mooncake"
    if name.endswith(".json"):
        return "sharegpt"
    if name.endswith(".csv"):
        header = set(read_csv_header(path))
        if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= header:
            return "azure"
        if {"num_prefill_tokens", "num_decode_tokens"} <= header:
            return "vidur"
        if {"Request tokens", "Response tokens"} <= header:
            return "burstgpt"
        raise ValueError(f"{path}: unrecognised CSV trace header {sorted(header)}")
    with open_text(path) as handle:
        head = handle.read(256).lstrip("\ufeff \t\r\n")
    if head.startswith("["):
        return "sharegpt"
    if head.startswith("{"):
        return "mooncake"
    raise ValueError(f"{path}: cannot tell the trace format; use a 'format:PATH' spec")


def load_trace_with_stats(
    spec: str,
    *,
    limit: int | None = None,
    seed: int = 0,
    token_counter: TokenCounter | None = None,
    max_model_len: int | None = DEFAULT_MAX_MODEL_LEN,
    tokenizer: str | None = None,
    multi_turn: bool = False,
) -> LoadedTrace:
    """Load a trace and say what was skipped; see :func:`load_trace` for the arguments."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    if multi_turn and spec == SYNTHETIC_SPEC:
        raise ValueError("multi_turn: the synthetic workload has no conversations")
    if spec == SYNTHETIC_SPEC:
        model_len = max_model_len or DEFAULT_MAX_MODEL_LEN
        # a prompt must leave room for one output token
        config = SyntheticTraceConfig(max_model_len=model_len,
                                      max_prompt_tokens=min(SyntheticTraceConfig.max_prompt_tokens, model_len - 1))
        return generate_synthetic(
            DEFAULT_NUM_REQUESTS if limit is None else limit,
            seed=seed,
            config=config,
            token_counter=token_counter,
        )
    trace_format, path_text = _split_spec(spec)
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    trace_format = trace_format or detect_format(path)
    if multi_turn and trace_format != "sharegpt":
        raise ValueError(
            f"multi_turn: only ShareGPT traces have conversations; {path} is {trace_format}"
        )
    if trace_format == "sharegpt":
        loaded = read_sharegpt(
            path,
            limit=limit,
            max_model_len=max_model_len,
            token_counter=token_counter,
            tokenizer=tokenizer,
            multi_turn=multi_turn,
        )
    else:
        reader = {
            "mooncake": read_mooncake,
            "azure": read_azure,
            "vidur": read_vidur,
            "burstgpt": read_burstgpt,
        }[trace_format]
        loaded = reader(path, limit=limit, seed=seed, max_model_len=max_model_len)
    return LoadedTrace(requests=_rebase_offsets(loaded.requests), stats=loaded.stats)


def _rebase_offsets(requests: list[TraceRequest]) -> list[TraceRequest]:
    """Make arrival offsets relative to the first returned request (when it has one)."""
    if not requests or requests[0].arrival_offset_s is None:
        return requests
    origin_s = requests[0].arrival_offset_s
    if origin_s == 0.0:
        return requests
    return [
        request
        if request.arrival_offset_s is None
        else replace(request, arrival_offset_s=request.arrival_offset_s - origin_s)
        for request in requests
    ]


def load_trace(
    spec: str,
    *,
    limit: int | None = None,
    seed: int = 0,
    token_counter: TokenCounter | None = None,
    max_model_len: int | None = DEFAULT_MAX_MODEL_LEN,
    tokenizer: str | None = None,
    multi_turn: bool = False,
) -> list[TraceRequest]:
    """Load the first ``limit`` usable requests of a trace (all of them when None).

    ``spec`` is ``"synthetic"`` (a seeded ShareGPT-like workload of ``limit`` requests,
    1,000 when None), a path whose format is detected (:func:`detect_format`), or
    ``"format:PATH"`` with format one of sharegpt, mooncake, azure, vidur, burstgpt.
    ``seed`` fixes the synthetic workload and the synthetic token ids of token-only traces.
    ``token_counter`` / ``tokenizer`` count ShareGPT texts (and, when given, synthetic
    prompts); default: :func:`blockq.text.tokenizer.get_token_counter`. ``max_model_len``
    (tokens, None: unlimited) bounds prompt + output: longer prompts are skipped, longer
    outputs clipped (see :mod:`loadgen.traces.base`). Arrival offsets, when the trace has
    times, are seconds since the first returned request. ``multi_turn`` (ShareGPT only)
    reads every turn of each conversation as one session (:mod:`.sharegpt`); ``limit``
    then counts turns. Raises FileNotFoundError for a missing file and ValueError for an
    unrecognised format, or ``multi_turn`` on a trace without conversations.
    """
    return load_trace_with_stats(
        spec,
        limit=limit,
        seed=seed,
        token_counter=token_counter,
        max_model_len=max_model_len,
        tokenizer=tokenizer,
        multi_turn=multi_turn,
    ).requests
