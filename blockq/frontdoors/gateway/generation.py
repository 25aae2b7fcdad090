"""Serving one generation call: submit its requests, then answer with one JSON body or a
stream of server-sent events, cancelling the requests in the pipeline when the client
leaves or the call times out.

Contract: every request this module submits either reaches its final record or is
cancelled (``AsyncClient.cancel``) before the HTTP call ends, whatever way it ends. That
includes a client that stays connected but stops reading a stream: each stream write has
``write_timeout_s`` to drain, after which the connection is dropped (docs/gateway.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

import structlog
from aiohttp import web

from blockq.client import AsyncClient, AsyncHandle
from blockq.frontdoors.gateway.errors import GatewayError
from blockq.frontdoors.gateway.metrics import GatewayMetrics
from blockq.frontdoors.gateway.openai_requests import GenerationPlan
from blockq.frontdoors.gateway.openai_responses import (
    ChunkBuilder,
    completion_body,
    error_body,
    extras_headers,
)
from blockq.wire.protocol import STATUS_INFEASIBLE as INFEASIBLE
from blockq.wire.protocol import Chunk, FinalRecord

log = structlog.get_logger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
FAILED_STATUSES = ("error", INFEASIBLE)


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class StreamStalled(ConnectionError):
    """A stream write did not drain within the write deadline: the client stopped reading."""


class SseWriter:
    """Writes one response's event stream, each write bounded by ``write_timeout_s``.

    aiohttp's ``write`` waits for the socket to drain once 64 KiB are buffered, with no
    limit: a client that stops reading would hold its handler, its slot and its requests
    for ever. Bytes given to ``hold`` go out with the next write (see ``_respond_streaming``).
    """

    def __init__(self, response: web.StreamResponse, write_timeout_s: float) -> None:
        self.response = response
        self.write_timeout_s = write_timeout_s
        self.pending = b""

    def hold(self, data: bytes) -> None:
        self.pending += data

    async def write(self, event: bytes) -> None:
        data, self.pending = self.pending + event, b""
        await self._within_deadline(self.response.write(data))

    async def write_eof(self) -> None:
        await self._within_deadline(self.response.write_eof())

    async def _within_deadline(self, write: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await write
        except TimeoutError:
            raise StreamStalled(f"stream write not drained within {self.write_timeout_s:g} s") from None


async def merged_stream(handles: Sequence[AsyncHandle],
                        timeout_s: float) -> AsyncIterator[tuple[int, Chunk | FinalRecord]]:
    """(choice index, chunk or final record) from every handle as they arrive; each handle's
    chunks in order and its final record last. Raises TimeoutError after ``timeout_s``."""
    if len(handles) == 1:  # the common case, without tasks and a queue
        handle = handles[0]
        async for chunk in handle.stream(timeout_s):
            yield 0, chunk
        yield 0, await handle.result(timeout_s)
        return
    queue: asyncio.Queue[tuple[int, Chunk | FinalRecord | BaseException]] = asyncio.Queue()

    async def pump(index: int, handle: AsyncHandle) -> None:
        try:
            async for chunk in handle.stream(timeout_s):
                queue.put_nowait((index, chunk))
            queue.put_nowait((index, await handle.result(timeout_s)))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        num_open = len(handles)
        while num_open:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, FinalRecord):
                num_open -= 1
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


class GenerationCall:
    """One ``/v1/completions`` or ``/v1/chat/completions`` call after validation."""

    def __init__(self, client: AsyncClient, metrics: GatewayMetrics, background: set[asyncio.Task[Any]],
                 plan: GenerationPlan, tenant: str, timeout_s: float, endpoint: str, *,
                 write_timeout_s: float) -> None:
        self.client = client
        self.metrics = metrics
        self.background = background
        self.plan = plan
        self.tenant = tenant
        self.timeout_s = timeout_s
        self.endpoint = endpoint
        self.write_timeout_s = write_timeout_s
        self.base_id = uuid.uuid4().hex
        self.created_s = int(time.time())
        self.started_at_s = time.perf_counter()
        self.handles: list[AsyncHandle] = []
        self.finished_ids: set[str] = set()

    async def respond(self, request: web.Request) -> web.StreamResponse:
        """Submit (raises Overloaded / ValidationError before anything is sent) and answer."""
        self.handles = await self.client.submit_many(self.plan.submit_specs(self.base_id, self.tenant))
        try:
            if self.plan.stream:
                return await self._respond_streaming(request)
            return await self._respond_json()
        except asyncio.CancelledError:
            self.metrics.disconnects.inc()
            log.info("client_disconnected", request_id=self.base_id)
            self._cancel_unfinished()
            raise
        except TimeoutError:
            self._cancel_unfinished()
            raise GatewayError(504, f"no result within {self.timeout_s:g} s; the request was cancelled",
                               "timeout", code="timeout", headers={"x-request-id": self.base_id}) from None
        except BaseException:
            self._cancel_unfinished()
            raise

    def _cancel_unfinished(self) -> None:
        ids = [h.id for h in self.handles if h.id not in self.finished_ids]
        if not ids:
            return
        task = asyncio.create_task(self._cancel(ids))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _cancel(self, request_ids: list[str]) -> None:
        try:
            await asyncio.gather(*(self.client.cancel(rid) for rid in request_ids))
            log.info("requests_cancelled", request_ids=request_ids)
        except Exception:
            log.exception("cancel_failed", request_ids=request_ids)

    def _account(self, final: FinalRecord) -> None:
        self.finished_ids.add(final.request_id)
        self.metrics.completion_tokens.inc(final.output_tokens)
        if final.status == "error":
            log.error("generation_failed", request_id=final.request_id, instance=final.instance, error=final.error)

    def _failure(self, final: FinalRecord) -> GatewayError:
        if final.status == INFEASIBLE:
            # Refused before anything ran: the client may retry later, or send best_effort.
            return GatewayError(503, f"{final.error} (request id {final.request_id}); send \"best_effort\": "
                                "true to be served however late", "slo_infeasible", code="slo_infeasible",
                                headers={"x-request-id": self.base_id, **extras_headers(final)})
        return GatewayError(500, f"generation failed (request id {final.request_id})", "server_error",
                            code="generation_failed", headers={"x-request-id": self.base_id})

    async def _respond_json(self) -> web.Response:
        results = asyncio.gather(*(h.result(self.timeout_s) for h in self.handles))
        finals: list[FinalRecord] = await asyncio.wait_for(results, self.timeout_s)
        for final in finals:
            self._account(final)
        self.metrics.prompt_tokens.inc(sum(finals[i * self.plan.n].prompt_tokens
                                           for i in range(len(self.plan.prompts))))
        failed = [f for f in finals if f.status in FAILED_STATUSES]
        if failed:
            raise self._failure(failed[0])
        body = completion_body(self.plan, self.base_id, self.created_s, finals)
        headers = {"x-request-id": self.base_id, **extras_headers(finals[0])}
        return web.Response(body=json.dumps(body, separators=(",", ":")), headers=headers,
                            content_type="application/json")

    async def _placement_comments(self) -> bytes:
        """Where each choice went and its forecast, as SSE comments
        (``: x-blockq-placement {...}``; clients of the OpenAI stream ignore comments)."""
        deadline_s = time.monotonic() + self.timeout_s  # one bound for all of them
        comments = b""
        for index, handle in enumerate(self.handles):
            placement = await handle.placement(max(0.0, deadline_s - time.monotonic()))
            if placement is not None:
                body = {"index": index, "instance": placement.instance,
                        "predicted_ttft_ms": placement.predicted_ttft_ms,
                        "predicted_e2e_ms": placement.predicted_e2e_ms}
                comments += b": x-blockq-placement " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
        return comments

    async def _respond_streaming(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={
            "content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no",
            "x-request-id": self.base_id})
        await response.prepare(request)  # aiohttp holds the headers back until the first write
        writer = SseWriter(response, self.write_timeout_s)
        try:
            finals = await self._stream_events(writer)
            done = [f for f in finals if f is not None]
            if len(done) == len(finals):
                self.metrics.prompt_tokens.inc(sum(done[i * self.plan.n].prompt_tokens
                                                   for i in range(len(self.plan.prompts))))
                if self.plan.include_usage:
                    await writer.write(_sse(ChunkBuilder(self.plan, self.base_id, self.created_s).usage(done)))
            await writer.write(SSE_DONE)
            await writer.write_eof()
        except StreamStalled:
            self.metrics.slow_clients.inc(phase="stream_write")
            log.info("client_stalled", request_id=self.base_id, write_timeout_s=self.write_timeout_s)
            self._cancel_unfinished()
            if request.transport is not None:
                request.transport.abort()  # what is buffered would never be read: drop it with the connection
        except ConnectionError:  # the client went away between our writes
            self.metrics.disconnects.inc()
            self._cancel_unfinished()
        return response

    async def _stream_events(self, writer: SseWriter) -> list[FinalRecord | None]:
        """Every choice's events, as they arrive; the final records (None: a choice that
        timed out, after an error event saying so)."""
        builder = ChunkBuilder(self.plan, self.base_id, self.created_s)
        finals: list[FinalRecord | None] = [None] * self.plan.num_choices
        is_first = True
        # A choice's opening (the chat role chunk, or the echoed prompt) goes out with its
        # first token, as vLLM's server sends it: benchmark clients time the first token
        # by the first chunk with choices, and an opening sent at placement would read as one.
        unopened = set(range(self.plan.num_choices))

        def opened(index: int, event: bytes) -> bytes:
            if index not in unopened:
                return event
            unopened.discard(index)
            opening = builder.opening(index)
            return (_sse(opening) if opening is not None else b"") + event

        try:
            # The placement comments go out in one write with the first event after them: a
            # client that splits the stream by network reads and strips each (vLLM's benchmark
            # client does) would glue a comment written alone to the next event.
            writer.hold(await self._placement_comments())
            async with contextlib.aclosing(merged_stream(self.handles, self.timeout_s)) as events:
                async for index, item in events:
                    if isinstance(item, Chunk):
                        if is_first:
                            self.metrics.first_chunk.observe(time.perf_counter() - self.started_at_s,
                                                             endpoint=self.endpoint)
                            is_first = False
                        await writer.write(opened(index, _sse(builder.text(index, item.text))))
                        continue
                    finals[index] = item
                    self._account(item)
                    if item.status in FAILED_STATUSES:
                        error = self._failure(item)
                        await writer.write(_sse(error_body(error.message, error.error_type, code=error.code)))
                    else:
                        await writer.write(opened(index, _sse(builder.finish(index, item))))
        except TimeoutError:
            self._cancel_unfinished()
            await writer.write(_sse(error_body(f"no result within {self.timeout_s:g} s; the request was "
                                               "cancelled", "timeout", code="timeout")))
        return finals
