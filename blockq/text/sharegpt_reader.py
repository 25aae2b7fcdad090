"""Streaming reader for ShareGPT conversation files.

A ShareGPT file is one JSON array of records ``{"id": ..., "conversations": [{"from":
"human" | "gpt" | ..., "value": text}, ...]}`` (the schema vLLM's benchmarks read),
stored plain or gzip-compressed. Public copies are often cut off mid-record, so the
reader parses the array one element at a time and stops cleanly, with a warning, at a
truncated final record (or a truncated gzip stream) instead of failing the whole file.

Used by the predictor's training and by the load generator's trace replay.
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import structlog

from blockq.frontdoors.gateway.chat_template import render_plain
from blockq.frontdoors.gateway.openai_requests import ChatMessage

logger = structlog.get_logger(__name__)

# Speaker names seen in ShareGPT dumps and their derivatives.
HUMAN_SPEAKERS = frozenset({"human", "user"})
GPT_SPEAKERS = frozenset({"gpt", "chatgpt", "assistant", "bard", "bing"})

_READ_CHUNK_BYTES = 1 << 16
_GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class SharegptPair:
    """One human turn and the gpt answer that follows it.

    ``turn_index`` counts human->gpt pairs from 0 (the first pair of the conversation);
    ``history`` holds the texts of all earlier turns of the conversation, oldest first
    (empty for the first pair).
    """

    conversation_id: str
    prompt: str
    answer: str
    turn_index: int
    history: tuple[str, ...] = ()


def _open_binary(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open ``path`` for binary reading, decompressing gzip (detected by magic bytes)."""
    with open(path, "rb") as probe:
        magic = probe.read(2)
    if magic == _GZIP_MAGIC:
        return gzip.open(path, "rb")
    return open(path, "rb")  # noqa: SIM115 - the caller closes it


def _iter_text_chunks(stream: IO[bytes], path: str) -> Iterator[str]:
    """Yield decoded UTF-8 text chunks; a truncated gzip stream ends the iteration."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while True:
        try:
            raw = stream.read(_READ_CHUNK_BYTES)
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            logger.warning("sharegpt_compressed_stream_truncated", path=path, error=str(exc))
            raw = b""
        if not raw:
            tail = decoder.decode(b"", final=True)
            if tail:
                yield tail
            return
        text = decoder.decode(raw)
        if text:
            yield text


def iter_conversations(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the records of a ShareGPT JSON array one at a time, in file order.

    Contract:
      - ``path`` may be plain JSON or gzip (detected from the content, not the name).
      - The file must start with a JSON array (``ValueError`` otherwise).
      - Parsing is streaming: memory holds about one record, not the whole file.
      - A truncated final record, a missing closing ``]`` or a truncated gzip stream
        ends the iteration after the last complete record, with a warning logged.
      - Array elements that are not JSON objects are skipped (logged).
    """
    path_text = os.fspath(path)
    decoder = json.JSONDecoder()
    num_records = 0
    with _open_binary(path) as stream:
        chunks = _iter_text_chunks(stream, path_text)
        buffer = ""
        position = 0
        at_eof = False

        def refill() -> bool:
            nonlocal buffer, position, at_eof
            chunk = next(chunks, None)
            if chunk is None:
                at_eof = True
                return False
            buffer = buffer[position:] + chunk
            position = 0
            return True

        def skip_separators(separators: str) -> str | None:
            """Advance past whitespace and ``separators``; return the next char or None."""
            nonlocal position
            while True:
                while position < len(buffer) and (
                    buffer[position].isspace() or buffer[position] in separators
                ):
                    position += 1
                if position < len(buffer):
                    return buffer[position]
                if not refill():
                    return None

        first = skip_separators("\ufeff")
        if first is None:
            return
        if first != "[":
            raise ValueError(f"{path_text}: expected a JSON array, found {first!r}")
        position += 1
        while True:
            next_char = skip_separators(",")
            if next_char is None:
                logger.warning(
                    "sharegpt_array_unterminated", path=path_text, num_records=num_records
                )
                return
            if next_char == "]":
                return
            while True:
                try:
                    record, end = decoder.raw_decode(buffer, position)
                    break
                except json.JSONDecodeError:
                    if at_eof or not refill():
                        logger.warning(
                            "sharegpt_truncated_record_skipped",
                            path=path_text,
                            num_records=num_records,
                        )
                        return
            position = end
            if not isinstance(record, dict):
                logger.warning("sharegpt_non_object_skipped", path=path_text, index=num_records)
                continue
            num_records += 1
            yield record


def _turn_text(turn: Any) -> tuple[str, str] | None:
    """Return ``(speaker, text)`` of one conversation turn, or None if malformed."""
    if not isinstance(turn, dict):
        return None
    speaker = turn.get("from", turn.get("role"))
    text = turn.get("value", turn.get("content"))
    if not isinstance(speaker, str) or not isinstance(text, str):
        return None
    return speaker.lower(), text


def pairs_of_conversation(
    record: dict[str, Any], *, record_index: int = 0, first_turn_only: bool = True
) -> list[SharegptPair]:
    """Split one ShareGPT record into human->gpt pairs.

    Returns an empty list when the conversation does not start human->gpt. With
    ``first_turn_only=False`` it walks the conversation pair by pair and stops at the
    first place where strict human/gpt alternation breaks. A record without an ``id``
    gets ``"record-<record_index>"``.
    """
    conversation_id = str(record.get("id", f"record-{record_index}"))
    raw_turns = record.get("conversations")
    if not isinstance(raw_turns, list):
        return []
    turns = [_turn_text(turn) for turn in raw_turns]
    pairs: list[SharegptPair] = []
    history: list[str] = []
    for start in range(0, len(turns) - 1, 2):
        human, gpt = turns[start], turns[start + 1]
        if human is None or gpt is None:
            break
        if human[0] not in HUMAN_SPEAKERS or gpt[0] not in GPT_SPEAKERS:
            break
        pairs.append(
            SharegptPair(
                conversation_id=conversation_id,
                prompt=human[1],
                answer=gpt[1],
                turn_index=start // 2,
                history=tuple(history),
            )
        )
        if first_turn_only:
            break
        history.extend((human[1], gpt[1]))
    return pairs


def render_turn_prompt(pair: SharegptPair) -> str:
    """The prompt of one turn as a chat client sends it: its history and new message,
    rendered by the gateway's ``plain`` template (``user: ...\nassistant: ...\nuser: <new>
    \nassistant:``), so that turn k's prompt starts with turn k-1's and its answer."""
    roles = ("user", "assistant")
    messages = [ChatMessage(role=roles[index % 2], content=text) for index, text in enumerate(pair.history)]
    messages.append(ChatMessage(role="user", content=pair.prompt))
    return render_plain(messages)


def iter_pairs(
    path: str | os.PathLike[str], *, first_turn_only: bool = True
) -> Iterator[SharegptPair]:
    """Yield human->gpt pairs from a ShareGPT file, in file order.

    Conversations that do not start human->gpt are skipped. With the default
    ``first_turn_only=True`` each conversation yields at most its first pair; otherwise
    every pair of the leading strictly alternating part, each with its ``history``.
    Truncated files are handled as in :func:`iter_conversations`.
    """
    for record_index, record in enumerate(iter_conversations(path)):
        yield from pairs_of_conversation(
            record, record_index=record_index, first_turn_only=first_turn_only
        )


def iter_sessions(path: str | os.PathLike[str]) -> Iterator[list[SharegptPair]]:
    """Yield each conversation's human->gpt pairs as one list (a session), in file order.

    Every pair of the leading strictly alternating part, oldest first, each with its
    ``history``; conversations that do not start human->gpt are skipped. Truncated files
    are handled as in :func:`iter_conversations`.
    """
    for record_index, record in enumerate(iter_conversations(path)):
        pairs = pairs_of_conversation(record, record_index=record_index, first_turn_only=False)
        if pairs:
            yield pairs
