"""The de-duplicating reader of a reply stream, shared by the client library's handles
and by the workers (which read what a request already streamed before resuming it)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.protocol import Chunk, FinalRecord, Placement, decode_reply_entry


class ReplyReader:
    """Turns reply-stream entries into in-order, de-duplicated chunks and a final record.

    Guarantee: the chunks it yields hold each output token's text once, in order. It
    de-duplicates by token offset, not chunk index, because a request executed again
    (its worker died or was fenced) cuts its output into different chunks: a chunk
    wholly below the tokens received yields nothing, one that overlaps them yields only
    its unseen tail (cut where its overlapping part matches the text received from a
    chunk boundary; a chunk that cannot be cut so is dropped). Workers resume a request
    from what its stream already holds and answer with streamed text + the rest, so with
    one writer at a time the yielded text equals the final record's ``text``. Entries
    after the final record are ignored. Chunks without an offset (older writers) are
    de-duplicated by index.
    """

    def __init__(self) -> None:
        self.last_entry_id = "0-0"
        self.next_index = 0          # one past the highest chunk index seen
        self.num_tokens_received = 0
        self.final: FinalRecord | None = None
        self.placement: Placement | None = None  # the latest, when placed again
        self._text_parts: list[str] = []
        self._num_chars = 0
        # token offset -> characters received before it, at each received chunk's start
        self._offset_to_chars: dict[int, int] = {0: 0}

    @property
    def text(self) -> str:
        """The text of every chunk yielded so far."""
        return "".join(self._text_parts)

    def feed(self, entries: Iterable[tuple[Any, Mapping[bytes, bytes]]]) -> list[Chunk]:
        fresh: list[Chunk] = []
        for entry_id, fields in entries:
            self.last_entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            if self.final is not None:
                continue
            message = decode_reply_entry(fields[PAYLOAD_FIELD.encode()])
            if isinstance(message, FinalRecord):
                self.final = message
                continue
            if isinstance(message, Placement):
                self.placement = message
                continue
            chunk = self._unseen_part(message)
            self.next_index = max(self.next_index, message.index + 1)
            if chunk is not None:
                self._accept(chunk)
                fresh.append(chunk)
        return fresh

    def rewind(self) -> None:
        """Read the stream from its start again (after a resubmission: the entries seen
        may have been lost with the admission, and the new run's entries may be dated
        before them on another host's clock). What was yielded stays de-duplicated."""
        self.last_entry_id = "0-0"

    def _unseen_part(self, chunk: Chunk) -> Chunk | None:
        """``chunk``, its unseen tail, or None when nothing in it is new."""
        if chunk.offset_tokens is None:
            return chunk if chunk.index >= self.next_index else None
        end_tokens = chunk.offset_tokens + chunk.num_tokens
        if end_tokens <= self.num_tokens_received:
            return None
        if chunk.offset_tokens >= self.num_tokens_received:
            # At the end of what was received, or past it: nothing earlier can fill a gap
            # (one writer at a time never leaves one), so the text is yielded as it is.
            return chunk
        start_chars = self._offset_to_chars.get(chunk.offset_tokens)
        if start_chars is None:
            return None
        seen = self.text[start_chars:]
        if not chunk.text.startswith(seen):
            return None
        return Chunk(chunk.request_id, chunk.index, chunk.text[len(seen):],
                     end_tokens - self.num_tokens_received, self.num_tokens_received)

    def _accept(self, chunk: Chunk) -> None:
        start_tokens = self.num_tokens_received if chunk.offset_tokens is None else chunk.offset_tokens
        self._offset_to_chars[start_tokens] = self._num_chars
        self._text_parts.append(chunk.text)
        self._num_chars += len(chunk.text)
        if chunk.offset_tokens is None:
            self.num_tokens_received += chunk.num_tokens
        else:
            self.num_tokens_received = chunk.offset_tokens + chunk.num_tokens
        self._offset_to_chars[self.num_tokens_received] = self._num_chars
