"""vLLM's sampling extensions ``ignore_eos`` and ``min_tokens`` from the client to the
engine: the client puts them on the request, the intake hands them to the engine (a trace
replay's requests with ``ignore_eos``), and the emulated engine honours them."""

from __future__ import annotations

import pytest

from blockq.client import SubmitSpec, build_request
from blockq.config import Settings
from blockq.wire.protocol import ValidationError
from tests.factories import make_request
from workers.engines.base import EngineRequestSpec, TokenEvent
from workers.engines.emulated import EmulatedEngine, EmulatedEngineOptions
from workers.intake import engine_spec


def short_eos_engine() -> EmulatedEngine:
    """An engine whose sampled EOS always comes after 3 tokens (sigma 0), so that any
    longer output is the extensions' doing."""
    return EmulatedEngine(EmulatedEngineOptions(noise_sigma=0.0, eos_median_tokens=3.0, eos_sigma=0.0))


def run(engine: EmulatedEngine, *specs: EngineRequestSpec) -> dict[str, list[TokenEvent]]:
    """Every spec run to its end on the engine model (no sleeping): each request's events."""
    for spec in specs:
        engine.add_request(spec)
    events: dict[str, list[TokenEvent]] = {spec.request_id: [] for spec in specs}
    while (result := engine.start_step()) is not None:
        for event in engine.finish_step(result).events:
            events[event.request_id].append(event)
    assert not engine.has_unfinished_requests()
    return events


def spec(request_id: str, max_tokens: int = 40, **options: object) -> EngineRequestSpec:
    return EngineRequestSpec(request_id=request_id, prompt="hello", prompt_tokens=8, max_tokens=max_tokens,
                             **options)  # type: ignore[arg-type]


def output_of(events: list[TokenEvent]) -> tuple[int, str | None]:
    """(output tokens, finish reason) of one request's events."""
    assert events and events[-1].finished and sum(e.finished for e in events) == 1
    return sum(e.num_new_tokens for e in events), events[-1].finish_reason


def test_without_extensions_the_sampled_eos_ends_the_request() -> None:
    events = run(short_eos_engine(), spec("plain"))
    assert output_of(events["plain"]) == (3, "stop")


def test_ignore_eos_runs_to_max_tokens() -> None:
    events = run(short_eos_engine(), spec("a", max_tokens=40, ignore_eos=True), spec("b", max_tokens=7, ignore_eos=True))
    assert output_of(events["a"]) == (40, "length")
    assert output_of(events["b"]) == (7, "length")


def test_a_trace_length_wins_over_ignore_eos() -> None:
    events = run(short_eos_engine(), spec("trace", ignore_eos=True, true_output_tokens=12),
                 spec("capped", max_tokens=5, ignore_eos=True, true_output_tokens=12))
    assert output_of(events["trace"]) == (12, "stop")
    assert output_of(events["capped"]) == (5, "length")


def test_min_tokens_holds_off_the_end_up_to_max_tokens() -> None:
    events = run(short_eos_engine(), spec("min", min_tokens=15), spec("cap", max_tokens=10, min_tokens=10),
                 spec("below", min_tokens=2), spec("trace", min_tokens=20, true_output_tokens=6))
    assert output_of(events["min"]) == (15, "stop")
    assert output_of(events["cap"]) == (10, "length")
    assert output_of(events["below"]) == (3, "stop")   # the EOS came after min_tokens anyway
    assert output_of(events["trace"])[0] == 20


def test_milestone_mode_reports_the_same_lengths() -> None:
    engine = EmulatedEngine(EmulatedEngineOptions(noise_sigma=0.0, eos_median_tokens=3.0, eos_sigma=0.0,
                                                  stream_tokens=False))
    events = run(engine, spec("eos", ignore_eos=True, max_tokens=33), spec("min", min_tokens=9))
    assert output_of(events["eos"]) == (33, "length") and output_of(events["min"]) == (9, "stop")


def test_intake_hands_the_extensions_over_and_trace_replays_ignore_eos() -> None:
    handed = engine_spec(make_request(max_tokens=64, ignore_eos=True, min_tokens=5))
    assert (handed.ignore_eos, handed.min_tokens, handed.max_tokens) == (True, 5, 64)
    plain = engine_spec(make_request(max_tokens=64))
    assert (plain.ignore_eos, plain.min_tokens) == (False, 0)
    # A trace gives the length: the engine must not stop at its own EOS before it.
    replayed = engine_spec(make_request(max_tokens=64, true_output_tokens=30))
    assert replayed.ignore_eos and replayed.true_output_tokens == 30


def test_client_puts_the_extensions_on_the_request() -> None:
    settings = Settings()
    request = build_request(SubmitSpec(prompt="hi", max_tokens=32, ignore_eos=True, min_tokens=8), settings)
    assert (request.ignore_eos, request.min_tokens) == (True, 8)
    default = build_request(SubmitSpec(prompt="hi"), settings)
    assert (default.ignore_eos, default.min_tokens) == (False, 0)
    with pytest.raises(ValidationError) as info:
        build_request(SubmitSpec(prompt="hi", max_tokens=4, min_tokens=5), settings)
    assert info.value.field == "min_tokens" and "max_tokens (4)" in str(info.value)
