"""Several cells behind one front, in virtual time (``blockq simulate --cells N``).

Each cell is a :class:`~loadgen.simulation.cluster.ClusterSimulation` (its own dispatcher
core, its share of the instances: :func:`cell_configs`); the front is
:class:`blockq.cells.CellFront`, the object the client library routes with. As live: every
``cell_load_interval_ms`` each cell's leader publishes
:func:`dispatcher.cell_load.cell_load_of` (at its own phase), the front reads the latest
publications as often (at its phase), and each request goes, at its submit time, to the
cell the front chooses; it reaches that cell's dispatcher after the ingress delay. The
cells' events and the front's run in one order (time, then source), so a run is a pure
function of its inputs and seed.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

from blockq.cells import CellFront, CellLoad, FrontOptions
from blockq.wire.protocol import Request
from dispatcher.cell_load import cell_load_of
from dispatcher.core import DispatcherCore
from loadgen.simulation.cluster import ClusterResult, ClusterSimulation
from loadgen.simulation.config import SimulationConfig
from workers.refinement import RefinementSource

# Front event kinds, in the order same-time events are handled.
_PUBLISH, _READ_LOADS, _SUBMIT = range(3)
# Seeds of cells after the first: apart, so that their instances' noise differs.
_CELL_SEED_STRIDE = 7919


class CellsSimulation:
    """One run of ``config.cells`` cells behind a front; :meth:`run` as
    :meth:`ClusterSimulation.run`, with the cells' results merged into one."""

    def __init__(self, config: SimulationConfig, *, refinements: RefinementSource | None = None) -> None:
        self.config = config
        self.cells = [ClusterSimulation(cell_config, refinements=refinements, instance_prefix=f"c{index}-")
                      for index, cell_config in enumerate(cell_configs(config))]
        self.names = [f"c{index}" for index in range(config.cells)]
        rng = random.Random(f"front-{config.seed}")
        self.front = CellFront(self.names, FrontOptions(stale_after_s=config.cell_stale_after_ms / 1000,
                                                        num_choices=config.cell_choices), rng)
        self.published: list[CellLoad | None] = [None] * config.cells
        self.num_sent = dict.fromkeys(self.names, 0)
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._interval_s = config.cell_load_interval_ms / 1000
        # Leaders and the front start at random phases, as independent processes do.
        for index in range(config.cells):
            self._push(rng.random() * self._interval_s, _PUBLISH, index)
        self._push(rng.random() * self._interval_s, _READ_LOADS, None)

    @property
    def cores(self) -> list[DispatcherCore]:
        return [cell.core for cell in self.cells]

    def _push(self, time_s: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time_s, self._seq, kind, payload))

    def run(self, arrivals: Sequence[tuple[float, Request]],
            on_progress: Callable[[int, int], None] | None = None) -> ClusterResult:
        """Simulate until every request is answered (arrival times as in
        :meth:`ClusterSimulation.run`)."""
        warmup_s, time_scale = self.config.warmup_s, self.config.time_scale
        for arrival_s, request in arrivals:
            self._push(warmup_s + arrival_s * time_scale, _SUBMIT, request)
        self._delays = _IngressDelays(self.config)
        num_expected, num_answered, num_events = len(arrivals), 0, 0
        while num_answered < num_expected:
            source, time_s = self._next_source()
            if source is None:
                break
            num_events += 1
            if source < 0:
                self._handle_front_event(time_s)
                continue
            cell = self.cells[source]
            before = cell.num_answered
            cell.handle_next_event()
            if cell.num_answered != before:
                num_answered += cell.num_answered - before
                if on_progress is not None:
                    on_progress(num_answered, num_expected)
        return self._merged(num_events)

    def _next_source(self) -> tuple[int | None, float]:
        """The source of the earliest event: -1 the front, else a cell's index (None: no
        events left). Ties go to the front, then to the lower cell."""
        best, best_s = None, self._events[0][0] if self._events else math.inf
        if self._events:
            best = -1
        for index, cell in enumerate(self.cells):
            time_s = cell.next_event_s()
            if time_s < best_s:
                best, best_s = index, time_s
        return best, best_s

    def _handle_front_event(self, now_s: float) -> None:
        _, _, kind, payload = heapq.heappop(self._events)
        if kind == _PUBLISH:
            cell = self.cells[payload]
            self.published[payload] = cell_load_of(cell.core, cell.num_unplaced, now_s)
            self._push(now_s + self._interval_s, _PUBLISH, payload)
        elif kind == _READ_LOADS:
            for name, load in zip(self.names, self.published, strict=True):
                self.front.observe_load(name, load)
            self._push(now_s + self._interval_s, _READ_LOADS, None)
        else:
            name = self.front.choose(now_s)
            self.front.record_sent(name, now_s)
            self.num_sent[name] += 1
            index = self.names.index(name)
            self.cells[index].submit(self._delays.readable_at(index, now_s), payload)

    def _merged(self, num_events: int) -> ClusterResult:
        results = [cell.finish() for cell in self.cells]
        merged = ClusterResult({}, {}, [], 0, max(r.end_s for r in results))
        for result in results:
            merged.finals.update(result.finals)
            merged.rejected.update(result.rejected)
            merged.kv_samples.extend(result.kv_samples)
            merged.delivery_samples_ms.extend(result.delivery_samples_ms)
            merged.trust_changes.extend(result.trust_changes)
            merged.num_missed += result.num_missed
            for key, value in result.counters.items():
                merged.counters[key] = merged.counters.get(key, 0) + value
        merged.kv_samples.sort(key=lambda sample: sample.at_s)
        merged.num_events = merged.counters["events"] = num_events
        merged.counters.update({f"sent_{name}": self.num_sent[name] for name in self.names})
        return merged


def cell_configs(config: SimulationConfig) -> list[SimulationConfig]:
    """Each cell's own cluster: ``config.instances`` split evenly, or a mixed fleet split by
    :meth:`~blockq.engine_model.fleet_spec.FleetSpec.split` (instance ``c{K}-gpu{J}`` runs
    the preset of fleet instance ``K + J * cells``), each cell with its own seed."""
    if config.fleet is None:
        sizes_and_fleets = [(config.instances // config.cells, None)] * config.cells
    else:
        sizes_and_fleets = [(fleet.num_instances, fleet) for fleet in config.fleet.split(config.cells)]
    return [dataclasses.replace(config, instances=num_instances, cells=1, fleet=fleet,
                                seed=config.seed + index * _CELL_SEED_STRIDE)
            for index, (num_instances, fleet) in enumerate(sizes_and_fleets)]


class _IngressDelays:
    """When a request submitted at ``now_s`` is readable by its cell's dispatcher: the
    ingress delay drawn as :meth:`ClusterSimulation.run` draws it, never before an earlier
    request to the same cell (its streams are a chain)."""

    def __init__(self, config: SimulationConfig) -> None:
        self.delay_s, self.sigma = config.ingress_delay_ms / 1000, config.ingress_delay_sigma
        self.rng = random.Random(f"ingress-{config.seed}")
        self.readable_at_s = [-math.inf] * config.cells

    def readable_at(self, cell: int, now_s: float) -> float:
        delay_s = self.delay_s * math.exp(self.rng.gauss(0.0, self.sigma)) if self.sigma else self.delay_s
        self.readable_at_s[cell] = max(self.readable_at_s[cell], now_s + delay_s)
        return self.readable_at_s[cell]
