"""Re-placement: the queue of an instance that left (dead, or ``stopped``) or drains is
placed again on live instances, a chunk per dispatcher step.

Why chunks: a dead instance may hold tens of thousands of entries, and deciding them all
in one step outlived the leader's lease (3 s; it is renewed between steps): past about
4,000 entries with ``block`` the fenced write was refused, the term ended, and the next
one started over, for ever. A step moves at most ``chunk_entries`` entries, decided within
a time budget (a sixth of the lease by default), in one fenced transaction (:meth:`dispatcher.lease.Lease.write_fenced`) that queues each request on its
new instance, moves its owner and ACKs and deletes it in the old queue. Between chunks
the leader renews its lease, follows beats and places new requests, so the view the
chunks are decided on stays current. A chunk is written whole or not at all, and what was
written is gone from the old queue: a term that ends between chunks leaves the rest to
the next leader, and no entry is placed twice (docs/delivery.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog

from blockq.config import Settings
from blockq.wire.health import InstanceState
from blockq.wire.keys import GROUP_WORK, PAYLOAD_FIELD, Keys
from blockq.wire.output import set_owner
from blockq.wire.protocol import Placement, Request, ValidationError, decode_request, encode
from dispatcher.core import DispatcherCore, Held, Outcome, Placed
from dispatcher.lease import Lease, Pipeline
from dispatcher.queue_reads import Entries, read_chunk

log = structlog.get_logger(__name__)

# What a step re-places at most: entries read, and seconds spent deciding (a share of the
# lease, from DispatcherOptions, bounds it on a slow host or with deep queues, where
# `block` decisions cost more); decisions are made this many at a time, so at least this
# many move per step.
DEFAULT_CHUNK_ENTRIES = 1024
DECISION_BATCH = 64
_MOVED_AWAY = (InstanceState.DEAD, InstanceState.STOPPED, InstanceState.DRAINING)


def queue_placement(pipe: Pipeline, keys: Keys, request: Request, reply_ttl_s: int) -> None:
    """Hand ``request``'s output to its instance and queue it there, on ``pipe``: what
    placing a request writes, first time or again."""
    instance_id = request.assignment.instance_id  # type: ignore[union-attr]
    set_owner(pipe, keys, request.id, instance_id, reply_ttl_s)
    pipe.xadd(keys.instance_queue(instance_id), {PAYLOAD_FIELD: encode(request)})
    # The client learns where its request went, and the forecast, before its first token.
    pipe.xadd(request.reply_stream, {PAYLOAD_FIELD: encode(Placement.of(request))})
    pipe.expire(request.reply_stream, reply_ttl_s)


@dataclass
class _Progress:
    """How far one instance's queue has been re-placed."""

    unread_only: bool
    after_id: str | None = None  # the last entry read (those left behind are skipped)
    num_moved: int = 0
    num_returned: int = 0


class QueueReplacer:
    """The queues to re-place, and the chunk of them each step moves (see the module
    docstring): at most ``chunk_entries`` entries, decided within ``time_budget_s``
    (``timer``'s seconds). ``record`` is told every outcome (the decision metrics)."""

    def __init__(self, client: aioredis.Redis, settings: Settings, core: DispatcherCore, lease: Lease, *,
                 record: Callable[[list[Outcome]], None], time_budget_s: float,
                 chunk_entries: int = DEFAULT_CHUNK_ENTRIES, timer: Callable[[], float] = time.monotonic) -> None:
        if chunk_entries < 1 or time_budget_s <= 0:
            raise ValueError(f"chunk_entries, time_budget_s: must be > 0 (got {chunk_entries}, {time_budget_s})")
        self.client = client
        self.settings = settings
        self.core = core
        self.lease = lease
        self.record = record
        self.chunk_entries = chunk_entries
        self.time_budget_s = time_budget_s
        self.timer = timer
        self.pending: dict[str, _Progress] = {}

    def add(self, instance_ids: list[str]) -> None:
        """Re-place these instances' queues (again from the start: an instance reported
        again changed state, e.g. from draining to dead, and now moves whole)."""
        for instance_id in instance_ids:
            self.pending[instance_id] = _Progress(unread_only=self._health(instance_id) == InstanceState.DRAINING)

    def clear(self) -> None:
        self.pending.clear()

    async def step(self, now_s: float, bus_now_s: float | None) -> int:
        """Move one chunk, from the pending queues in id order; returns how many entries
        were taken (moved, returned to ``ready`` or left behind). An instance that came
        back (live again) is left alone; while no instance is live nothing moves (retried
        next step). Raises :class:`~dispatcher.lease.LeaseLost` when the term is over (that
        chunk unwritten)."""
        deadline_s = self.timer() + self.time_budget_s
        budget = self.chunk_entries
        for instance_id in sorted(self.pending):
            if budget <= 0 or self.timer() >= deadline_s or not self.core.live_instances():
                break
            health = self._health(instance_id)
            if health not in _MOVED_AWAY:
                del self.pending[instance_id]
                continue
            progress = self.pending[instance_id]
            if progress.unread_only != (health == InstanceState.DRAINING):
                progress = self.pending[instance_id] = _Progress(unread_only=health == InstanceState.DRAINING)
            num_taken, exhausted = await self._move_chunk(instance_id, progress, budget, deadline_s, now_s,
                                                          bus_now_s)
            budget -= num_taken
            if exhausted:
                del self.pending[instance_id]
                if progress.num_moved or progress.num_returned:
                    log.warning("instance_queue_replaced", instance=instance_id, unread_only=progress.unread_only,
                                moved=progress.num_moved, returned_to_ready=progress.num_returned)
        return self.chunk_entries - budget

    def _health(self, instance_id: str) -> str | None:
        view = self.core.view.instances.get(instance_id)
        return view.health if view is not None else None

    async def _move_chunk(self, instance_id: str, progress: _Progress, count: int, deadline_s: float, now_s: float,
                          bus_now_s: float | None) -> tuple[int, bool]:
        """Read up to ``count`` entries of ``instance_id``'s queue, decide them
        :data:`DECISION_BATCH` at a time until ``deadline_s`` (one batch at least), write
        what was decided in one fenced transaction. Returns how many entries were taken
        and whether the queue has no more."""
        queue = self.settings.keys.instance_queue(instance_id)
        entries = await read_chunk(self.client, queue, count, after_id=progress.after_id,
                                   unread_only=progress.unread_only)
        moved: list[tuple[bytes, Request]] = []
        returned: list[tuple[bytes, Request]] = []
        num_taken = 0
        while num_taken < len(entries) and (num_taken == 0 or self.timer() < deadline_s):
            batch = entries[num_taken:num_taken + DECISION_BATCH]
            self._decide(instance_id, batch, now_s, bus_now_s, moved, returned)
            num_taken += len(batch)
        if num_taken:
            progress.after_id = entries[num_taken - 1][0].decode()
        if moved or returned:
            await self.lease.write_fenced(lambda pipe: self._queue_moves(pipe, queue, moved, returned))
        progress.num_moved += len(moved)
        progress.num_returned += len(returned)
        return num_taken, num_taken == len(entries) and len(entries) < count

    def _decide(self, instance_id: str, entries: Entries, now_s: float, bus_now_s: float | None,
                moved: list[tuple[bytes, Request]], returned: list[tuple[bytes, Request]]) -> None:
        """Place ``entries`` again (appended to ``moved``); held requests (batch work, no
        idle capacity) go back to ``ready`` (appended to ``returned``); rejected and
        undecodable entries stay (a worker that comes back dead-letters them)."""
        decoded: list[tuple[bytes, Request]] = []
        for entry_id, fields in entries:
            payload = fields.get(PAYLOAD_FIELD.encode())
            try:
                if payload is not None:
                    decoded.append((entry_id, decode_request(payload, self.settings.limits, keys=self.settings.keys)))
            except ValidationError:
                continue
        outcomes = self.core.replace_unstarted(instance_id, [r for _, r in decoded], now_s, bus_now_s=bus_now_s)
        self.record(outcomes)
        for (entry_id, _), outcome in zip(decoded, outcomes, strict=True):
            if isinstance(outcome, Placed):
                moved.append((entry_id, outcome.request))
            elif isinstance(outcome, Held):
                returned.append((entry_id, outcome.request))

    def _queue_moves(self, pipe: Pipeline, queue: str, moved: list[tuple[bytes, Request]],
                     returned: list[tuple[bytes, Request]]) -> None:
        """The moved entries are also ACKed in the old queue's ``work`` group, so that a
        worker that comes back under that id does not resume them."""
        keys = self.settings.keys
        for _, request in moved:
            queue_placement(pipe, keys, request, self.settings.reply_ttl_s)
        for _, request in returned:
            pipe.xadd(keys.ready, {PAYLOAD_FIELD: encode(request)})
        entry_ids = [entry_id for entry_id, _ in [*moved, *returned]]
        pipe.xack(queue, GROUP_WORK, *entry_ids)
        pipe.xdel(queue, *entry_ids)
