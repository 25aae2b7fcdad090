"""Which cell a client's request goes to: the client library's thin shell around
:class:`blockq.cells.CellFront`.

A client configured with cells (``Settings.cells``, ``BLOCKQ_CELLS``) holds one
:class:`CellLink` per cell (its settings under its own key prefix, its Redis connection,
its admission script) and a :class:`CellRouter`; without cells it holds one link, the
cluster under ``key_prefix``, and the router always answers it (today's single-cell path).
The router re-reads the cells' published loads (one ``HGETALL`` per cell) when they are
older than ``cell_load_interval_ms``; a load that cannot be read or decoded counts as none,
so that cell turns stale and is avoided while another cell is fresh.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import structlog

from blockq.cells import CellFront, CellLoad
from blockq.client_admission import ADMIT_SCRIPT
from blockq.config import ConfigError, Settings

log = structlog.get_logger(__name__)

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
# The router reads loads at most this often, however often cells publish (seconds).
MIN_LOAD_READ_INTERVAL_S = 0.05


@dataclass
class CellLink:
    """One cell as a client talks to it: ``settings`` under the cell's key prefix, its
    Redis client (sync or asyncio) and the admission script registered on it."""

    name: str
    settings: Settings
    redis: Any
    admit: Any


def cell_settings(settings: Settings, redis_url: str | None) -> list[Settings]:
    """Settings for each cell a client talks to (one: the plain cluster), each with its
    Redis URL; ConfigError when one has none."""
    if not settings.cells:
        url = redis_url or settings.redis_url
        if not url:
            raise ConfigError("redis_url: not set (pass redis_url= or set BLOCKQ_REDIS_URL)")
        return [settings if settings.redis_url == url else dataclasses.replace(settings, redis_url=url)]
    per_cell = [settings.for_cell(cell) for cell in settings.cells]
    for cell, cell_config in zip(settings.cells, per_cell, strict=True):
        if not cell_config.redis_url:
            raise ConfigError(f"cells: cell {cell.prefix!r} has no Redis URL and BLOCKQ_REDIS_URL is not set")
    return per_cell


def connect_links(per_cell: list[Settings], connect: Callable[[str], Any]) -> list[CellLink]:
    """One link per cell; cells on the same Redis URL share one connection pool."""
    clients: dict[str, Any] = {}
    links = []
    for cell_config in per_cell:
        url = cell_config.redis_url or ""  # set: checked by cell_settings
        if url not in clients:
            clients[url] = connect(url)
        links.append(CellLink(cell_config.key_prefix, cell_config, clients[url], None))
    for link in links:
        link.admit = link.redis.register_script(ADMIT_SCRIPT)
    return links


class CellRouter:
    """Chooses a cell per submission and keeps the cells' loads fresh enough; pure but for
    the clock it is given (the caller does the reads it asks for)."""

    def __init__(self, links: list[CellLink], settings: Settings, clock: Callable[[], float],
                 rng: random.Random | None = None) -> None:
        self.links = {link.name: link for link in links}
        self.front = (CellFront(list(self.links), settings.front_options, rng)
                      if len(links) > 1 else None)
        self.clock = clock
        self.read_interval_s = max(MIN_LOAD_READ_INTERVAL_S, settings.cell_load_interval_ms / 1000)
        self._read_at_s = -math.inf

    def loads_due(self, now_s: float) -> bool:
        """Whether to read the loads now (claims the read: concurrent callers get False)."""
        if self.front is None or now_s - self._read_at_s < self.read_interval_s:
            return False
        self._read_at_s = now_s
        return True

    def observe(self, name: str, raw: dict[Any, Any] | None) -> None:
        """A cell's ``cell:load`` hash as read (None or empty: not read, or none published)."""
        if self.front is None:
            return
        load = None
        if raw:
            try:
                load = CellLoad.from_fields(raw)
            except ValueError as exc:
                log.warning("cell_load_unreadable", cell=name, error=str(exc))
        self.front.observe_load(name, load)

    def read_loads(self) -> None:
        """Read every cell's load (sync Redis clients); a cell that cannot be read has none."""
        for link in self.links.values():
            try:
                raw = link.redis.hgetall(link.settings.keys.cell_load)
            except REDIS_DOWN:
                raw = None
            self.observe(link.name, raw)

    async def read_loads_async(self) -> None:
        """As :meth:`read_loads`, for asyncio Redis clients, the cells read together."""
        async def read(link: CellLink) -> None:
            try:
                raw = await link.redis.hgetall(link.settings.keys.cell_load)
            except REDIS_DOWN:
                raw = None
            self.observe(link.name, raw)

        await asyncio.gather(*(read(link) for link in self.links.values()))

    def choose(self, now_s: float, exclude: list[str]) -> CellLink:
        if self.front is None:
            return self.first_link
        return self.links[self.front.choose(now_s, exclude)]

    def record_sent(self, link: CellLink, now_s: float, num_requests: int) -> None:
        if self.front is not None:
            self.front.record_sent(link.name, now_s, num_requests)

    @property
    def first_link(self) -> CellLink:
        """The only cell without cells (the plain cluster); the first listed with them."""
        return next(iter(self.links.values()))

    @property
    def num_cells(self) -> int:
        return len(self.links)
