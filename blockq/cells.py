"""Cells: several blockq clusters behind one front, and the front's rule.

A cell is a dispatcher, its instances and its streams under its own key prefix (on Redis
Cluster a tagged prefix, ``{cell-a}:``, so the cell lives on one shard). Each cell's
dispatcher leader publishes its load (:class:`CellLoad`, in the cell's ``cell:load`` hash)
every ``cell_load_interval_ms``; a front (the client library, and so the gateway) reads
those loads and sends each request to one cell by :func:`choose_cell`. The simulation
(``blockq simulate --cells N``) runs the same :class:`CellFront`. Design and measurements:
docs/architecture.md#cells.

Everything here is pure: no Redis, no clock (times are passed in, in seconds on the
caller's wall clock), randomness from the ``random.Random`` the caller gives.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

CELL_LOAD_VERSION = 1
# A publication counts the requests its cell had read by then; those a front sent in the
# last moment before it may still be on their way (the predictor stage, two stream hops:
# a few ms live). The front counts its sends from this long before a publication, so a
# request is counted twice for a moment rather than not at all (herding is the worse error).
INGRESS_ALLOWANCE_S = 0.05


@dataclass(frozen=True)
class CellSpec:
    """One cell as a front knows it: its key prefix (its name) and its Redis (None: the
    front's own ``redis_url``)."""

    prefix: str
    redis_url: str | None = None

    @property
    def name(self) -> str:
        return self.prefix


def numbered_cell_prefix(index: int) -> str:
    """The key prefix of cell ``index`` of a numbered set (``blockq up --cells``,
    ``blockq bench --cells``): hash-tagged, so each cell is one slot on Redis Cluster."""
    return f"{{cell{index}}}:"


def parse_cells(text: str) -> tuple[CellSpec, ...]:
    """Cells from ``BLOCKQ_CELLS``: entries separated by whitespace, each ``PREFIX`` or
    ``PREFIX=REDIS_URL`` (URLs may hold commas: Sentinel and Cluster lists). Raises
    ValueError naming the problem; an empty text is no cells."""
    cells: list[CellSpec] = []
    for entry in text.split():
        prefix, sep, url = entry.partition("=")
        if not prefix:
            raise ValueError(f"cells: an entry has no key prefix (got {entry!r})")
        if sep and not url:
            raise ValueError(f"cells: {prefix!r} has '=' and no Redis URL")
        cells.append(CellSpec(prefix, url or None))
    names = [cell.prefix for cell in cells]
    if len(set(names)) != len(names):
        raise ValueError(f"cells: a key prefix is listed twice (got {' '.join(names)})")
    if len(cells) == 1:
        raise ValueError("cells: list two cells or more (one cell is the plain cluster: leave BLOCKQ_CELLS unset)")
    return tuple(cells)


@dataclass(frozen=True)
class CellLoad:
    """What a cell's dispatcher leader publishes. ``published_at_s``: its wall clock;
    ``num_outstanding``: requests on its live instances (running, waiting, placed and not
    yet in a beat); ``num_unplaced``: requests it holds (no instance may take them yet);
    ``kv_usage``: the live instances' mean share of KV blocks used (0-1)."""

    published_at_s: float
    num_live_instances: int
    num_outstanding: int
    num_unplaced: int = 0
    kv_usage: float = 0.0
    dispatcher_id: str = ""

    def to_fields(self) -> dict[str, str]:
        """The hash's fields (strings, readable with ``HGETALL``)."""
        return {"v": str(CELL_LOAD_VERSION), "published_at_s": repr(self.published_at_s),
                "num_live_instances": str(self.num_live_instances), "num_outstanding": str(self.num_outstanding),
                "num_unplaced": str(self.num_unplaced), "kv_usage": f"{self.kv_usage:.4f}",
                "dispatcher_id": self.dispatcher_id}

    @classmethod
    def from_fields(cls, raw: Mapping[bytes | str, bytes | str]) -> CellLoad:
        """Decode :meth:`to_fields`' hash; raises ValueError naming the field."""
        fields = {_text(k): _text(v) for k, v in raw.items()}
        if fields.get("v") != str(CELL_LOAD_VERSION):
            raise ValueError(f"cell load: version {fields.get('v')!r}, expected {CELL_LOAD_VERSION}")
        try:
            load = cls(float(fields["published_at_s"]), int(fields["num_live_instances"]),
                       int(fields["num_outstanding"]), int(fields.get("num_unplaced", 0)),
                       float(fields.get("kv_usage", 0.0)), fields.get("dispatcher_id", ""))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"cell load: bad or missing field ({exc})") from None
        if not math.isfinite(load.published_at_s) or min(load.num_live_instances, load.num_outstanding,
                                                          load.num_unplaced) < 0:
            raise ValueError("cell load: negative count or time not finite")
        return load


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class CellEstimate:
    """A front's view of one cell when it chooses: ``fresh`` (its load is recent),
    ``num_live_instances`` (its capacity, the weight) and ``load_per_instance`` (published
    outstanding and unplaced requests plus the front's own sends since, per live instance)."""

    name: str
    fresh: bool
    num_live_instances: int
    load_per_instance: float


def choose_cell(estimates: Sequence[CellEstimate], rng: random.Random, *, num_choices: int = 0) -> int:
    """The index of the cell a request goes to: the least load per live instance among
    the fresh cells with live instances (else the fresh cells, else all: a stale or
    silent cell is used only when no cell is better known). ``num_choices`` 0 compares
    every candidate; k >= 2 compares k of them drawn with weights by live instances (power
    of k choices: several fronts reading the same loads then do not all pick the same
    cell). Ties go to a random one of them."""
    if not estimates:
        raise ValueError("choose_cell: no cells")
    tiers = ([i for i, e in enumerate(estimates) if e.fresh and e.num_live_instances > 0],
             [i for i, e in enumerate(estimates) if e.fresh])
    candidates = next((tier for tier in tiers if tier), list(range(len(estimates))))
    if 2 <= num_choices < len(candidates):
        candidates = _draw_weighted(candidates, [max(1, estimates[i].num_live_instances) for i in candidates],
                                    num_choices, rng)
    best = min(estimates[i].load_per_instance for i in candidates)
    tied = [i for i in candidates if estimates[i].load_per_instance <= best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def _draw_weighted(items: list[int], weights: list[int], k: int, rng: random.Random) -> list[int]:
    """``k`` distinct items drawn with probability proportional to their weights."""
    items, weights = list(items), list(weights)
    drawn: list[int] = []
    for _ in range(k):
        index = rng.choices(range(len(items)), weights=weights)[0]
        drawn.append(items.pop(index))
        weights.pop(index)
    return drawn


@dataclass(frozen=True)
class FrontOptions:
    """How a front routes: a load older than ``stale_after_s`` is stale (its cell is used
    only when no cell has a fresh one); ``num_choices`` as :func:`choose_cell`."""

    stale_after_s: float = 2.0
    num_choices: int = 0

    def __post_init__(self) -> None:
        if not self.stale_after_s > 0:
            raise ValueError(f"cell_stale_after_ms: must be > 0 (got {self.stale_after_s * 1000:g})")
        if self.num_choices < 0 or self.num_choices == 1:
            raise ValueError(f"cell_choices: must be 0 (all) or >= 2 (got {self.num_choices})")


class CellFront:
    """The front's state over its cells: the latest load of each (:meth:`observe_load`)
    and the requests it sent since (:meth:`record_sent`); :meth:`choose` applies
    :func:`choose_cell`. No I/O, no clock: the client library feeds it from Redis on the
    wall clock, the simulation in virtual time."""

    def __init__(self, names: Sequence[str], options: FrontOptions | None = None,
                 rng: random.Random | None = None) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError("CellFront: give distinct cell names")
        self.names = tuple(names)
        self.options = options or FrontOptions()
        self.rng = rng or random.Random()
        self.loads: dict[str, CellLoad | None] = dict.fromkeys(self.names)
        # When this front sent each request to a cell, oldest first; those a publication
        # already counts are dropped when it arrives.
        self._sent_at_s: dict[str, deque[float]] = {name: deque() for name in self.names}
        self.num_sent: dict[str, int] = dict.fromkeys(self.names, 0)

    def observe_load(self, name: str, load: CellLoad | None) -> None:
        """Take a cell's latest publication (None: it has none, or it could not be read;
        an older one than known is ignored)."""
        known = self.loads[name]
        if load is None or (known is not None and load.published_at_s < known.published_at_s):
            return
        self.loads[name] = load
        sent = self._sent_at_s[name]
        counted_before_s = load.published_at_s - INGRESS_ALLOWANCE_S
        while sent and sent[0] <= counted_before_s:
            sent.popleft()

    def record_sent(self, name: str, now_s: float, num_requests: int = 1) -> None:
        self._sent_at_s[name].extend([now_s] * num_requests)
        self.num_sent[name] += num_requests

    def estimates(self, now_s: float) -> list[CellEstimate]:
        estimates = []
        for name in self.names:
            load, num_sent = self.loads[name], len(self._sent_at_s[name])
            if load is None:
                estimates.append(CellEstimate(name, False, 0, float(num_sent)))
                continue
            fresh = now_s - load.published_at_s <= self.options.stale_after_s
            backlog = load.num_outstanding + load.num_unplaced + num_sent
            estimates.append(CellEstimate(name, fresh, load.num_live_instances,
                                          backlog / max(1, load.num_live_instances)))
        return estimates

    def choose(self, now_s: float, exclude: Sequence[str] = ()) -> str:
        """The cell for the next request (not one of ``exclude``, e.g. cells that just
        refused it as overloaded); ValueError when every cell is excluded."""
        estimates = [e for e in self.estimates(now_s) if e.name not in exclude]
        if not estimates:
            raise ValueError("every cell was excluded")
        return estimates[choose_cell(estimates, self.rng, num_choices=self.options.num_choices)].name
