"""The chaos suite: each fault on a real local cluster under load (``loadgen.chaos``),
asserting what its readers saw: nothing lost, nothing seen twice, recovery in seconds.

Marked ``chaos`` (about a minute per scenario): ``make test-chaos`` runs it; CI runs it
after the default suite. Each scenario prints its row of the table."""

from __future__ import annotations

import pytest

from loadgen.chaos import SCENARIOS, markdown_table, run_scenario

pytestmark = pytest.mark.chaos

# Recovery bounds (s): from the fault, or for Redis from Redis answering again.
RECOVERY_BOUND_S = {"worker_killed": 5.0, "worker_killed_twice": 5.0, "leader_killed": 5.0,
                    "predictor_killed": 5.0, "redis_killed": 10.0, "redis_sigkill": 10.0, "malformed_flood": 5.0,
                    "worker_paused": 5.0}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fault_loses_nothing_and_shows_nothing_twice(name: str) -> None:
    result = run_scenario(SCENARIOS[name])
    print("\n" + markdown_table([result]))
    assert result.accepted > 0
    assert result.lost == 0, result
    assert result.duplicates == 0, result
    if name in RECOVERY_BOUND_S:
        assert result.recovery_s is not None and result.recovery_s <= RECOVERY_BOUND_S[name], result
    if name == "overload":
        # The backlog bound holds everywhere in the pipeline: the excess is refused up front.
        assert result.refused > 0, result
        assert result.notes["max_backlog_entries"] <= 60 + 16, result  # + one bundle in flight
    if name == "malformed_flood":
        assert result.notes["statuses"] == {"ok": result.accepted}, result
