"""Following the fleet for the dispatcher: the beat stream, dated by Redis' clock, and the
registry of instances (``instances``: each instance's latest beat) at the start of a term.

**Dating.** Each read of the beat stream also reads Redis' clock (TIME on the node holding
the stream, in the same round trip), so a beat is dated by when it reached Redis (its
entry id) and neither the workers' clocks nor this host's enter its age. The same reading
gives the dispatcher its estimate of Redis' now (:meth:`BeatFollower.bus_now_s`), which
admission measures a request's wait against (:mod:`dispatcher.admission`).

**A new term** (or a read after Redis errors) does not replay the beat history: the
stream is capped by count (20,000 entries) whatever the fleet's size, and applying it all
(a replica rebuild per beat with ``block``) took longer than the lease, so a new leader
lost its term in its first step, every term. Instead it reads the registry, knows every
instance from its latest beat (:meth:`ClusterView.seed`: suspect until heard, dead
``dead_after_s`` into the term if never heard, its queue then moved), and reads the beats
of the last :data:`CATCH_UP_MS` on: instances heard then are live at once.

**Bounded reads.** A call reads at most :data:`READ_COUNT` beats (one round trip), so that
the leader places requests between reads however fast the fleet beats: read until caught
up, a dispatcher of 1,024 instances beating at 10 Hz never got past the beats to place
anything (docs/results/placements-redis.md). A leader behind on beats reads one batch a
step until it has caught up.

**Bad beats.** A beat that does not decode, or whose application raises anything
(:meth:`DispatcherCore.apply_heartbeat` is the per-beat boundary), is counted by reason,
logged with its entry and instance id, and skipped.
"""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis
import structlog

from blockq.wire.beats import HeartbeatDecoder, decode_heartbeat
from blockq.wire.keys import PAYLOAD_FIELD, Keys
from blockq.wire.streams import queue_redis_time, redis_time_ms
from dispatcher.core import BEAT_FAILED, BEAT_UNDECODABLE, BeatRejection, DispatcherCore
from dispatcher.lease import REDIS_UNAVAILABLE

log = structlog.get_logger(__name__)

READ_COUNT = 1000
# At the start of a term, the beats of this last stretch are read from the stream (older
# ones only through the registry): over suspect_after_s, so that instances beating now are
# live at once, and short enough to be applied well inside the lease.
CATCH_UP_MS = 1000


class BeatFollower:
    """Reads beats into ``core`` (see the module docstring); ``clock``: the dispatcher's."""

    def __init__(self, keys: Keys, core: DispatcherCore, clock: Callable[[], float]) -> None:
        self.keys = keys
        self.core = core
        self.clock = clock
        self.last_beat_id = "0-0"
        self.needs_registry = False  # the next read seeds the view from the registry first
        self.unheard = False         # beats may have gone unread: the next read starts a grace
        self.read_at_s = float("-inf")
        self.bus_offset_s: float | None = None  # Redis' clock minus the dispatcher's, at the last read
        self.decoder = HeartbeatDecoder()

    def restart(self) -> None:
        """The view was forgotten (a new term, Redis errors): seed it again from the
        registry, and read only the latest beats (see the module docstring)."""
        self.needs_registry = True
        self.unheard = True

    def bus_now_s(self, now_s: float) -> float | None:
        """Redis' now at the dispatcher's ``now_s``, as the latest read measured it (None
        before the first)."""
        return None if self.bus_offset_s is None else now_s + self.bus_offset_s

    async def follow(self, client: aioredis.Redis) -> bool:
        """Apply the beats published since the last call, at most :data:`READ_COUNT` of
        them (non-blocking); True when that caught up with the stream. A read that
        succeeds after beats may have gone unheard starts a grace (:meth:`DispatcherCore.hear_again`):
        after a failed read, at the start of a term, or when more than half of
        ``dead_after_s`` passed since the previous read (Redis stalled, e.g. clients paused
        for a failover, or this process was)."""
        try:
            if self.needs_registry:
                await self._read_registry(client)
            pipe = client.pipeline(transaction=False)
            queue_redis_time(pipe, self.keys.heartbeats)  # the clock that stamped the beats
            pipe.xread({self.keys.heartbeats: self.last_beat_id}, count=READ_COUNT)
            redis_time, reply = await pipe.execute()
        except REDIS_UNAVAILABLE:
            self.unheard = True
            raise
        now_s, redis_now_ms = self.clock(), redis_time_ms(redis_time)
        self.bus_offset_s = redis_now_ms / 1000 - now_s
        if self.unheard or now_s - self.read_at_s > self.core.view.health_policy.dead_after_s / 2:
            self.unheard = False
            self.core.hear_again(now_s)
        self.read_at_s = now_s
        entries = reply[0][1] if reply else []
        payload_field = PAYLOAD_FIELD.encode()
        for entry_id, fields in entries:
            self._apply_entry(entry_id.decode(), fields.get(payload_field), now_s, redis_now_ms)
        caught_up = len(entries) < READ_COUNT
        # Behind the stream, no instance was heard after the last beat read: silence is
        # counted up to there, so that a leader behind on beats still places (on older ones).
        self.core.read_beats_until(None if caught_up else now_s - self._age_s(self.last_beat_id, redis_now_ms))
        return caught_up

    async def _read_registry(self, client: aioredis.Redis) -> None:
        """Seed the view with every instance of the registry, and start the stream at the
        last :data:`CATCH_UP_MS` by Redis' clock."""
        pipe = client.pipeline(transaction=False)
        queue_redis_time(pipe, self.keys.heartbeats)
        pipe.hgetall(self.keys.instances)
        redis_time, registry = await pipe.execute()
        for key, payload in sorted(registry.items()):
            instance_id = key.decode(errors="replace")
            try:
                self.core.seed_instance(decode_heartbeat(payload))
            except Exception as exc:  # whatever the decoder raises: that entry is skipped
                self._log_rejected(self.core.reject_beat(BEAT_UNDECODABLE, exc), instance_id, entry_id=None)
        self.last_beat_id = f"{max(0, redis_time_ms(redis_time) - CATCH_UP_MS)}-0"
        self.needs_registry = False
        log.info("dispatcher_fleet_seeded", num_instances=len(registry))

    def _apply_entry(self, entry_id: str, payload: bytes | None, now_s: float, redis_now_ms: int) -> None:
        self.last_beat_id = entry_id
        age_s = self._age_s(entry_id, redis_now_ms)
        try:
            if payload is None:
                raise KeyError(f"entry has no '{PAYLOAD_FIELD}' field")
            beat = self.decoder.decode(payload)
        except Exception as exc:  # ValidationError names the field; anything else is a decoder fault
            self._log_rejected(self.core.reject_beat(BEAT_UNDECODABLE, exc), None, entry_id)
            return
        rejection = self.core.apply_heartbeat(beat, now_s, heard_at_s=now_s - age_s)
        if rejection is not None:
            self._log_rejected(rejection, beat.instance_id, entry_id)

    @staticmethod
    def _age_s(entry_id: str, redis_now_ms: int) -> float:
        """How long before ``redis_now_ms`` the beat stream's entry ``entry_id`` reached Redis."""
        return max(0, redis_now_ms - int(entry_id.split("-", 1)[0])) / 1000

    def _log_rejected(self, rejection: BeatRejection, instance_id: str | None, entry_id: str | None) -> None:
        # An unexpected failure keeps its traceback: it is a bug, or a value nothing checks yet.
        exc_info = rejection.error if rejection.reason == BEAT_FAILED else None
        log.warning("heartbeat_rejected", instance_id=instance_id, entry_id=entry_id, reason=rejection.reason,
                    error=rejection.detail[:1000], num_rejected=self.core.stats.num_beats_rejected,
                    exc_info=exc_info)
