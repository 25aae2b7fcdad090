"""The front's rule and state (blockq.cells): pure, no Redis."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from blockq.cells import (
    CellEstimate,
    CellFront,
    CellLoad,
    CellSpec,
    FrontOptions,
    choose_cell,
    parse_cells,
)
from blockq.config import ConfigError, Settings


def load(at_s: float, live: int, outstanding: int, unplaced: int = 0) -> CellLoad:
    return CellLoad(published_at_s=at_s, num_live_instances=live, num_outstanding=outstanding, num_unplaced=unplaced)


def test_the_least_loaded_cell_per_live_instance_wins() -> None:
    rng = random.Random(1)
    estimates = [CellEstimate("a", True, 4, 10.0), CellEstimate("b", True, 8, 6.0), CellEstimate("c", True, 2, 7.0)]
    assert choose_cell(estimates, rng) == 1


def test_stale_and_silent_cells_are_used_only_when_no_cell_is_fresh() -> None:
    rng = random.Random(1)
    fresh_busy = CellEstimate("busy", True, 4, 50.0)
    stale_idle = CellEstimate("stale", False, 4, 0.0)
    empty = CellEstimate("empty", True, 0, 0.0)  # fresh, but no live instance
    assert choose_cell([stale_idle, empty, fresh_busy], rng) == 2
    assert choose_cell([stale_idle, empty], rng) == 1  # fresh beats stale, even without instances
    assert choose_cell([stale_idle, CellEstimate("stale2", False, 4, 3.0)], rng) == 0


def test_power_of_k_choices_draws_by_capacity() -> None:
    rng = random.Random(7)
    estimates = [CellEstimate("big", True, 30, 1.0), *(CellEstimate(f"s{i}", True, 1, 2.0) for i in range(3))]
    wins = Counter(choose_cell(estimates, rng, num_choices=2) for _ in range(2000))
    assert wins[0] > 1900  # drawn in nearly every pair (weight 30 against 1), and the least loaded
    assert choose_cell(estimates[1:], rng, num_choices=2) in (0, 1, 2)


def test_a_front_counts_its_own_sends_until_a_publication_covers_them() -> None:
    front = CellFront(["a", "b"], FrontOptions(stale_after_s=2.0), random.Random(3))
    front.observe_load("a", load(10.0, 2, 0))
    front.observe_load("b", load(10.0, 2, 0))
    sent = Counter()
    for i in range(100):  # no new publication: the sends alone keep the cells level
        name = front.choose(10.1 + i * 0.001)
        front.record_sent(name, 10.1 + i * 0.001)
        sent[name] += 1
    assert sent == {"a": 50, "b": 50}
    # A publication that counts a's 50 requests drops them from the front's own count.
    front.observe_load("a", load(11.0, 2, 50))
    assert [e.load_per_instance for e in front.estimates(11.0)] == [25.0, 25.0]
    front.observe_load("a", load(10.5, 2, 0))  # an older publication changes nothing
    assert front.loads["a"] == load(11.0, 2, 50)


def test_a_front_splits_by_capacity() -> None:
    front = CellFront(["small", "large"], rng=random.Random(5))
    sent = Counter()
    front.observe_load("small", load(100.0, 1, 0))
    front.observe_load("large", load(100.0, 3, 0))
    for i in range(400):  # before the next publication: the front's own sends per live instance
        now_s = 100.0 + i * 0.001
        name = front.choose(now_s)
        front.record_sent(name, now_s)
        sent[name] += 1
    assert sent["large"] == pytest.approx(300, abs=1)


def test_a_stale_cell_is_avoided_and_used_again_once_fresh() -> None:
    front = CellFront(["a", "b"], FrontOptions(stale_after_s=1.0), random.Random(2))
    front.observe_load("a", load(0.0, 2, 0))
    front.observe_load("b", load(5.0, 2, 40))
    assert {front.choose(5.5) for _ in range(20)} == {"b"}  # a's load is 5.5 s old
    front.observe_load("a", load(5.6, 2, 0))
    assert front.choose(5.7) == "a"
    assert front.choose(5.7, exclude=["a"]) == "b"
    with pytest.raises(ValueError):
        front.choose(5.7, exclude=["a", "b"])


def test_cell_load_round_trips_and_refuses_what_it_cannot_read() -> None:
    original = CellLoad(1733400000.25, 3, 17, 2, 0.4321, "d-1")
    raw = {k.encode(): v.encode() for k, v in original.to_fields().items()}
    assert CellLoad.from_fields(raw) == CellLoad(1733400000.25, 3, 17, 2, 0.4321, "d-1")
    for bad in ({**original.to_fields(), "v": "9"}, {**original.to_fields(), "num_outstanding": "-1"},
                {k: v for k, v in original.to_fields().items() if k != "published_at_s"}):
        with pytest.raises(ValueError):
            CellLoad.from_fields(bad)


def test_cells_setting_is_parsed_and_validated() -> None:
    assert parse_cells("") == ()
    assert parse_cells("{a}: {b}:=redis+sentinel://s1:26379,s2:26379/main") == (
        CellSpec("{a}:"), CellSpec("{b}:", "redis+sentinel://s1:26379,s2:26379/main"))
    for bad in ("{a}:", "{a}: {a}:", "{a}: ={b}", "{a}: {b}:="):
        with pytest.raises(ValueError):
            parse_cells(bad)
    settings = Settings.from_env({"BLOCKQ_CELLS": "{a}: {b}:=redis://other:6379/1",
                                  "BLOCKQ_REDIS_URL": "redis://here:6379/0", "BLOCKQ_CELL_CHOICES": "2"})
    assert [settings.for_cell(c).redis_url for c in settings.cells] == ["redis://here:6379/0", "redis://other:6379/1"]
    assert settings.for_cell(settings.cells[1]).keys.requests == "{b}:req"
    assert settings.front_options == FrontOptions(stale_after_s=2.0, num_choices=2)
    with pytest.raises(ConfigError, match="hash tag"):
        Settings.from_env({"BLOCKQ_CELLS": "a: b:", "BLOCKQ_REDIS_URL": "redis+cluster://n1:6379,n2:6379"})
    with pytest.raises(ConfigError, match="cell_choices"):
        Settings.from_env({"BLOCKQ_CELL_CHOICES": "1"})
    with pytest.raises(ConfigError, match="BLOCKQ_CELLS"):
        Settings.from_env({"BLOCKQ_CELLS": "{a}: {a}:"})
