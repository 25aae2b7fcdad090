"""The client library: submit requests, stream their output, read their final record.

``Client`` is synchronous, ``AsyncClient`` the asyncio twin; both share the request
building, the admission script and the de-duplicating reply reader, and differ only in
how they talk to Redis.

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
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import redis

from blockq.config import ConfigError, Settings
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.protocol import Chunk, FinalRecord, Placement, Request, decode_reply_entry, encode
from blockq.wire.streams import connect, connect_async

# A reader outlives a Redis restart: it retries its read (from the last entry it saw)
# after this pause, until its timeout.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
RECONNECT_PAUSE_S = 0.2

# Admits a batch of requests, all or none.
# KEYS: ingress stream, ready stream, instances hash, then one `submitted:{id}` key per request.
# ARGV: backlog limit, submitted-key TTL s, instance queue key head and tail (the queue of
# instance X is head..X..tail), then one payload per request.
# The backlog is every request accepted and not finished: entries are deleted on ACK, and
# a stage ACKs only once its next hop is written (the dispatcher keeps the requests it
# holds pending in `ready`), so the lengths of `req`, `ready` and every instance queue add
# up to it. A request whose id was accepted before (a client retrying, or redis-py
# re-sending the script after a lost reply) is not added again: its original entry id is
# returned, and it does not count against the limit.
# Returns the entry ids, or {-1, backlog} when the new requests would pass the limit.
# One script so that concurrent clients cannot all pass the check and then all add.
# It reads keys it is not passed (the instance queues, named by the instances hash):
# Redis Cluster allows that only within the script's slot, which the key prefix's hash
# tag puts every blockq key in (blockq.wire.keys).
_ADMIT_SCRIPT = """
local num_requests = #KEYS - 3
local ids = {}
local num_new = 0
local counted = {}
for i = 1, num_requests do
  local existing = redis.call('GET', KEYS[3 + i])
  if existing then
    ids[i] = existing
  elseif not counted[KEYS[3 + i]] then
    counted[KEYS[3 + i]] = true
    num_new = num_new + 1
  end
end
if num_new > 0 then
  local backlog = redis.call('XLEN', KEYS[1]) + redis.call('XLEN', KEYS[2])
  for _, instance_id in ipairs(redis.call('HKEYS', KEYS[3])) do
    backlog = backlog + redis.call('XLEN', ARGV[3] .. instance_id .. ARGV[4])
  end
  if backlog + num_new > tonumber(ARGV[1]) then
    return {-1, backlog}
  end
end
for i = 1, num_requests do
  if not ids[i] then
    -- a second request with the same id in this batch finds the first one's key
    local existing = redis.call('GET', KEYS[3 + i])
    if existing then
      ids[i] = existing
    else
      ids[i] = redis.call('XADD', KEYS[1], '*', 'm', ARGV[4 + i])
      redis.call('SET', KEYS[3 + i], ids[i], 'EX', tonumber(ARGV[2]))
    end
  end
end
return ids
"""


class Overloaded(Exception):
    """The backlog (requests accepted and not finished: waiting in ``req``, ``ready`` or
    an instance queue, or running) is past its limit; nothing of the refused call was
    enqueued. Retry after ``retry_after_s``."""

    def __init__(self, backlog: int, limit: int, retry_after_s: float = 1.0) -> None:
        super().__init__(f"overloaded: backlog {backlog} requests, limit {limit}; retry later")
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
        trace_output_text=spec.trace_output_text,
    )
    # Round-trip through the validator so a client never enqueues what a stage would reject.
    return Request.from_map(request.to_map(), settings.limits)


def _admission_call(requests: list[Request], settings: Settings) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of the admission script for ``requests``."""
    keys = settings.keys
    # The script builds instance queue names itself (from the instances hash): hand it the
    # parts of the name around the instance id, so that key names stay in blockq.wire.keys.
    marker = "\x00"
    queue_head, queue_tail = keys.instance_queue(marker).split(marker)
    script_keys = [keys.requests, keys.ready, keys.instances, *(keys.submitted(r.id) for r in requests)]
    args = [settings.max_ingress_backlog, settings.reply_ttl_s, queue_head, queue_tail,
            *(encode(r) for r in requests)]
    return script_keys, args


def _admission_result(reply: list[Any], settings: Settings) -> list[str]:
    """The entry ids of an admission (a request accepted before: its original entry id);
    raises :class:`Overloaded` when it was refused."""
    if reply and reply[0] == -1:
        raise Overloaded(int(reply[1]), settings.max_ingress_backlog)
    return [r.decode() if isinstance(r, bytes) else r for r in reply]


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
    ``stream()`` yields its chunks; ``result()`` its final record."""

    def __init__(self, client: Client, request: Request) -> None:
        self.client = client
        self.request = request
        self.id = request.id
        self._reader = ReplyReader()
        self._unyielded: list[Chunk] = []  # read by placement(), not yet yielded by stream()

    def _read(self, deadline: float) -> list[Chunk]:
        """One blocking read of the reply stream; the fresh chunks (a Redis outage: none,
        after a pause: redis-py reconnects on the next call)."""
        block_ms = _block_ms(deadline)
        try:
            reply = self.client.redis.xread({self.request.reply_stream: self._reader.last_entry_id}, count=256,
                                            block=block_ms)
        except REDIS_DOWN:
            time.sleep(min(RECONNECT_PAUSE_S, block_ms / 1000))
            return []
        return self._reader.feed(reply[0][1]) if reply else []

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
            self.client.redis.expire(self.request.reply_stream, self.client.settings.reply_read_ttl_s)

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
        self.redis = connect(url)
        self._admit = self.redis.register_script(_ADMIT_SCRIPT)

    def submit(self, prompt: str | list[int] | tuple[int, ...], **options: Any) -> Handle:
        """Enqueue one request; raises Overloaded past the backlog limit."""
        return self.submit_many([SubmitSpec(prompt=prompt, **options)])[0]

    def submit_many(self, specs: Iterable[SubmitSpec]) -> list[Handle]:
        """Enqueue several requests in one round trip, all or none; raises Overloaded past
        the backlog limit. Idempotent per request id (for ``reply_ttl_s``): a request whose
        id was accepted before is not enqueued again, and its handle reads the first
        submission's output."""
        requests = [build_request(spec, self.settings) for spec in specs]
        if not requests:
            return []
        script_keys, args = _admission_call(requests, self.settings)
        _admission_result(self._admit(keys=script_keys, args=args), self.settings)
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
        self._unyielded: list[Chunk] = []

    async def _read(self, deadline: float) -> list[Chunk]:
        block_ms = _block_ms(deadline)
        try:
            reply = await self.client.redis.xread({self.request.reply_stream: self._reader.last_entry_id},
                                                  count=256, block=block_ms)
        except REDIS_DOWN:
            await asyncio.sleep(min(RECONNECT_PAUSE_S, block_ms / 1000))
            return []
        return self._reader.feed(reply[0][1]) if reply else []

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
            await self.client.redis.expire(self.request.reply_stream, self.client.settings.reply_read_ttl_s)

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
        # past `max_connections` handles wait for a free connection instead of failing
        # (on Redis Cluster: fail, as its client cannot wait; the cap is per node there).
        self.redis = connect_async(url, max_connections=max_connections, wait_for_connection=True)
        self._admit = self.redis.register_script(_ADMIT_SCRIPT)

    async def submit(self, prompt: str | list[int] | tuple[int, ...], **options: Any) -> AsyncHandle:
        return (await self.submit_many([SubmitSpec(prompt=prompt, **options)]))[0]

    async def submit_many(self, specs: Iterable[SubmitSpec]) -> list[AsyncHandle]:
        """As :meth:`Client.submit_many`."""
        requests = [build_request(spec, self.settings) for spec in specs]
        if not requests:
            return []
        script_keys, args = _admission_call(requests, self.settings)
        _admission_result(await self._admit(keys=script_keys, args=args), self.settings)
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
