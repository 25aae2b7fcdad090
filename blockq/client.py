"""The client library: submit requests, stream their output, read their final record.

``Client`` is synchronous, ``AsyncClient`` the asyncio twin; both share the request
building, the admission script and the de-duplicating reply reader, and differ only in
how they talk to Redis.

Delivery is at-least-once inside the pipeline, so a reply stream may hold a chunk twice
(a worker that died mid-request and was replaced re-sends from index 0). Readers keep the
next expected chunk index and drop anything below it: each chunk is yielded exactly once,
in order.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from blockq.config import ConfigError, Settings
from blockq.keys import PAYLOAD_FIELD
from blockq.protocol import Chunk, FinalRecord, Request, decode_reply_entry, encode

# Adds every payload in ARGV[2..] to the ingress stream unless that would take its
# length past ARGV[1]; returns the new entry ids, or {-1, current length} when refused.
# One script so that concurrent clients cannot all pass the check and then all add.
_ADMIT_SCRIPT = """
local backlog = redis.call('XLEN', KEYS[1])
if backlog + #ARGV - 1 > tonumber(ARGV[1]) then
  return {-1, backlog}
end
local ids = {}
for i = 2, #ARGV do
  ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'm', ARGV[i])
end
return ids
"""


class Overloaded(Exception):
    """The ingress backlog is past its limit; retry after ``retry_after_s``."""

    def __init__(self, backlog: int, limit: int, retry_after_s: float = 1.0) -> None:
        super().__init__(f"overloaded: ingress backlog {backlog} entries, limit {limit}; retry later")
        self.backlog = backlog
        self.limit = limit
        self.retry_after_s = retry_after_s


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
    tenant: str = "default"
    request_id: str | None = None
    num_turns: int = 1
    true_output_tokens: int | None = None
    trace_predicted_output_tokens: int | None = None


def build_request(spec: SubmitSpec, settings: Settings) -> Request:
    """A validated request for ``spec`` (raises ValidationError naming the field)."""
    request_id = spec.request_id or uuid.uuid4().hex
    prompt = spec.prompt if isinstance(spec.prompt, str) else tuple(spec.prompt)
    request = Request(
        id=request_id, prompt=prompt, max_tokens=spec.max_tokens,
        reply_stream=settings.keys.reply(request_id), submitted_at_s=time.time(),
        temperature=spec.temperature, top_p=spec.top_p, stop=tuple(spec.stop),
        priority=spec.priority, deadline_s=spec.deadline_s, tenant=spec.tenant,
        num_turns=spec.num_turns, true_output_tokens=spec.true_output_tokens,
        trace_predicted_output_tokens=spec.trace_predicted_output_tokens,
    )
    # Round-trip through the validator so a client never enqueues what a stage would reject.
    return Request.from_map(request.to_map(), settings.limits)


def _admission_result(reply: list[Any], settings: Settings) -> list[str]:
    if reply and reply[0] == -1:
        raise Overloaded(int(reply[1]), settings.max_ingress_backlog)
    return [r.decode() if isinstance(r, bytes) else r for r in reply]


class ReplyReader:
    """Turns reply-stream entries into in-order, de-duplicated chunks and a final record."""

    def __init__(self) -> None:
        self.last_entry_id = "0-0"
        self.next_index = 0
        self.final: FinalRecord | None = None

    def feed(self, entries: Iterable[tuple[Any, Mapping[bytes, bytes]]]) -> list[Chunk]:
        fresh: list[Chunk] = []
        for entry_id, fields in entries:
            self.last_entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            if self.final is not None:
                continue
            message = decode_reply_entry(fields[PAYLOAD_FIELD.encode()])
            if isinstance(message, FinalRecord):
                self.final = message
            elif message.index == self.next_index:
                fresh.append(message)
                self.next_index += 1
            # index < next_index: a re-sent duplicate; index > next_index cannot happen
            # (one writer at a time, in order) and would be dropped with its duplicates.
        return fresh


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
    """A submitted request. ``stream()`` yields its chunks; ``result()`` its final record."""

    def __init__(self, client: Client, request: Request) -> None:
        self.client = client
        self.request = request
        self.id = request.id
        self._reader = ReplyReader()

    def stream(self, timeout_s: float | None = 300.0) -> Iterator[Chunk]:
        """Yield chunks in order, each exactly once, until the final record arrives."""
        deadline = _deadline(timeout_s)
        stream_key = self.request.reply_stream
        while self._reader.final is None:
            reply = self.client.redis.xread({stream_key: self._reader.last_entry_id}, count=256,
                                            block=_block_ms(deadline))
            if reply:
                yield from self._reader.feed(reply[0][1])
        self.client.redis.expire(stream_key, self.client.settings.reply_read_ttl_s)

    def result(self, timeout_s: float | None = 300.0) -> FinalRecord:
        """Block until the final record (raises TimeoutError after ``timeout_s``)."""
        for _ in self.stream(timeout_s):
            pass
        assert self._reader.final is not None
        return self._reader.final

    def cancel(self) -> None:
        self.client.cancel(self.id)


class Client:
    """Synchronous client. ``redis_url`` defaults to ``BLOCKQ_REDIS_URL``."""

    def __init__(self, redis_url: str | None = None, *, settings: Settings | None = None) -> None:
        self.settings = settings or Settings.from_env(redis_url=redis_url)
        url = redis_url or self.settings.redis_url
        if not url:
            raise ConfigError("redis_url: not set (pass redis_url= or set BLOCKQ_REDIS_URL)")
        self.redis = redis.Redis.from_url(url)
        self._admit = self.redis.register_script(_ADMIT_SCRIPT)

    def submit(self, prompt: str | list[int] | tuple[int, ...], **options: Any) -> Handle:
        """Enqueue one request; raises Overloaded past the backlog limit."""
        return self.submit_many([SubmitSpec(prompt=prompt, **options)])[0]

    def submit_many(self, specs: Iterable[SubmitSpec]) -> list[Handle]:
        """Enqueue several requests in one round trip, all or none."""
        requests = [build_request(spec, self.settings) for spec in specs]
        if not requests:
            return []
        reply = self._admit(keys=[self.settings.keys.requests],
                            args=[self.settings.max_ingress_backlog, *(encode(r) for r in requests)])
        _admission_result(reply, self.settings)
        return [Handle(self, r) for r in requests]

    def cancel(self, request_id: str) -> None:
        """Ask the pipeline to stop a request; its final record says ``cancelled``."""
        pipe = self.redis.pipeline(transaction=False)
        _queue_cancel(pipe, self.settings, request_id)
        pipe.execute()

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncHandle:
    """The asyncio twin of :class:`Handle`."""

    def __init__(self, client: AsyncClient, request: Request) -> None:
        self.client = client
        self.request = request
        self.id = request.id
        self._reader = ReplyReader()

    async def stream(self, timeout_s: float | None = 300.0) -> AsyncIterator[Chunk]:
        deadline = _deadline(timeout_s)
        stream_key = self.request.reply_stream
        while self._reader.final is None:
            reply = await self.client.redis.xread({stream_key: self._reader.last_entry_id}, count=256,
                                                  block=_block_ms(deadline))
            if reply:
                for chunk in self._reader.feed(reply[0][1]):
                    yield chunk
        await self.client.redis.expire(stream_key, self.client.settings.reply_read_ttl_s)

    async def result(self, timeout_s: float | None = 300.0) -> FinalRecord:
        async for _ in self.stream(timeout_s):
            pass
        assert self._reader.final is not None
        return self._reader.final

    async def cancel(self) -> None:
        await self.client.cancel(self.id)


class AsyncClient:
    """Asyncio client; every blocking call of :class:`Client` is a coroutine here."""

    def __init__(self, redis_url: str | None = None, *, settings: Settings | None = None,
                 max_connections: int = 512) -> None:
        self.settings = settings or Settings.from_env(redis_url=redis_url)
        url = redis_url or self.settings.redis_url
        if not url:
            raise ConfigError("redis_url: not set (pass redis_url= or set BLOCKQ_REDIS_URL)")
        # Each streaming handle holds a connection while it blocks on XREAD (at most 1 s):
        # past `max_connections` handles wait for a free connection instead of failing.
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=None)
        self.redis = aioredis.Redis(connection_pool=pool)
        self._admit = self.redis.register_script(_ADMIT_SCRIPT)

    async def submit(self, prompt: str | list[int] | tuple[int, ...], **options: Any) -> AsyncHandle:
        return (await self.submit_many([SubmitSpec(prompt=prompt, **options)]))[0]

    async def submit_many(self, specs: Iterable[SubmitSpec]) -> list[AsyncHandle]:
        requests = [build_request(spec, self.settings) for spec in specs]
        if not requests:
            return []
        reply = await self._admit(keys=[self.settings.keys.requests],
                                  args=[self.settings.max_ingress_backlog, *(encode(r) for r in requests)])
        _admission_result(reply, self.settings)
        return [AsyncHandle(self, r) for r in requests]

    async def cancel(self, request_id: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        _queue_cancel(pipe, self.settings, request_id)
        await pipe.execute()

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
