"""Per-request output state in a worker, and the writes to reply and ``done`` streams.

Timings are measured on the wall clock from the request's ``submitted_at_s`` and
divided by the engine's ``time_scale``, so that they are in model time (for a real
engine, time_scale is 1). ``queue_wait_ms`` ends when the worker took the request from
its queue; ``ttft_ms`` and ``e2e_ms`` end at the first and last token (of this execution).

Every chunk and final record goes through :mod:`blockq.wire.output`, so a worker that no
longer owns a request (it was placed again elsewhere) or writes after its final record
is refused; the pipeline position each write returns lets the caller read that outcome.

**Re-execution resumes from what was streamed.** A request may run more than once (its
worker crashed, or was fenced off and the request placed again). Before the engine
starts it, the worker reads the request's reply stream (:func:`resume_from`): the text
and token count ``N`` already streamed and the next chunk index. The new execution does
not re-emit its first ``N`` output tokens; its chunks continue the indices and token
offsets, and its final text is the streamed text plus the text of its tokens after
``N`` (only the streamed text if it stops within ``N`` tokens). So what a reader has
streamed always equals the final text; for a deterministic engine (the emulated one) it
also equals a clean run's text. An engine event that straddles token ``N`` (several
tokens in one event) is emitted whole, its tokens counted only past ``N``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from blockq.client_reader import ReplyReader
from blockq.config import Settings
from blockq.wire.output import ALREADY_FINAL, FENCED, WRITTEN, queue_chunk, queue_final
from blockq.wire.protocol import Chunk, DoneRecord, FinalRecord, Request, encode
from workers.engines.base import EngineStepOutput, TokenEvent


@dataclass(frozen=True)
class Answer:
    """How a request is to be answered: the final record's status and reason."""

    status: str
    finish_reason: str
    error: str | None = None


@dataclass
class InFlight:
    """A request the worker has handed to its engine."""

    request: Request
    entry_id: str
    received_at_s: float
    prompt_tokens: int
    first_token_at_s: float | None = None
    last_token_at_s: float | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int | None = None  # prompt tokens the engine found cached (it said so)
    next_chunk_index: int = 0
    last_flush_at_s: float = 0.0
    text_parts: list[str] = field(default_factory=list)
    pending_parts: list[str] = field(default_factory=list)
    num_pending_tokens: int = 0
    # Output tokens earlier executions streamed (not re-emitted), and tokens on the
    # stream so far including them: the next chunk's offset.
    num_resumed_tokens: int = 0
    num_streamed_tokens: int = 0
    # Set once the request's answer is decided; cleared never (the worker drops the
    # flight once the final record's write is confirmed).
    answer: Answer | None = None
    # Encoded chunks whose write failed (Redis unreachable): sent again, first, with the
    # next write, so that the stream never has a hole (readers skip what they have).
    unsent_chunks: list[bytes] = field(default_factory=list)

    @property
    def num_answered_tokens(self) -> int:
        """Output tokens the final record reports: streamed before plus this run's rest."""
        return max(self.num_resumed_tokens, self.num_output_tokens)

    def add_tokens(self, event: TokenEvent, now_s: float) -> None:
        if self.first_token_at_s is None:
            self.first_token_at_s = now_s
        self.last_token_at_s = now_s
        if event.num_cached_tokens is not None:
            self.num_cached_tokens = event.num_cached_tokens
        num_before = self.num_output_tokens
        self.num_output_tokens += event.num_new_tokens
        if self.num_output_tokens <= self.num_resumed_tokens:
            return  # already streamed by an earlier execution
        self.num_pending_tokens += self.num_output_tokens - max(num_before, self.num_resumed_tokens)
        self.pending_parts.append(event.text)

    def due_for_flush(self, now_s: float, interval_ms: float) -> bool:
        return bool(self.pending_parts) and (now_s - self.last_flush_at_s) * 1000 >= interval_ms


def resume_from(flight: InFlight, reader: ReplyReader) -> None:
    """Continue ``flight`` from what its reply stream already holds (``reader`` fed with
    the whole stream): streamed text, token count and next chunk index."""
    flight.text_parts = [reader.text] if reader.text else []
    flight.num_resumed_tokens = reader.num_tokens_received
    flight.num_streamed_tokens = reader.num_tokens_received
    flight.next_chunk_index = reader.next_index


async def restore_lost_output(client: Any, flights: list[InFlight]) -> int:
    """After a Redis outage: put back on each flight's reply stream what Redis lost of
    this worker's output (a crash under ``appendfsync everysec``, or a failover, loses the
    last writes it acknowledged). A reader that had not read them would see a hole where
    the final text has words. One round trip reads the streams; a flight whose stream
    holds less than it streamed gets one chunk with the missing text, at its token offset,
    sent first with its next write (it replaces chunks waiting to be sent again, which it
    covers). A stream with a final record, or text this flight did not write, is left
    alone. Returns how many flights were repaired."""
    pipe = client.pipeline(transaction=False)
    for flight in flights:
        pipe.xrange(flight.request.reply_stream)
    num_repaired = 0
    for flight, entries in zip(flights, await pipe.execute() if flights else [], strict=True):
        reader = ReplyReader()
        reader.feed(entries)
        streamed_text = "".join(flight.text_parts)
        if (reader.final is not None or reader.num_tokens_received >= flight.num_streamed_tokens
                or not streamed_text.startswith(reader.text)):
            continue
        chunk = Chunk(flight.request.id, flight.next_chunk_index, streamed_text[len(reader.text):],
                      flight.num_streamed_tokens - reader.num_tokens_received, reader.num_tokens_received)
        flight.next_chunk_index += 1
        flight.unsent_chunks = [encode(chunk)]
        num_repaired += 1
    return num_repaired


def record_step_output(in_flight: dict[str, InFlight], output: EngineStepOutput,
                       now_s: float) -> Iterator[tuple[TokenEvent, InFlight]]:
    """Count the step's preemptions and hand its tokens to their requests (at ``now_s``);
    yields each (event, flight) for the caller to answer (unknown requests are skipped)."""
    for request_id in output.preempted_ids:
        flight = in_flight.get(request_id)
        if flight is not None:
            flight.num_preemptions += 1
    for event in output.events:
        flight = in_flight.get(event.request_id)
        if flight is None:
            continue
        flight.add_tokens(event, now_s)
        yield event, flight


@dataclass(frozen=True)
class OutputWrite:
    """An output script queued on a pipeline: its position there, its request, and for a
    chunk its payload (sent again if the write fails)."""

    position: int
    flight: InFlight
    is_final: bool
    chunk: bytes | None = None


def settle_writes(results: list[Any], writes: list[OutputWrite]
                  ) -> tuple[dict[str, tuple[InFlight, str]], list[tuple[OutputWrite, Any]]]:
    """The outcome of a pipeline's output writes (``results``: its results, exceptions in
    place): the requests settled by id, with how (``answered``: its final record written
    here; ``answered_elsewhere``; ``fenced``), and the writes that failed. A failed
    chunk is put back on its flight's ``unsent_chunks`` (in pipeline order) to go out
    first next time; a failed final record settles nothing, so it is written again."""
    done: dict[str, tuple[InFlight, str]] = {}
    failed: list[tuple[OutputWrite, Any]] = []
    for write in writes:
        result = results[write.position]
        request_id = write.flight.request.id
        if isinstance(result, Exception):
            failed.append((write, result))
            if write.chunk is not None:
                write.flight.unsent_chunks.append(write.chunk)
        elif result == FENCED:
            done[request_id] = (write.flight, "fenced")
        elif result == ALREADY_FINAL:
            done.setdefault(request_id, (write.flight, "answered_elsewhere"))
        elif result == WRITTEN and write.is_final:
            done.setdefault(request_id, (write.flight, "answered"))
    return done, failed


class ReplyWriter:
    """Queues a request's chunks and final record (with its ``done`` entry) on a
    pipeline, as ``instance_id``; each call returns the position of its write in the
    pipeline, whose result is ``WRITTEN``, ``ALREADY_FINAL`` or ``FENCED``."""

    def __init__(self, settings: Settings, instance_id: str, time_scale: float) -> None:
        self.settings = settings
        self.instance_id = instance_id
        self.time_scale = time_scale

    def flush(self, pipe: Any, flight: InFlight) -> list[tuple[int, bytes]]:
        """Write the chunks whose earlier write failed, then the tokens produced since the
        last flush as one chunk; returns each write's (pipeline position, payload)."""
        writes = [self._queue_chunk(pipe, flight, payload) for payload in flight.unsent_chunks]
        flight.unsent_chunks = []
        if not flight.pending_parts:
            return writes
        text = "".join(flight.pending_parts)
        chunk = Chunk(flight.request.id, flight.next_chunk_index, text, flight.num_pending_tokens,
                      flight.num_streamed_tokens)
        writes.append(self._queue_chunk(pipe, flight, encode(chunk)))
        flight.text_parts.append(text)
        flight.num_streamed_tokens += flight.num_pending_tokens
        flight.pending_parts = []
        flight.num_pending_tokens = 0
        flight.next_chunk_index += 1
        flight.last_flush_at_s = flight.last_token_at_s or flight.received_at_s
        return writes

    def _queue_chunk(self, pipe: Any, flight: InFlight, payload: bytes) -> tuple[int, bytes]:
        queue_chunk(pipe, self.settings.keys, flight.request.id, flight.request.reply_stream, self.instance_id,
                    payload, self.settings.reply_ttl_s)
        return len(pipe) - 1, payload

    def finish(self, pipe: Any, flight: InFlight, answer: Answer) -> int:
        """Write the final record and the ``done`` entry (the caller ACKs the queue entry
        once the write is confirmed)."""
        request = flight.request
        final = final_record(flight, self.instance_id, self.time_scale, status=answer.status,
                             finish_reason=answer.finish_reason, error=answer.error)
        prediction = request.prediction
        assignment = request.assignment
        done = DoneRecord(
            request_id=request.id, instance=self.instance_id, status=answer.status,
            prompt_tokens=flight.prompt_tokens, output_tokens=flight.num_answered_tokens,
            predicted_output_tokens=final.predicted_output_tokens,
            predictor_version=prediction.predictor_version if prediction else None,
            policy=assignment.policy if assignment else None,
            submitted_at_s=request.submitted_at_s,
            finished_at_s=flight.last_token_at_s or flight.received_at_s,
            predicted_ttft_ms=final.predicted_ttft_ms, predicted_e2e_ms=final.predicted_e2e_ms,
            num_preemptions=flight.num_preemptions, tenant=request.tenant, priority=request.priority,
            queue_wait_ms=final.queue_wait_ms, ttft_ms=final.ttft_ms, tpot_ms=final.tpot_ms, e2e_ms=final.e2e_ms)
        queue_final(pipe, self.settings.keys, request.id, request.reply_stream, self.instance_id, encode(final),
                    encode(done), self.settings.reply_ttl_s)
        return len(pipe) - 1


def final_record(flight: InFlight, instance_id: str, time_scale: float, *, status: str, finish_reason: str,
                 error: str | None = None) -> FinalRecord:
    """The final record of ``flight`` on ``instance_id`` (timings in model time)."""
    request = flight.request
    prediction = request.prediction
    assignment = request.assignment
    return FinalRecord(
        request_id=request.id, index=flight.next_chunk_index, status=status,
        text="".join(flight.text_parts), output_tokens=flight.num_answered_tokens,
        prompt_tokens=flight.prompt_tokens, instance=instance_id, finish_reason=finish_reason,
        num_preemptions=flight.num_preemptions,
        predicted_output_tokens=prediction.predicted_output_tokens if prediction else None,
        predicted_ttft_ms=assignment.predicted_ttft_ms if assignment else None,
        predicted_e2e_ms=assignment.predicted_e2e_ms if assignment else None,
        cached_tokens=flight.num_cached_tokens,
        predicted_cached_tokens=assignment.predicted_cached_tokens if assignment else None,
        error=error, **flight_timings(flight, time_scale))


def flight_timings(flight: InFlight, time_scale: float) -> dict[str, float | None]:
    """``queue_wait_ms``, ``ttft_ms``, ``tpot_ms``, ``e2e_ms`` of ``flight``: model-time
    milliseconds from the request's ``submitted_at_s``."""
    submitted_s = flight.request.submitted_at_s

    def model_ms(wall_s: float | None) -> float | None:
        return None if wall_s is None else max(0.0, (wall_s - submitted_s) * 1000 / time_scale)

    ttft_ms = model_ms(flight.first_token_at_s)
    e2e_ms = model_ms(flight.last_token_at_s)
    tpot_ms = None
    if ttft_ms is not None and e2e_ms is not None and flight.num_output_tokens > 1:
        tpot_ms = (e2e_ms - ttft_ms) / (flight.num_output_tokens - 1)
    return {"queue_wait_ms": model_ms(flight.received_at_s), "ttft_ms": ttft_ms,
            "tpot_ms": tpot_ms, "e2e_ms": e2e_ms}
