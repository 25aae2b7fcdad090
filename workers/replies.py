"""Per-request output state in a worker, and the writes to reply and ``done`` streams.

Timings are measured on the wall clock from the request's ``submitted_at_s`` and
divided by the engine's ``time_scale``, so that they are in model time (for a real
engine, time_scale is 1). ``queue_wait_ms`` ends when the worker took the request from
its queue; ``ttft_ms`` and ``e2e_ms`` end at the first and last token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from blockq.config import Settings
from blockq.keys import PAYLOAD_FIELD
from blockq.protocol import Chunk, DoneRecord, FinalRecord, Request, encode
from workers.engines.base import EngineStepOutput, TokenEvent

DONE_STREAM_MAXLEN = 200_000


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
    next_chunk_index: int = 0
    last_flush_at_s: float = 0.0
    text_parts: list[str] = field(default_factory=list)
    pending_parts: list[str] = field(default_factory=list)
    num_pending_tokens: int = 0

    def add_tokens(self, event: TokenEvent, now_s: float) -> None:
        if self.first_token_at_s is None:
            self.first_token_at_s = now_s
        self.last_token_at_s = now_s
        self.num_output_tokens += event.num_new_tokens
        self.num_pending_tokens += event.num_new_tokens
        self.pending_parts.append(event.text)

    def due_for_flush(self, now_s: float, interval_ms: float) -> bool:
        return bool(self.pending_parts) and (now_s - self.last_flush_at_s) * 1000 >= interval_ms


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


class ReplyWriter:
    """Queues a request's chunks, final record and ``done`` entry on a pipeline."""

    def __init__(self, settings: Settings, instance_id: str, time_scale: float) -> None:
        self.settings = settings
        self.instance_id = instance_id
        self.time_scale = time_scale

    def flush(self, pipe: Any, flight: InFlight) -> None:
        """Write the tokens produced since the last flush as one chunk."""
        if not flight.pending_parts:
            return
        text = "".join(flight.pending_parts)
        chunk = Chunk(flight.request.id, flight.next_chunk_index, text, flight.num_pending_tokens)
        pipe.xadd(flight.request.reply_stream, {PAYLOAD_FIELD: encode(chunk)})
        pipe.expire(flight.request.reply_stream, self.settings.reply_ttl_s)
        flight.text_parts.append(text)
        flight.pending_parts = []
        flight.num_pending_tokens = 0
        flight.next_chunk_index += 1
        flight.last_flush_at_s = flight.last_token_at_s or flight.received_at_s

    def finish(self, pipe: Any, flight: InFlight, *, status: str, finish_reason: str,
               error: str | None = None) -> FinalRecord:
        """Write the final record and the ``done`` entry (the caller ACKs the queue entry)."""
        request = flight.request
        final = final_record(flight, self.instance_id, self.time_scale, status=status,
                             finish_reason=finish_reason, error=error)
        pipe.xadd(request.reply_stream, {PAYLOAD_FIELD: encode(final)})
        pipe.expire(request.reply_stream, self.settings.reply_ttl_s)
        prediction = request.prediction
        assignment = request.assignment
        done = DoneRecord(
            request_id=request.id, instance=self.instance_id, status=status,
            prompt_tokens=flight.prompt_tokens, output_tokens=flight.num_output_tokens,
            predicted_output_tokens=final.predicted_output_tokens,
            predictor_version=prediction.predictor_version if prediction else None,
            policy=assignment.policy if assignment else None,
            submitted_at_s=request.submitted_at_s,
            finished_at_s=flight.last_token_at_s or flight.received_at_s,
            predicted_ttft_ms=final.predicted_ttft_ms, predicted_e2e_ms=final.predicted_e2e_ms,
            num_preemptions=flight.num_preemptions, tenant=request.tenant, priority=request.priority,
            queue_wait_ms=final.queue_wait_ms, ttft_ms=final.ttft_ms, tpot_ms=final.tpot_ms, e2e_ms=final.e2e_ms)
        pipe.xadd(self.settings.keys.done, {PAYLOAD_FIELD: encode(done)}, maxlen=DONE_STREAM_MAXLEN,
                  approximate=True)
        return final


def final_record(flight: InFlight, instance_id: str, time_scale: float, *, status: str, finish_reason: str,
                 error: str | None = None) -> FinalRecord:
    """The final record of ``flight`` on ``instance_id`` (timings in model time)."""
    request = flight.request
    prediction = request.prediction
    assignment = request.assignment
    return FinalRecord(
        request_id=request.id, index=flight.next_chunk_index, status=status,
        text="".join(flight.text_parts), output_tokens=flight.num_output_tokens,
        prompt_tokens=flight.prompt_tokens, instance=instance_id, finish_reason=finish_reason,
        num_preemptions=flight.num_preemptions,
        predicted_output_tokens=prediction.predicted_output_tokens if prediction else None,
        predicted_ttft_ms=assignment.predicted_ttft_ms if assignment else None,
        predicted_e2e_ms=assignment.predicted_e2e_ms if assignment else None,
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
