"""Shared pieces of the trace readers: the request record, length clipping, synthetic token ids.

Every reader turns one trace format into a list of :class:`TraceRequest`. Readers are
pure file parsers: they open the path they are given, read it once, and keep no state.

Length policy (the same for every reader, mirroring what a vLLM engine with
``max_model_len`` does):

* a row whose prompt alone needs ``max_model_len`` tokens or more cannot be served and is
  skipped (counted in :attr:`TraceStats.num_skipped_too_long`);
* otherwise the output is cut so that ``prompt_tokens + true_output_tokens <=
  max_model_len`` (counted in :attr:`TraceStats.num_clipped_output`); a shipped prediction
  is cut to the same bound, since no engine can generate past it;
* rows with fewer than one prompt or output token are malformed for replay and skipped
  (:attr:`TraceStats.num_skipped_invalid`);
* in a multi-turn session, the turns after a skipped one are dropped too, since a
  conversation cannot continue from a turn that was never served
  (:attr:`TraceStats.num_dropped_session_turns`).

``max_model_len=None`` turns clipping and the too-long skip off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter

import numpy as np
import structlog

logger = structlog.get_logger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096
# Synthetic token ids avoid the low ids that tokenizers reserve for special tokens
# (Llama-2: 0 unk, 1 bos, 2 eos) and stay inside a Llama-2-sized vocabulary.
SYNTHETIC_TOKEN_ID_LOW = 100
SYNTHETIC_TOKEN_ID_HIGH = 32000
MOONCAKE_BLOCK_SIZE_TOKENS = 512

# Interned ints: a tuple built from this list holds shared objects, so a synthetic prompt
# costs one pointer (8 bytes) per token instead of one int object per token.
_TOKEN_ID_OBJECTS: list[int] = list(range(SYNTHETIC_TOKEN_ID_HIGH))
# Block keys private to one row live in their own key space (bit 62 set), so they never
# collide with a Mooncake hash id.
_ROW_KEY_TAG = 1 << 62


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload, as read from a trace or generated.

    ``prompt`` is text, or synthetic token ids (a tuple of ``prompt_tokens`` ints) when the
    trace records only token counts. ``true_output_tokens`` is the recorded answer length
    (after clipping to ``max_model_len``); the emulated engine ends the request there.
    ``arrival_offset_s`` is the trace's own timestamp relative to its first returned
    request, or None when the trace has no times. ``predicted_output_tokens`` is a
    prediction shipped with the trace, None when there is none. ``output_text`` is the
    recorded answer when the trace has text (ShareGPT), else None. ``session_id`` names the
    conversation a request is one turn of ("" when the request stands alone) and
    ``turn_index`` its place in it, from 0; a session's turns are replayed in that order
    (:func:`loadgen.arrivals.build_schedule`).
    """

    prompt: str | tuple[int, ...]
    prompt_tokens: int
    true_output_tokens: int
    arrival_offset_s: float | None = None
    predicted_output_tokens: int | None = None
    trace_id: str = ""
    output_text: str | None = field(default=None, repr=False)
    session_id: str = ""
    turn_index: int = 0


def group_sessions(requests: Sequence[TraceRequest]) -> list[list[TraceRequest]]:
    """The requests as sessions, in order of each session's first appearance.

    Requests sharing a non-empty ``session_id`` form one session, sorted by ``turn_index``
    (ties keep list order); a request without a session id is a session of its own.
    """
    session_to_turns: dict[str, list[TraceRequest]] = {}
    sessions: list[list[TraceRequest]] = []
    for request in requests:
        if not request.session_id:
            sessions.append([request])
            continue
        turns = session_to_turns.get(request.session_id)
        if turns is None:
            turns = session_to_turns[request.session_id] = []
            sessions.append(turns)
        turns.append(request)
    for turns in session_to_turns.values():
        turns.sort(key=lambda request: request.turn_index)
    return sessions


@dataclass(frozen=True)
class TraceStats:
    """What a reader did with the rows it saw (counts, not requests).

    A row is one request of the trace (one turn, for multi-turn sessions), so
    ``num_rows_read = num_requests + num_skipped_too_long + num_skipped_invalid +
    num_dropped_session_turns``.
    """

    num_rows_read: int = 0
    num_requests: int = 0
    num_skipped_too_long: int = 0
    num_skipped_invalid: int = 0
    num_clipped_output: int = 0
    num_dropped_session_turns: int = 0


@dataclass(frozen=True)
class LoadedTrace:
    """The requests of a trace together with the reader's counts."""

    requests: list[TraceRequest] = field(default_factory=list)
    stats: TraceStats = field(default_factory=TraceStats)


class LengthPolicy:
    """Applies the module's length policy row by row and keeps the counts.

    Not thread-safe; one instance per read.
    """

    def __init__(self, max_model_len: int | None) -> None:
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 tokens, got {max_model_len}")
        self.max_model_len = max_model_len
        self.num_rows_read = 0
        self.num_requests = 0
        self.num_skipped_too_long = 0
        self.num_skipped_invalid = 0
        self.num_clipped_output = 0
        self.num_dropped_session_turns = 0

    def try_fit(
        self, prompt_tokens: int, output_tokens: int, predicted_output_tokens: int | None = None
    ) -> tuple[int, int | None] | None:
        """Count one row; return (output_tokens, predicted) after clipping, or None to skip."""
        self.num_rows_read += 1
        if prompt_tokens < 1 or output_tokens < 1:
            self.num_skipped_invalid += 1
            return None
        if self.max_model_len is None:
            self.num_requests += 1
            return output_tokens, predicted_output_tokens
        max_output_tokens = self.max_model_len - prompt_tokens
        if max_output_tokens < 1:
            self.num_skipped_too_long += 1
            return None
        if output_tokens > max_output_tokens:
            self.num_clipped_output += 1
            output_tokens = max_output_tokens
        if predicted_output_tokens is not None:
            predicted_output_tokens = min(predicted_output_tokens, max_output_tokens)
        self.num_requests += 1
        return output_tokens, predicted_output_tokens

    def count_invalid(self) -> None:
        """Count a row that could not even be parsed."""
        self.num_rows_read += 1
        self.num_skipped_invalid += 1

    def count_dropped_turns(self, num_turns: int) -> None:
        """Count the turns of a session dropped after one of its turns was skipped."""
        self.num_rows_read += num_turns
        self.num_dropped_session_turns += num_turns

    def stats(self) -> TraceStats:
        """Freeze the counts so far."""
        return TraceStats(
            num_rows_read=self.num_rows_read,
            num_requests=self.num_requests,
            num_skipped_too_long=self.num_skipped_too_long,
            num_skipped_invalid=self.num_skipped_invalid,
            num_clipped_output=self.num_clipped_output,
            num_dropped_session_turns=self.num_dropped_session_turns,
        )

    def log_summary(self, source: str) -> None:
        """Log one line saying what was skipped or clipped (silent when nothing was)."""
        if (self.num_skipped_too_long or self.num_skipped_invalid or self.num_clipped_output
                or self.num_dropped_session_turns):
            logger.info(
                "trace_rows_skipped_or_clipped",
                source=source,
                max_model_len=self.max_model_len,
                num_rows_read=self.num_rows_read,
                num_requests=self.num_requests,
                num_skipped_too_long=self.num_skipped_too_long,
                num_skipped_invalid=self.num_skipped_invalid,
                num_clipped_output=self.num_clipped_output,
                num_dropped_session_turns=self.num_dropped_session_turns,
            )


def _mix64(keys: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic): a cheap stateless hash."""
    z = keys + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_block_keys(row_index: int, num_blocks: int, *, first_block: int = 0) -> list[int]:
    """Block keys private to one trace row (never equal to another row's or a hash id)."""
    base = _ROW_KEY_TAG | (row_index << 24)
    return [base | block for block in range(first_block, first_block + num_blocks)]


def synthetic_token_ids(
    block_keys: list[int], num_tokens: int, *, block_size_tokens: int, seed: int = 0
) -> tuple[int, ...]:
    """Deterministic token ids, block by block: equal block keys give equal token ids.

    Token ``j`` of block ``b`` depends only on (seed, block_keys[b], j), so two prompts whose
    leading block keys agree share their leading ``block_size_tokens``-token blocks exactly
    (prefix caching sees a real shared prefix). ``block_keys`` must name at least
    ceil(num_tokens / block_size_tokens) blocks (extra keys are ignored); keys are
    non-negative ints below 2**64. Ids lie in [SYNTHETIC_TOKEN_ID_LOW, SYNTHETIC_TOKEN_ID_HIGH).
    """
    if num_tokens <= 0:
        return ()
    num_blocks = -(-num_tokens // block_size_tokens)
    if len(block_keys) < num_blocks:
        raise ValueError(f"{num_tokens} tokens need {num_blocks} block keys, got {len(block_keys)}")
    with np.errstate(over="ignore"):
        keys = np.asarray(block_keys[:num_blocks], dtype=np.uint64)
        block_hash = _mix64(keys ^ np.uint64(seed & 0xFFFFFFFF))
        positions = np.arange(num_tokens, dtype=np.uint64)
        per_token = block_hash[positions // np.uint64(block_size_tokens)]
        mixed = _mix64(per_token ^ (positions % np.uint64(block_size_tokens)))
    span = SYNTHETIC_TOKEN_ID_HIGH - SYNTHETIC_TOKEN_ID_LOW
    ids = (mixed % np.uint64(span)).astype(np.int64) + SYNTHETIC_TOKEN_ID_LOW
    picked = itemgetter(*ids.tolist())(_TOKEN_ID_OBJECTS)
    return picked if isinstance(picked, tuple) else (picked,)


def row_token_ids(row_index: int, num_tokens: int, *, seed: int = 0) -> tuple[int, ...]:
    """Synthetic token ids for a row with no recorded prefix blocks: unique to the row."""
    return synthetic_token_ids(
        row_block_keys(row_index, 1), num_tokens, block_size_tokens=max(num_tokens, 1), seed=seed
    )


def row_request(row_index: int, prompt_tokens: int, true_output_tokens: int, arrival_offset_s: float | None, *,
                seed: int = 0, predicted_output_tokens: int | None = None) -> TraceRequest:
    """The request of a trace row without text: synthetic prompt token ids unique to the
    row (:func:`row_token_ids`), ``trace_id`` the row number."""
    return TraceRequest(
        prompt=row_token_ids(row_index, prompt_tokens, seed=seed),
        prompt_tokens=prompt_tokens,
        true_output_tokens=true_output_tokens,
        arrival_offset_s=arrival_offset_s,
        predicted_output_tokens=predicted_output_tokens,
        trace_id=str(row_index),
    )
