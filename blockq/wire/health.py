"""Instance health from heartbeat age: one rule for the dispatcher and ``blockq status``."""

from __future__ import annotations

from dataclasses import dataclass


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

    def classify(self, reported_state: str, beat_age_s: float) -> str:
        """Health of an instance whose latest beat said ``reported_state``, ``beat_age_s`` ago."""
        if reported_state == "stopped":
            return "stopped"
        if beat_age_s > self.dead_after_s:
            return "dead"
        if reported_state == "live" and beat_age_s > self.suspect_after_s:
            return "suspect"
        return reported_state
