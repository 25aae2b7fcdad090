"""ShareGPT conversations (JSON array, plain or gzip, possibly cut off mid-record).

Each conversation gives at most one request: its first human turn as the prompt text, and
the token count of the gpt answer that follows as ``true_output_tokens`` (parsing, gzip and
truncation handling are :func:`blockq.sharegpt.iter_pairs`). Token counts come from the
project's counter (:func:`blockq.tokenizer.get_token_counter`) or the one passed in, so
they agree with the predictor's. Pairs with an empty prompt or answer are skipped as
malformed; lengths follow the policy in :mod:`loadgen.traces.base`. The trace has no
times: ``arrival_offset_s`` is None.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from pathlib import Path

from blockq.sharegpt import SharegptPair, iter_pairs
from blockq.tokenizer import TokenCounter, get_token_counter
from loadgen.traces.base import DEFAULT_MAX_MODEL_LEN, LengthPolicy, LoadedTrace, TraceRequest

# Texts are counted in batches: tokenizers are much faster on a batch than one by one.
_COUNT_BATCH_PAIRS = 256


def _batches(pairs: Iterator[SharegptPair], size: int) -> Iterator[list[SharegptPair]]:
    while batch := list(islice(pairs, size)):
        yield batch


def read_sharegpt(
    path: str | Path,
    *,
    limit: int | None = None,
    max_model_len: int | None = DEFAULT_MAX_MODEL_LEN,
    token_counter: TokenCounter | None = None,
    tokenizer: str | None = None,
) -> LoadedTrace:
    """Read a ShareGPT file; stop after ``limit`` kept requests (None: read all).

    ``token_counter`` (anything with ``count(texts) -> list[int]``) wins over
    ``tokenizer`` (a name for :func:`blockq.tokenizer.get_token_counter`; None: the
    project default). ``trace_id`` is the conversation id.
    """
    counter = token_counter if token_counter is not None else get_token_counter(tokenizer)
    policy = LengthPolicy(max_model_len)
    requests: list[TraceRequest] = []
    batch_size = _COUNT_BATCH_PAIRS if limit is None else max(1, min(limit, _COUNT_BATCH_PAIRS))
    for batch in _batches(iter_pairs(path, first_turn_only=True), batch_size):
        counts = counter.count([pair.prompt for pair in batch] + [pair.answer for pair in batch])
        prompt_counts, answer_counts = counts[: len(batch)], counts[len(batch) :]
        for pair, prompt_tokens, answer_tokens in zip(
            batch, prompt_counts, answer_counts, strict=True
        ):
            if limit is not None and len(requests) >= limit:
                break
            if not pair.prompt.strip() or not pair.answer.strip():
                policy.count_invalid()
                continue
            fitted = policy.try_fit(prompt_tokens, answer_tokens)
            if fitted is None:
                continue
            requests.append(
                TraceRequest(
                    prompt=pair.prompt,
                    prompt_tokens=prompt_tokens,
                    true_output_tokens=fitted[0],
                    trace_id=pair.conversation_id,
                    output_text=pair.answer,
                )
            )
        if limit is not None and len(requests) >= limit:
            break
    policy.log_summary(str(path))
    return LoadedTrace(requests=requests, stats=policy.stats())
