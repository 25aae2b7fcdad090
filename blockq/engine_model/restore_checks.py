"""The checks a restored row must pass, with the reference's messages: the packed
scheduler's compiled restore only says that a row failed; these name which, and why."""

from __future__ import annotations

from collections.abc import Sequence

# A restored request: (request id, prompt tokens, output target, computed, generated).
RestoredRow = tuple[str, int, int, int, int]


def check_restored_rows(rows: Sequence[RestoredRow], max_model_len: int) -> None:
    """The checks of :meth:`EngineScheduler.add_request`, row by row: raises ValueError,
    naming the field, for the first row that fails."""
    seen: set[str] = set()
    for request_id, prompt_tokens, target_tokens, _, generated_tokens in rows:
        _checked_target(request_id, prompt_tokens, target_tokens, generated_tokens, max_model_len, seen)
        seen.add(request_id)


def _checked_target(request_id: str, prompt_tokens: int, target_tokens: int, generated_tokens: int,
                    max_model_len: int, seen: set[str]) -> int:
    """A restored row's output target clipped to ``max_model_len``, after the checks
    (and with the messages) of :meth:`EngineScheduler.add_request`."""
    if not request_id:
        raise ValueError("request_id: must be a non-empty string")
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens: must be >= 1 (got {prompt_tokens})")
    if prompt_tokens >= max_model_len:
        raise ValueError(f"prompt_tokens: must be < max_model_len ({max_model_len}) (got {prompt_tokens})")
    if target_tokens < 1:
        raise ValueError(f"output_target_tokens: must be >= 1 (got {target_tokens})")
    if generated_tokens < 0:
        raise ValueError("num_generated_tokens: must be >= 0")
    if request_id in seen:
        raise ValueError(f"request_id: {request_id!r} is already in this engine")
    target_tokens = min(target_tokens, max_model_len - prompt_tokens)
    if generated_tokens >= target_tokens:
        raise ValueError(f"num_generated_tokens: must be < output_target_tokens "
                         f"({target_tokens} after clipping to max_model_len)")
    return target_tokens
