"""Protocol round trips and validation; the decoder never crashes on garbage."""

from __future__ import annotations

import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockq.wire.beats import Heartbeat, RequestProgress, decode_heartbeat
from blockq.wire.protocol import (
    Assignment,
    Prediction,
    ProtocolLimits,
    Request,
    ValidationError,
    decode_request,
    encode,
)


def make_request(**overrides: object) -> Request:
    values: dict[str, object] = dict(id="r1", prompt="hello", max_tokens=16, reply_stream="bq:out:{r1}",
                                     submitted_at_s=time.time())
    values.update(overrides)
    return Request(**values)  # type: ignore[arg-type]


def test_request_round_trip_with_annotations() -> None:
    request = make_request(prompt=(1, 2, 3), stop=("\n",), priority="batch", deadline_s=123.5,
                           tenant="t", true_output_tokens=40)
    request = request.with_prediction(Prediction(3, 42, 10, 90, "heuristic-1"))
    request = request.with_assignment(Assignment("inst-0", "block", 1.0, 0.5, 120.0, 900.0))
    assert decode_request(encode(request)) == request


def test_sampling_extensions_round_trip_and_default_when_absent() -> None:
    request = make_request(ignore_eos=True, min_tokens=16)
    decoded = decode_request(encode(request))
    assert decoded == request and (decoded.ignore_eos, decoded.min_tokens) == (True, 16)
    # A message from a writer older than the fields still parses, with vLLM's defaults.
    data = make_request(ignore_eos=True, min_tokens=3).to_map()
    del data["ignore_eos"], data["min_tokens"]
    old = decode_request(msgpack.packb(data))
    assert (old.ignore_eos, old.min_tokens) == (False, 0)


def test_map_carries_schema_version() -> None:
    data = msgpack.unpackb(encode(make_request()))
    assert data["v"] == 1 and data["kind"] == "request"


@pytest.mark.parametrize(
    ("change", "field", "fragment"),
    [
        ({"max_tokens": 0}, "max_tokens", "between 1 and"),
        ({"max_tokens": 10**9}, "max_tokens", "between 1 and"),
        ({"max_tokens": "8"}, "max_tokens", "must be int"),
        ({"max_tokens": True}, "max_tokens", "got bool"),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": []}, "prompt", "must not be empty"),
        ({"prompt": [1, -2]}, "prompt", "token ids"),
        ({"prompt": 5}, "prompt", "must be str"),
        ({"priority": "urgent"}, "priority", "interactive, batch"),
        ({"temperature": 3.0}, "temperature", "between 0.0 and 2.0"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"id": ""}, "id", "must not be empty"),
        ({"id": "x" * 200}, "id", "at most 128"),
        ({"stop": ["a"] * 17}, "stop", "at most 16"),
        ({"v": 99}, "v", "unsupported schema version"),
        ({"kind": "chunk"}, "kind", "expected 'request'"),
        ({"submitted_at_s": float("nan")}, "submitted_at_s", "finite"),
        ({"reply_stream": None}, "reply_stream", "required"),
        ({"min_tokens": 17}, "min_tokens", "at most max_tokens (16)"),
        ({"min_tokens": -1}, "min_tokens", "between 0 and"),
        ({"min_tokens": "4"}, "min_tokens", "must be int"),
        ({"min_tokens": True}, "min_tokens", "got bool"),
        ({"ignore_eos": "yes"}, "ignore_eos", "must be bool"),
        ({"ignore_eos": 1}, "ignore_eos", "must be bool"),
    ],
)
def test_each_invalid_request_names_its_field(change: dict, field: str, fragment: str) -> None:
    data = make_request().to_map()
    data.update(change)
    with pytest.raises(ValidationError) as excinfo:
        decode_request(msgpack.packb(data))
    assert excinfo.value.field == field
    assert fragment in str(excinfo.value)


def test_limits_are_configurable() -> None:
    limits = ProtocolLimits(max_prompt_chars=10, max_max_tokens=100)
    with pytest.raises(ValidationError, match="prompt: must be at most 10 characters"):
        decode_request(encode(make_request(prompt="x" * 11)), limits)
    with pytest.raises(ValidationError, match="between 1 and 100"):
        decode_request(encode(make_request(max_tokens=101)), limits)
    with pytest.raises(ValidationError, match="message: must be at most 64 bytes"):
        decode_request(encode(make_request(prompt="y" * 100)), ProtocolLimits(max_message_bytes=64))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_the_decoder(raw: bytes) -> None:
    try:
        decode_request(raw)
    except ValidationError as exc:
        assert exc.field


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "kind", "id", "prompt", "max_tokens", "reply_stream",
                                         "submitted_at_s", "stop", "priority", "prediction", "top_p",
                                         "temperature", "num_turns", "deadline_s"]) | st.text(max_size=8),
                       json_values, max_size=12))
def test_random_maps_never_crash_the_decoder(data: dict) -> None:
    try:
        decode_request(msgpack.packb(data, use_bin_type=True))
    except ValidationError as exc:
        assert exc.field


@pytest.mark.parametrize(("change", "field"), [
    ({"engine_config": {"num_gpu_blocks": float("inf"), "enable_prefix_caching": True}}, "engine_config"),
    ({"engine_config": {"max_num_seqs": True}}, "engine_config"),
    ({"engine_config": {"num_gpu_blocks": 2**64 - 1}}, "engine_config"),
    ({"engine_config": {"watermark": float("nan")}}, "engine_config"),
    ({"latency_model": {"linear_knot_tokens": [1], "linear_knot_s": [float("inf")], "kv_token_s": 0,
                        "prefill_pair_s": 0, "step_overhead_s": 0}}, "latency_model"),
    ({"engine_time_s": float("nan")}, "engine_time_s"),
    ({"time_scale": 0.0}, "time_scale"),
    ({"num_used_blocks": -1}, "num_used_blocks"),
    ({"num_running_total": "many"}, "num_running_total"),
    ({"step_samples": [[0, 1, 12, float("inf")]]}, "step_samples"),
    ({"step_samples": [[0, 1]]}, "step_samples"),
    # found by tests/test_fuzz.py: these decoded and then raised inside the dispatcher's policies
    ({"step_samples": True}, "step_samples"),
    ({"running": [["r1", None, 0, 0, 0, 10]]}, "running"),
    ({"waiting": [["r2", 10, 0, 0, 2**40, 10]]}, "waiting"),
    ({"waiting": [[7, 10, 0, 0, 0, 10]]}, "waiting"),
    ({"running": [["r1", 10, 0, 0, 0, 10]] * 257}, "running"),
    ({"finished_ids": [3]}, "finished_ids"),
    ({"finished_sizes": [[True, 2]]}, "finished_sizes"),
    ({"model": None}, "model"),
    ({"truncated": "yes"}, "truncated"),
    ({"engine_stats": [1]}, "engine_stats"),
])
def test_a_beat_with_a_field_out_of_type_or_not_finite_is_refused_naming_it(change: dict, field: str) -> None:
    beat = Heartbeat(instance_id="i", state="live", seq=3, sent_at_s=1.0, engine_time_s=0.5, model="m",
                     preset="p", engine_config={"num_gpu_blocks": 10}, latency_model=None, num_used_blocks=4,
                     running=(), waiting=(), num_running_total=0, num_waiting_total=0)
    with pytest.raises(ValidationError, match=field):
        decode_heartbeat(msgpack.packb(beat.to_map() | change, use_bin_type=True))


def test_heartbeat_round_trip() -> None:
    beat = Heartbeat(instance_id="i", state="live", seq=3, sent_at_s=1.0, engine_time_s=0.5, model="m",
                     preset="p", engine_config={"num_gpu_blocks": 10}, latency_model=None, num_used_blocks=4,
                     running=(RequestProgress("a", 10, 12, 2, 50, 90),), waiting=(), num_running_total=1,
                     num_waiting_total=0, finished_ids=("z",), finished_sizes=((30, 7),),
                     step_samples=((0, 1, 12, 0.02),), lag_p99_ms=4.5, lag_mean_ms=1.25, state_at_s=0.52)
    assert decode_heartbeat(encode(beat)) == beat
    # A beat from a worker that reports no mean lag reads as none, one without a state
    # time as a state that holds at its engine time.
    older = {key: value for key, value in beat.to_map().items() if key not in ("lag_mean_ms", "state_at_s")}
    assert decode_heartbeat(msgpack.packb(older, use_bin_type=True)).lag_mean_ms == 0.0
    assert decode_heartbeat(msgpack.packb(older, use_bin_type=True)).state_at_s is None
    with pytest.raises(ValidationError, match="state_at_s"):
        decode_heartbeat(msgpack.packb(beat.to_map() | {"state_at_s": "soon"}, use_bin_type=True))
    with pytest.raises(ValidationError, match="lag_mean_ms"):
        decode_heartbeat(msgpack.packb(beat.to_map() | {"lag_mean_ms": "slow"}, use_bin_type=True))
    data = beat.to_map() | {"finished_sizes": [[30, "7"]]}
    with pytest.raises(ValidationError, match="finished_sizes"):
        decode_heartbeat(msgpack.packb(data, use_bin_type=True))
