"""Instance states, and health from heartbeat age: one rule for the dispatcher and ``blockq status``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class InstanceState(StrEnum):
    """What an instance is: as its beats report it (joining, live, draining, stopped), as
    the dispatcher judges it from their age (suspect, dead), or, for the autoscaler, asked
    for and not beating yet (starting). Equal to its string, which is what goes on the wire."""

    STARTING = "starting"
    JOINING = "joining"
    LIVE = "live"
    DRAINING = "draining"
    STOPPED = "stopped"
    SUSPECT = "suspect"
    DEAD = "dead"


# The states a worker's beat may report.
REPORTED_STATES = (InstanceState.JOINING, InstanceState.LIVE, InstanceState.DRAINING, InstanceState.STOPPED)


@dataclass(frozen=True)
class HealthPolicy:
    """``suspect`` after two missed intervals, ``dead`` after ``dead_after_s`` of silence."""

    heartbeat_interval_s: float = 0.1
    dead_after_s: float = 5.0

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0 or self.dead_after_s <= 0:
            raise ValueError("heartbeat_interval_s and dead_after_s: must be > 0")

    @property
    def suspect_after_s(self) -> float:
        # Two missed beats, plus slack for scheduling jitter on a busy host.
        return 2 * self.heartbeat_interval_s + 0.05

    def classify(self, reported_state: str, beat_age_s: float) -> InstanceState:
        """Health of an instance whose latest beat said ``reported_state``, ``beat_age_s`` ago."""
        if reported_state == InstanceState.STOPPED:
            return InstanceState.STOPPED
        if beat_age_s > self.dead_after_s:
            return InstanceState.DEAD
        if reported_state == InstanceState.LIVE and beat_age_s > self.suspect_after_s:
            return InstanceState.SUSPECT
        return InstanceState(reported_state)


def silence_s(last_beat_at_s: float, now_s: float, read_until_s: float = math.inf) -> float:
    """How long an instance has been silent, as far as a reader of the beat stream can
    tell: from its latest beat heard to ``read_until_s``, the moment up to which the reader
    has read every beat (its last read caught up: ``now_s``, the default). A reader behind
    on the stream has heard no instance's beats since then, so that lag is its own, not
    the instance's silence: counted against ``now_s``, a leader that fell behind saw every
    instance ``suspect`` and placed nothing (docs/results/decisions-at-scale.md)."""
    return min(now_s, read_until_s) - last_beat_at_s
