"""ShareGPT conversations (JSON array, plain or gzip, possibly cut off mid-record).

Two modes:

* first turns (the default): each conversation gives at most one request, its first human
  turn as the prompt text and the gpt answer that follows as the recorded answer;
* ``multi_turn``: each conversation becomes a session (``session_id``, ``turn_index``
  from 0), one request per human->gpt pair. Turn k's prompt is the conversation so far,
  every earlier human and gpt message and then the new human message, rendered as the
  gateway's ``plain`` chat template does (``user: ...\\nassistant: ...\\nuser: <new>\\n
  assistant:``, :func:`blockq.frontdoors.gateway.chat_template.render_plain`), so turn k's prompt
  starts with turn k-1's prompt and its answer: the prefix a real chat client resends.
  When a turn is skipped (too long for ``max_model_len``, or malformed) the rest of its
  session is dropped and counted
  (:attr:`~loadgen.traces.base.TraceStats.num_dropped_session_turns`).

Parsing, gzip and truncation handling are :mod:`blockq.text.sharegpt_reader`'s. Token counts come
from the project's counter (:func:`blockq.text.tokenizer.get_token_counter`) or the one passed
in, so they agree with the predictor's; ``true_output_tokens`` is the answer's count and
``output_text`` the answer. Pairs with an empty prompt or answer are malformed; lengths
follow the policy in :mod:`loadgen.traces.base`. The trace has no times:
``arrival_offset_s`` is None.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import TypeVar

from blockq.text.sharegpt_reader import SharegptPair, iter_pairs, iter_sessions, render_turn_prompt
from blockq.text.tokenizer import TokenCounter, get_token_counter
from loadgen.traces.base import DEFAULT_MAX_MODEL_LEN, LengthPolicy, LoadedTrace, TraceRequest

# Texts are counted in batches: tokenizers are much faster on a batch than one by one.
_COUNT_BATCH_PAIRS = 256
# Sessions per counting batch (ShareGPT conversations average about 3.4 turns).
_COUNT_BATCH_SESSIONS = 64

_Item = TypeVar("_Item")


def _batches(items: Iterator[_Item], size: int) -> Iterator[list[_Item]]:
    while batch := list(islice(items, size)):
        yield batch


def read_sharegpt(
    path: str | Path,
    *,
    limit: int | None = None,
    max_model_len: int | None = DEFAULT_MAX_MODEL_LEN,
    token_counter: TokenCounter | None = None,
    tokenizer: str | None = None,
    multi_turn: bool = False,
) -> LoadedTrace:
    """Read a ShareGPT file; stop after ``limit`` kept requests (None: read all).

    ``token_counter`` (anything with ``count(texts) -> list[int]``) wins over
    ``tokenizer`` (a name for :func:`blockq.text.tokenizer.get_token_counter`; None: the
    project default). ``trace_id`` is the conversation id. ``multi_turn``: one request
    per turn, grouped in sessions (see the module docstring); a session the limit cuts
    keeps its first turns.
    """
    counter = token_counter if token_counter is not None else get_token_counter(tokenizer)
    policy = LengthPolicy(max_model_len)
    if multi_turn:
        requests = _read_sessions(path, limit, policy, counter)
    else:
        requests = _read_first_turns(path, limit, policy, counter)
    policy.log_summary(str(path))
    return LoadedTrace(requests=requests, stats=policy.stats())


def _read_first_turns(
    path: str | Path, limit: int | None, policy: LengthPolicy, counter: TokenCounter
) -> list[TraceRequest]:
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
    return requests


def _read_sessions(
    path: str | Path, limit: int | None, policy: LengthPolicy, counter: TokenCounter
) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    id_to_num_seen: dict[str, int] = {}
    batch_size = (
        _COUNT_BATCH_SESSIONS if limit is None else max(1, min(limit, _COUNT_BATCH_SESSIONS))
    )
    for batch in _batches(iter_sessions(path), batch_size):
        prompts = [render_turn_prompt(pair) for session in batch for pair in session]
        counts = counter.count(prompts + [pair.answer for session in batch for pair in session])
        position = 0
        for session in batch:
            end = position + len(session)
            room = None if limit is None else limit - len(requests)
            requests.extend(_session_requests(
                session, prompts[position:end], counts[position:end],
                counts[len(prompts) + position : len(prompts) + end],
                _unique_session_id(session[0].conversation_id, id_to_num_seen), policy, room,
            ))
            position = end
            if limit is not None and len(requests) >= limit:
                return requests
    return requests


def _unique_session_id(conversation_id: str, id_to_num_seen: dict[str, int]) -> str:
    """The conversation id, suffixed when a file repeats it (two sessions never merge)."""
    num_seen = id_to_num_seen.get(conversation_id, 0)
    id_to_num_seen[conversation_id] = num_seen + 1
    return conversation_id if num_seen == 0 else f"{conversation_id}#{num_seen}"


def _session_requests(
    session: list[SharegptPair],
    prompts: list[str],
    prompt_counts: list[int],
    answer_counts: list[int],
    session_id: str,
    policy: LengthPolicy,
    room: int | None,
) -> list[TraceRequest]:
    """The kept turns of one session, at most ``room`` (None: all); stops at a skipped turn."""
    requests: list[TraceRequest] = []
    for index, pair in enumerate(session):
        if room is not None and len(requests) >= room:
            break
        if not pair.prompt.strip() or not pair.answer.strip():
            policy.count_invalid()
            fitted = None
        else:
            fitted = policy.try_fit(prompt_counts[index], answer_counts[index])
        if fitted is None:
            # Later turns quote a turn that was never served: they cannot be replayed.
            policy.count_dropped_turns(len(session) - index - 1)
            break
        requests.append(
            TraceRequest(
                prompt=prompts[index],
                prompt_tokens=prompt_counts[index],
                true_output_tokens=fitted[0],
                trace_id=pair.conversation_id,
                output_text=pair.answer,
                session_id=session_id,
                turn_index=pair.turn_index,
            )
        )
    return requests
