"""Requests name their model: on the wire, in the beats, and in the one filter the
dispatcher core applies before any policy chooses."""

from __future__ import annotations

import dataclasses

import pytest

from blockq.wire.beats import Heartbeat, decode_heartbeat
from blockq.wire.protocol import Request, ValidationError, encode
from blockq.wire.served_models import served_names, serves
from dispatcher.core import MODEL_NOT_SERVED, DispatcherCore, Held, Placed, Rejected
from dispatcher.policies import POLICIES
from tests.factories import make_heartbeat, make_request

ADAPTERS = ["sql", "poems"]


def serving_beat(instance_id: str, model: str, adapters: list[str] | None = None, *, loaded: list[str] | None = None,
                 max_loras: int = 2, seq: int = 1, **fields: object) -> Heartbeat:
    beat = make_heartbeat(instance_id, sent_at_s=0.0, seq=seq)
    config = dict(beat.engine_config)
    if adapters is not None:
        config.update(lora_adapters=adapters, loaded_loras=loaded or [], max_loras=max_loras, lora_load_ms=40.0)
    return dataclasses.replace(beat, model=model, engine_config=config, **fields)


def fleet(policy: str) -> DispatcherCore:
    core = DispatcherCore(policy, seed=0)
    core.apply_heartbeat(serving_beat("a", "llama-7b"), 0.0)
    core.apply_heartbeat(serving_beat("b", "mistral-7b", ADAPTERS), 0.0)
    core.apply_heartbeat(serving_beat("c", "mistral-7b", ADAPTERS), 0.0)
    return core


def test_a_request_carries_its_model_on_the_wire() -> None:
    request = make_request(model="sql")
    assert Request.from_map(request.to_map()).model == "sql"
    assert Request.from_map(make_request().to_map()).model is None
    with pytest.raises(ValidationError, match="model"):
        Request.from_map({**request.to_map(), "model": "x" * 300})


def test_a_beat_publishes_its_base_model_and_adapters_and_refuses_bad_lists() -> None:
    beat = serving_beat("b", "mistral-7b", ADAPTERS, loaded=["sql"])
    decoded = decode_heartbeat(encode(beat))
    assert served_names(decoded) == ("mistral-7b", "sql", "poems")
    assert serves(decoded, "poems") and serves(decoded, None) and not serves(decoded, "llama-7b")
    for bad in ("sql", [1, 2], ["x" * 300], [""]):
        with pytest.raises(ValidationError, match="lora_adapters"):
            decode_heartbeat(encode(dataclasses.replace(beat, engine_config={**beat.engine_config,
                                                                             "lora_adapters": bad})))


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"oracle"}))
def test_every_policy_places_a_request_only_where_its_model_is_served(policy: str) -> None:
    core = fleet(policy)
    for model, allowed in (("llama-7b", {"a"}), ("mistral-7b", {"b", "c"}), ("poems", {"b", "c"})):
        outcomes = core.place([make_request(predicted=20, model=model) for _ in range(6)], 0.1)
        assert {o.request.assignment.instance_id for o in outcomes if isinstance(o, Placed)} <= allowed
        assert all(isinstance(o, Placed) for o in outcomes)


def test_a_model_no_live_instance_serves_is_refused_at_once_naming_it() -> None:
    core = fleet("llumnix")
    (outcome,) = core.place([make_request(predicted=20, model="gpt-9")], 0.1)
    assert isinstance(outcome, Rejected)
    assert MODEL_NOT_SERVED in outcome.reason and "'gpt-9'" in outcome.reason
    # With no live instance at all, as before: held until one joins.
    empty = DispatcherCore("llumnix", seed=0)
    assert isinstance(empty.place([make_request(model="gpt-9")], 0.0)[0], Held)
    # Requests naming no model go anywhere, as before models were named.
    outcomes = core.place([make_request(predicted=20) for _ in range(9)], 0.1)
    assert {o.request.assignment.instance_id for o in outcomes} == {"a", "b", "c"}


def test_the_filter_follows_the_beats_and_keeps_the_live_list_when_all_serve() -> None:
    core = fleet("least_requests")
    live = core.live_instances()
    assert core.view.serving(None, live) is live
    mistral = core.view.serving("mistral-7b", live)
    assert [v.instance_id for v in mistral] == ["b", "c"] and core.view.serving("mistral-7b", live) is mistral
    core.apply_heartbeat(serving_beat("a", "mistral-7b", ADAPTERS, seq=2), 0.2)  # a restarted with mistral
    assert core.view.serving("mistral-7b", core.live_instances()) is core.live_instances()
    (outcome,) = core.place([make_request(predicted=20, model="llama-7b")], 0.3)
    assert isinstance(outcome, Rejected)


def test_re_placed_requests_keep_to_their_model() -> None:
    core = fleet("least_requests")
    outcomes = core.replace_unstarted("b", [make_request(predicted=20, model="sql") for _ in range(3)], 0.1)
    assert {o.request.assignment.instance_id for o in outcomes} == {"c"}
    outcomes = core.replace_unstarted("a", [make_request(predicted=20, model="llama-7b")], 0.1)
    assert isinstance(outcomes[0], Rejected)


def test_block_prefers_the_instance_with_the_adapter_in_use() -> None:
    core = DispatcherCore("block", seed=0)
    core.apply_heartbeat(serving_beat("b", "m", ["x", "y"], loaded=["x"], max_loras=1,
                                      engine_stats={"running_lora_adapters": ["x"]}), 0.0)
    core.apply_heartbeat(serving_beat("c", "m", ["x", "y"], loaded=["y"], max_loras=1,
                                      engine_stats={"running_lora_adapters": ["y"]}), 0.0)
    for model, expected in (("x", "b"), ("y", "c"), ("x", "b")):
        (outcome,) = core.place([make_request(predicted=20, model=model)], 0.1)
        assert isinstance(outcome, Placed) and outcome.request.assignment.instance_id == expected


def test_an_emulated_worker_serves_what_its_options_say() -> None:
    import argparse

    from workers.cli import add_arguments, build_engine
    from workers.engines.base import EngineRequestSpec

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    engine = build_engine(parser.parse_args(["--instance-id", "i0", "--lora-modules", "sql=/x,poems=/y",
                                             "--max-loras", "1", "--served-model-name", "base"]), 0)
    config = engine.engine_config()
    assert (engine.model, config["lora_adapters"], config["loaded_loras"], config["max_loras"]) == (
        "base", ["sql", "poems"], [], 1)
    spec = EngineRequestSpec("r1", "hi", prompt_tokens=4, max_tokens=4, true_output_tokens=2, model="poems")
    assert engine.validate(spec) is None
    assert "gpt-9" in (engine.validate(dataclasses.replace(spec, model="gpt-9")) or "")
    engine.add_request(spec)
    engine.add_request(dataclasses.replace(spec, request_id="r2", model="base"))
    assert engine.engine_stats()["waiting_lora_adapters"] == ["poems"]
    _, waiting, _ = engine.progress()  # each request's adapter, for the dispatcher's replica
    assert [(entry.request_id, entry.lora_adapter) for entry in waiting] == [("r1", "poems"), ("r2", None)]
    engine.finish_step(engine.start_step())
    assert engine.engine_config()["loaded_loras"] == ["poems"] and engine.engine_config() is not config
    assert engine.engine_stats()["num_lora_loads_total"] == 1


def test_streamed_workers_name_each_requests_adapter_in_their_beats() -> None:
    """The vLLM workers (embedded and over HTTP) build their entries with progress_item:
    an adapter they serve is named, the base model and other names are not."""
    from workers.engines.base import EngineRequestSpec
    from workers.engines.streamed import laid_over_arrival_order, progress_item

    spec = EngineRequestSpec("r1", "hi", prompt_tokens=4, max_tokens=4, model="sql")
    assert progress_item(spec, 3, 1, ADAPTERS).lora_adapter == "sql"
    assert progress_item(spec, 3, 1).lora_adapter is None
    assert progress_item(dataclasses.replace(spec, model="base"), 3, 1, ADAPTERS).lora_adapter is None
    running, waiting = laid_over_arrival_order([(spec, 1), (dataclasses.replace(spec, request_id="r2"), 0)], 1,
                                               ADAPTERS)
    assert [entry.lora_adapter for entry in [*running, *waiting]] == ["sql", "sql"]
