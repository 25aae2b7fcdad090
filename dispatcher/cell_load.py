"""The load a dispatcher leader publishes for its cell (:class:`blockq.cells.CellLoad`).

:func:`cell_load_of` reads it off the placement core (no I/O, time passed in): the
simulation calls it for its simulated cells, and :class:`CellLoadPublisher` for the live
leader, which writes it to the cell's ``cell:load`` hash every ``cell_load_interval_ms``.
Fronts route between cells by it (docs/architecture.md#cells).
"""

from __future__ import annotations

import redis.asyncio as aioredis

from blockq.cells import CellLoad
from blockq.wire.keys import Keys
from dispatcher.core import DispatcherCore


def cell_load_of(core: DispatcherCore, num_unplaced: int, now_s: float, dispatcher_id: str = "") -> CellLoad:
    """The cell's load at ``now_s`` as ``core`` knows it: its live instances, the
    requests on them (running and waiting in their latest beats, plus those placed since)
    and their mean KV usage; ``num_unplaced``: the requests the caller holds unplaced."""
    live = core.live_instances()
    num_outstanding = sum(view.num_outstanding for view in live)
    kv_usage = 0.0
    if live:
        kv_usage = sum(view.heartbeat.num_used_blocks / max(1, int(view.heartbeat.engine_config.get("num_gpu_blocks", 1)))
                       for view in live) / len(live)
    return CellLoad(published_at_s=now_s, num_live_instances=len(live), num_outstanding=num_outstanding,
                    num_unplaced=num_unplaced, kv_usage=min(1.0, kv_usage), dispatcher_id=dispatcher_id)


class CellLoadPublisher:
    """Writes the cell's load to ``keys.cell_load`` at most every ``interval_s`` (a
    leader's step calls :meth:`step`; 0 never writes). One HSET; the hash has no expiry:
    a front judges a load by its ``published_at_s`` (an old one is stale, not absent)."""

    def __init__(self, client: aioredis.Redis, keys: Keys, core: DispatcherCore, *, interval_s: float,
                 dispatcher_id: str) -> None:
        self.client = client
        self.key = keys.cell_load
        self.core = core
        self.interval_s = interval_s
        self.dispatcher_id = dispatcher_id
        self._next_at_s = float("-inf")
        self.num_published = 0

    async def step(self, now_s: float, num_unplaced: int) -> CellLoad | None:
        """Publish when due; the load published, or None."""
        if self.interval_s <= 0 or now_s < self._next_at_s:
            return None
        self._next_at_s = now_s + self.interval_s
        load = cell_load_of(self.core, num_unplaced, now_s, self.dispatcher_id)
        await self.client.hset(self.key, mapping=load.to_fields())  # type: ignore[misc]
        self.num_published += 1
        return load

    def restart(self) -> None:
        """A new term publishes at once."""
        self._next_at_s = float("-inf")
