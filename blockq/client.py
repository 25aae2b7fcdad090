"""The client library: submit requests, stream their output, read their final record.

``Client`` is synchronous, ``AsyncClient`` the asyncio twin; both share the request
building, the admission script and its watch (:mod:`blockq.client_admission`: a request
Redis lost after accepting it is submitted again) and the de-duplicating reply reader,
and differ only in how they talk to Redis.

Delivery is at-least-once inside the pipeline, so a reply stream may hold a request's
output twice over (a worker that died mid-request and was replaced). Readers keep the
number of output tokens received and yield only tokens past it (see :class:`ReplyReader`):
each token's text is yielded exactly once, in order, and equals the final record's text.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import redis

from blockq.client_admission import (
    ADMIT_SCRIPT,
    RESUBMIT_REFUSED,
    Overloaded,
    SubmitWatch,
    admission_call,
    admission_result,
)
from blockq.client_cells import CellLink, CellRouter, cell_settings, connect_links
from blockq.client_reader import ReplyReader
from blockq.config import Settings
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.protocol import Chunk, FinalRecord, Placement, Request
from blockq.wire.streams import connect, connect_async

# Names this module has always offered (the admission's and the reader's modules are newer).
__all__ = ["AsyncClient", "AsyncHandle", "Client", "Handle", "Overloaded", "ReplyReader", "SubmitSpec",
           "build_request"]
_ADMIT_SCRIPT = ADMIT_SCRIPT
_admission_call = admission_call
_admission_result = admission_result

# A reader outlives a Redis restart: it retries its read (from the last entry it saw)
# after this pause, until its timeout.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
RECONNECT_PAUSE_S = 0.2


@dataclass(frozen=True)
class SubmitSpec:
    """Arguments of one ``submit`` call, for ``submit_many``."""

    prompt: str | tuple[int, ...] | list[int]
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    priority: str = "interactive"
    deadline_s: float | None = None
    slo_ttft_ms: float | None = None
    best_effort: bool = False
    ignore_eos: bool = False     # vLLM's extension: generate past EOS, to max_tokens
    min_tokens: int = 0          # vLLM's extension: no EOS or stop sequence before this many tokens
    tenant: str = "default"
    request_id: str | None = None
    num_turns: int = 1
    true_output_tokens: int | None = None
    trace_predicted_output_tokens: int | None = None
    trace_output_text: str | None = None
    model: str | None = None     # a base model or LoRA adapter the fleet serves; None: any instance


def build_request(spec: SubmitSpec, settings: Settings) -> Request:
    """A validated request for ``spec`` (raises ValidationError naming the field)."""
    request_id = spec.request_id or uuid.uuid4().hex
    prompt = spec.prompt if isinstance(spec.prompt, str) else tuple(spec.prompt)
    request = Request(
        id=request_id, prompt=prompt, max_tokens=spec.max_tokens,
        reply_stream=settings.keys.reply(request_id), submitted_at_s=time.time(),
        temperature=spec.temperature, top_p=spec.top_p, stop=tuple(spec.stop),
        priority=spec.priority, deadline_s=spec.deadline_s, slo_ttft_ms=spec.slo_ttft_ms,
        best_effort=spec.best_effort, ignore_eos=spec.ignore_eos, min_tokens=spec.min_tokens, tenant=spec.tenant,
        num_turns=spec.num_turns, true_output_tokens=spec.true_output_tokens,
        trace_predicted_output_tokens=spec.trace_predicted_output_tokens,
        trace_output_text=spec.trace_output_text, model=spec.model,
    )
    # Round-trip through the validator so a client never enqueues what a stage would reject.
    return Request.from_map(request.to_map(), settings.limits)


def _queue_cancel(pipe: Any, settings: Settings, request_id: str) -> None:
    """Queue a cancel on ``pipe``: a flag (for workers that have not taken the request
    yet) and a notice on the cancel stream (for the one running it)."""
    keys = settings.keys
    pipe.set(keys.cancel_flag(request_id), 1, ex=settings.reply_ttl_s)
    pipe.xadd(keys.cancellations, {PAYLOAD_FIELD: request_id}, maxlen=10_000, approximate=True)


def _deadline(timeout_s: float | None) -> float:
    return float("inf") if timeout_s is None else time.monotonic() + timeout_s


def _block_ms(deadline: float) -> int:
    remaining_s = deadline - time.monotonic()
    if remaining_s <= 0:
        raise TimeoutError("no final record before the timeout")
    return max(1, int(min(remaining_s, 1.0) * 1000))


class Handle:
    """A submitted request. ``placement()`` says where it went and the forecast there;
    ``stream()`` yields its chunks; ``result()`` its final record. While it waits it checks
    that Redis has not lost the request, and submits it again if so
    (:class:`blockq.client_admission.SubmitWatch`)."""

    def __init__(self, client: Client, request: Request, link: CellLink | None = None) -> None:
        self.client = client
        self.request = request
        self.id = request.id
        self.link = link or client.router.first_link  # the cell it went to
        self._reader = ReplyReader()
        self._unyielded: list[Chunk] = []  # read by placement(), not yet yielded by stream()
        self._watch = SubmitWatch(self.link.settings.keys, request.id, interval_s=client.submit_check_interval_s)

    @property
    def cell(self) -> str:
        """The key prefix of the cell the request went to."""
        return self.link.name

    def _read(self, deadline: float) -> list[Chunk]:
        """One blocking read of the reply stream; the fresh chunks (a Redis outage: none,
        after a pause: redis-py reconnects on the next call)."""
        block_ms = _block_ms(deadline)
        try:
            if self._watch.is_due():
                self._check_admission()
            reply = self.link.redis.xread({self.request.reply_stream: self._reader.last_entry_id}, count=256,
                                          block=block_ms)
        except REDIS_DOWN:
            self._watch.after_reconnect()
            time.sleep(min(RECONNECT_PAUSE_S, block_ms / 1000))
            return []
        return self._reader.feed(reply[0][1]) if reply else []

    @property
    def num_resubmits(self) -> int:
        """Times Redis lost the request and this handle submitted it again."""
        return self._watch.num_resubmits

    def _check_admission(self) -> None:
        """Submit the request again when Redis lost its admission (same id, same payload)."""
        if not self._watch.is_lost(self.link.redis.exists(*self._watch.check_keys)):
            return
        try:
            self.client._admit_requests(self.link, [self.request])
        except RESUBMIT_REFUSED as exc:
            self._watch.record_refusal(exc)
            return
        self._watch.record_resubmit()
        self._reader.rewind()

    def placement(self, timeout_s: float | None = 300.0) -> Placement | None:
        """Block until the request is placed (raises TimeoutError after ``timeout_s``):
        the instance and the predicted TTFT / E2E. None when it was answered without
        being placed (``infeasible``, or an error before placement)."""
        deadline = _deadline(timeout_s)
        while self._reader.placement is None and self._reader.final is None:
            self._unyielded.extend(self._read(deadline))
        return self._reader.placement

    def stream(self, timeout_s: float | None = 300.0) -> Iterator[Chunk]:
        """Yield chunks in order, each output token's text exactly once (see
        :class:`ReplyReader`), until the final record arrives."""
        deadline = _deadline(timeout_s)
        while self._unyielded:
            yield self._unyielded.pop(0)
        while self._reader.final is None:
            yield from self._read(deadline)
        with contextlib.suppress(*REDIS_DOWN):
            self.link.redis.expire(self.request.reply_stream, self.link.settings.reply_read_ttl_s)

    def result(self, timeout_s: float | None = 300.0) -> FinalRecord:
        """Block until the final record (raises TimeoutError after ``timeout_s``)."""
        for _ in self.stream(timeout_s):
            pass
        assert self._reader.final is not None
        return self._reader.final

    def cancel(self) -> None:
        self.client._cancel_on([self.link], self.id)


class Client:
    """Synchronous client. ``redis_url`` defaults to ``BLOCKQ_REDIS_URL``.
    ``submit_check_interval_s``: how often a waiting handle checks that Redis still knows
    its request (:class:`blockq.client_admission.SubmitWatch`; default
    ``settings.submit_check_ms``). With ``settings.cells`` it is a front: each submission
    goes to one cell by the cells' published loads (:mod:`blockq.client_cells`); ``clock``
    (wall seconds) is what it compares their publication times with."""

    def __init__(self, redis_url: str | None = None, *, settings: Settings | None = None,
                 submit_check_interval_s: float | None = None, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings or Settings.from_env(redis_url=redis_url)
        self.submit_check_interval_s = (self.settings.submit_check_ms / 1000 if submit_check_interval_s is None
                                        else submit_check_interval_s)
        links = connect_links(cell_settings(self.settings, redis_url), connect)
        self.router = CellRouter(links, self.settings, clock)
        self.redis = links[0].redis  # the (first) cell's Redis
        self._admit = links[0].admit

    def submit(self, prompt: str | list[int] | tuple[int, ...], **options: Any) -> Handle:
        """Enqueue one request; raises Overloaded past the backlog limit."""
        return self.submit_many([SubmitSpec(prompt=prompt, **options)])[0]

    def submit_many(self, specs: Iterable[SubmitSpec]) -> list[Handle]:
        """Enqueue several requests in one round trip, all or none (all in one cell); raises
        Overloaded past the backlog limit (of every cell, tried in the router's order).
        Idempotent per request id (for ``reply_ttl_s``): a request whose id was accepted
        before is not enqueued again, and its handle reads the first submission's output."""
        specs = list(specs)
        if not specs:
            return []
        now_s = self.router.clock()
        if self.router.loads_due(now_s):
            self.router.read_loads()
        tried: list[str] = []
        while True:
            link = self.router.choose(now_s, tried)
            requests = [build_request(spec, link.settings) for spec in specs]
            try:
                self._admit_requests(link, requests)
            except (Overloaded, *REDIS_DOWN):
                tried.append(link.name)
                if len(tried) == self.router.num_cells:
                    raise
                continue
            self.router.record_sent(link, now_s, len(requests))
            return [Handle(self, r, link) for r in requests]

    def _admit_requests(self, link: CellLink, requests: list[Request]) -> list[str]:
        """Run the admission script (idempotent per id): the entry ids; raises Overloaded."""
        script_keys, args = admission_call(requests, link.settings)
        return admission_result(link.admit(keys=script_keys, args=args), link.settings)

    def cancel(self, request_id: str) -> None:
        """Ask the pipeline to stop a request; its final record says ``cancelled``
        (with cells: the notice goes to every cell)."""
        self._cancel_on(list(self.router.links.values()), request_id)

    def _cancel_on(self, links: list[CellLink], request_id: str) -> None:
        for link in links:
            pipe = link.redis.pipeline(transaction=False)
            _queue_cancel(pipe, link.settings, request_id)
            pipe.execute()

    def close(self) -> None:
        for redis_client in {id(link.redis): link.redis for link in self.router.links.values()}.values():
            redis_client.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncHandle:
    """The asyncio twin of :class:`Handle`."""

    def __init__(self, client: AsyncClient, request: Request, link: CellLink | None = None) -> None:
        self.client = client
        self.request = request
        self.id = request.id
        self.link = link or client.router.first_link  # the cell it went to
        self._reader = ReplyReader()
        self._unyielded: list[Chunk] = []
        self._watch = SubmitWatch(self.link.settings.keys, request.id, interval_s=client.submit_check_interval_s)

    @property
    def cell(self) -> str:
        return self.link.name

    async def _read(self, deadline: float) -> list[Chunk]:
        block_ms = _block_ms(deadline)
        try:
            if self._watch.is_due():
                await self._check_admission()
            reply = await self.link.redis.xread({self.request.reply_stream: self._reader.last_entry_id},
                                                count=256, block=block_ms)
        except REDIS_DOWN:
            self._watch.after_reconnect()
            await asyncio.sleep(min(RECONNECT_PAUSE_S, block_ms / 1000))
            return []
        return self._reader.feed(reply[0][1]) if reply else []

    @property
    def num_resubmits(self) -> int:
        return self._watch.num_resubmits

    async def _check_admission(self) -> None:
        if not self._watch.is_lost(await self.link.redis.exists(*self._watch.check_keys)):
            return
        try:
            await self.client._admit_requests(self.link, [self.request])
        except RESUBMIT_REFUSED as exc:
            self._watch.record_refusal(exc)
            return
        self._watch.record_resubmit()
        self._reader.rewind()

    async def placement(self, timeout_s: float | None = 300.0) -> Placement | None:
        deadline = _deadline(timeout_s)
        while self._reader.placement is None and self._reader.final is None:
            self._unyielded.extend(await self._read(deadline))
        return self._reader.placement

    async def stream(self, timeout_s: float | None = 300.0) -> AsyncIterator[Chunk]:
        deadline = _deadline(timeout_s)
        while self._unyielded:
            yield self._unyielded.pop(0)
        while self._reader.final is None:
            for chunk in await self._read(deadline):
                yield chunk
        with contextlib.suppress(*REDIS_DOWN):
            await self.link.redis.expire(self.request.reply_stream, self.link.settings.reply_read_ttl_s)

    async def result(self, timeout_s: float | None = 300.0) -> FinalRecord:
        async for _ in self.stream(timeout_s):
            pass
        assert self._reader.final is not None
        return self._reader.final

    async def cancel(self) -> None:
        await self.client._cancel_on([self.link], self.id)


class AsyncClient:
    """Asyncio client; every blocking call of :class:`Client` is a coroutine here."""

    def __init__(self, redis_url: str | None = None, *, settings: Settings | None = None,
                 max_connections: int = 512, submit_check_interval_s: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings or Settings.from_env(redis_url=redis_url)
        self.submit_check_interval_s = (self.settings.submit_check_ms / 1000 if submit_check_interval_s is None
                                        else submit_check_interval_s)
        # Each streaming handle holds a connection while it blocks on XREAD (at most 1 s):
        # past `max_connections` handles wait for a free connection instead of failing
        # (on Redis Cluster: fail, as its client cannot wait; the cap is per node there).
        links = connect_links(cell_settings(self.settings, redis_url), lambda url: connect_async(
            url, max_connections=max_connections, wait_for_connection=True))
        self.router = CellRouter(links, self.settings, clock)
        self.redis = links[0].redis  # the (first) cell's Redis
        self._admit = links[0].admit
        self._loads_read: asyncio.Future[None] | None = None

    async def submit(self, prompt: str | list[int] | tuple[int, ...], **options: Any) -> AsyncHandle:
        return (await self.submit_many([SubmitSpec(prompt=prompt, **options)]))[0]

    async def submit_many(self, specs: Iterable[SubmitSpec]) -> list[AsyncHandle]:
        """As :meth:`Client.submit_many`."""
        specs = list(specs)
        if not specs:
            return []
        now_s = self.router.clock()
        if self.router.loads_due(now_s):
            self._loads_read = asyncio.ensure_future(self.router.read_loads_async())
        if self._loads_read is not None and not self._loads_read.done():
            # Concurrent submissions wait for the read in flight rather than choose blind
            # (shielded: a cancelled submission does not cancel the others' read).
            await asyncio.shield(self._loads_read)
        tried: list[str] = []
        while True:
            link = self.router.choose(now_s, tried)
            requests = [build_request(spec, link.settings) for spec in specs]
            try:
                await self._admit_requests(link, requests)
            except (Overloaded, *REDIS_DOWN):
                tried.append(link.name)
                if len(tried) == self.router.num_cells:
                    raise
                continue
            self.router.record_sent(link, now_s, len(requests))
            return [AsyncHandle(self, r, link) for r in requests]

    async def _admit_requests(self, link: CellLink, requests: list[Request]) -> list[str]:
        script_keys, args = admission_call(requests, link.settings)
        return admission_result(await link.admit(keys=script_keys, args=args), link.settings)

    async def cancel(self, request_id: str) -> None:
        """As :meth:`Client.cancel`."""
        await self._cancel_on(list(self.router.links.values()), request_id)

    async def _cancel_on(self, links: list[CellLink], request_id: str) -> None:
        for link in links:
            pipe = link.redis.pipeline(transaction=False)
            _queue_cancel(pipe, link.settings, request_id)
            await pipe.execute()

    async def close(self) -> None:
        for redis_client in {id(link.redis): link.redis for link in self.router.links.values()}.values():
            await redis_client.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
