"""The rules every scaler's wish passes through (pure: time is passed in).

A scaler says how many instances it wants; :func:`apply_rules` says how many it gets now:

* within ``[min_instances, max_instances]`` (a fleet outside the bounds is brought back
  at once, whatever the cooldowns);
* at most ``max_step_fraction`` of the fleet per action, and at least one instance;
* at least ``cooldown_s`` between two actions in the same direction: capacity that was
  just asked for is still starting, and the queue that built up meanwhile must not ask
  for it again (the oscillation the operating guide warns of);
* at least ``reversal_hold_s`` (longer) before an action in the other direction, so the
  fleet never flaps.

Both the predictive and the reactive scaler use these rules, so a comparison between
them compares what they want, not how fast they may move.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockq.config import ScalingRules

UP, DOWN = "up", "down"


@dataclass
class ActionHistory:
    """When the fleet last grew and last shrank (None: never)."""

    last_up_s: float | None = None
    last_down_s: float | None = None

    def record(self, direction: str, now_s: float) -> None:
        if direction == UP:
            self.last_up_s = now_s
        else:
            self.last_down_s = now_s

    def last_s(self, direction: str) -> float | None:
        return self.last_up_s if direction == UP else self.last_down_s


def apply_rules(rules: ScalingRules, history: ActionHistory, current: int, desired: int,
                now_s: float) -> tuple[int, str]:
    """(fleet size to set now, why) for a scaler that wants ``desired`` instances while
    ``current`` are provisioned. Does not record the action (the caller does, once the
    actuator took it)."""
    bounded = min(rules.max_instances, max(rules.min_instances, desired))
    if current < rules.min_instances or current > rules.max_instances:
        return min(rules.max_instances, max(rules.min_instances, current)), "outside min/max instances"
    if bounded == current:
        return current, "holds" if bounded == desired else f"at the {'max' if desired > current else 'min'} bound"
    direction = UP if bounded > current else DOWN
    blocked = blocked_by(rules, history, direction, now_s)
    if blocked is not None:
        return current, f"wants {bounded}: {blocked}"
    step = rules.max_step(current)
    target = min(bounded, current + step) if direction == UP else max(bounded, current - step)
    reason = f"scale {direction} to {target}" + (f" (wants {bounded}, step limit {step})" if target != bounded else "")
    return target, reason


def blocked_by(rules: ScalingRules, history: ActionHistory, direction: str, now_s: float) -> str | None:
    """Why an action in ``direction`` may not be taken at ``now_s`` (None: it may)."""
    opposite = DOWN if direction == UP else UP
    same_s, other_s = history.last_s(direction), history.last_s(opposite)
    if same_s is not None and now_s - same_s < rules.cooldown_s:
        return f"cooldown, scaled {direction} {now_s - same_s:.0f} s ago"
    if other_s is not None and now_s - other_s < rules.reversal_hold_s:
        return f"reversal hold, scaled {opposite} {now_s - other_s:.0f} s ago"
    return None


def count_reversals(actions: list[tuple[float, str]], within_s: float = 600.0) -> int:
    """Actions ((time s, direction), in time order) that reverse the one before them
    within ``within_s``."""
    return sum(1 for (before_s, before), (at_s, direction) in zip(actions, actions[1:], strict=False)
               if direction != before and at_s - before_s < within_s)
