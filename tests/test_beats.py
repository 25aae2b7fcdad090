"""Heartbeat decoding: the list-wide fast path decodes what the entry-by-entry one does,
and refuses what it refuses; the fleet decoder re-checks an engine model only when it changes."""

from __future__ import annotations

import msgpack
import pytest

from blockq.wire.beats import HeartbeatDecoder, RequestProgress, decode_heartbeat
from blockq.wire.protocol import ValidationError, encode
from tests.factories import make_heartbeat


def pack_map(data: dict) -> bytes:
    return msgpack.packb(data, use_bin_type=True)


def progress(n: int, *, refined: bool = False) -> tuple[RequestProgress, ...]:
    return tuple(RequestProgress(f"r{i}", 100 + i, 100 + i + 5, 6, 300, 600, 100 if refined else None,
                                 40 if refined else None) for i in range(n))


def test_the_fast_path_decodes_as_entry_by_entry() -> None:
    beat = make_heartbeat("a", running=progress(40), waiting=progress(20, refined=True))
    decoded = decode_heartbeat(encode(beat))
    assert decoded.running == beat.running and decoded.waiting == beat.waiting
    assert all(type(item) is RequestProgress for item in decoded.running)
    assert decoded.running == tuple(RequestProgress.from_list(item.to_list()) for item in beat.running)


@pytest.mark.parametrize("entry, message", [
    (["r1", 10, 5, -1, 3, 4], "counts must be ints"),
    (["r1", 10, 5, 1, 3], "6-, 8- or 9-element lists"),
    (["", 10, 5, 1, 3, 4], "request ids must be strings"),
    (["r1", 10, 5, 2**31, 3, 4], "counts must be ints"),
    (["r1", 10, 5, True, 3, 4], "counts must be ints"),
    (["r1", 10, 5, 1, 3, 4, "x", None], "counts must be ints"),
    (["r1", 10, 5, 1, 3, 4, None, None, ""], "the adapter must be None or a name"),
    (["r1", 10, 5, 1, 3, 4, None, None, 7], "the adapter must be None or a name"),
    (["r1", 10, 5, 1, 3, 4, None, None, "x" * 257], "the adapter must be None or a name"),
    ("r1", "6-, 8- or 9-element lists"),
    (None, "6-, 8- or 9-element lists"),  # no len(): refused, not a TypeError
    (7, "6-, 8- or 9-element lists"),
])
def test_a_bad_entry_is_refused_naming_its_list(entry: object, message: str) -> None:
    data = make_heartbeat("a", running=progress(3)).to_map()
    data["waiting"] = [item.to_list() for item in progress(2)] + [entry]
    with pytest.raises(ValidationError, match=message) as caught:
        decode_heartbeat(pack_map(data))
    assert caught.value.field == "waiting"


def test_an_entry_names_its_adapter_only_when_it_has_one() -> None:
    """The no-adapter entries keep their six or eight values; one with an adapter has nine,
    and a beat mixing all three decodes (fast path) as entry by entry does."""
    plain, refined = progress(1)[0], progress(1, refined=True)[0]
    with_adapter = plain._replace(request_id="r9", lora_adapter="sql")
    assert (len(plain.to_list()), len(refined.to_list()), len(with_adapter.to_list())) == (6, 8, 9)
    assert with_adapter.to_list()[4:] == [300, 600, None, None, "sql"]
    beat = make_heartbeat("a", running=(plain, with_adapter), waiting=(refined._replace(request_id="r8"),))
    decoded = decode_heartbeat(encode(beat))
    assert decoded.running == beat.running and decoded.running[1].lora_adapter == "sql"
    assert decoded.waiting[0].lora_adapter is None
    assert RequestProgress.from_list(with_adapter.to_list()) == with_adapter


def test_the_fleet_decoder_checks_an_engine_model_when_it_changes() -> None:
    decoder = HeartbeatDecoder()
    good = make_heartbeat("a").to_map()
    assert decoder.decode(pack_map(good)).engine_config == good["engine_config"]
    assert decoder.decode(pack_map({**good, "seq": 2})).seq == 2  # unchanged: not checked again
    bad = {**good, "seq": 3, "engine_config": {**good["engine_config"], "block_size": float("inf")}}
    with pytest.raises(ValidationError, match="engine_config"):
        decoder.decode(pack_map(bad))
    with pytest.raises(ValidationError, match="engine_config"):  # still refused: it never passed
        decoder.decode(pack_map({**bad, "seq": 4}))
    other = {**good, "instance_id": "b", "engine_config": bad["engine_config"]}
    with pytest.raises(ValidationError, match="engine_config"):  # another instance's model is its own
        decoder.decode(pack_map(other))


def test_the_fleet_decoder_passes_an_unchanged_engine_model_on_as_the_same_objects() -> None:
    decoder = HeartbeatDecoder()
    good = make_heartbeat("a").to_map()
    first = decoder.decode(pack_map(good))
    second = decoder.decode(pack_map({**good, "seq": 2}))
    assert second.engine_config is first.engine_config and second.latency_model is first.latency_model
    changed = {**good, "seq": 3, "engine_config": {**good["engine_config"], "max_num_seqs": 7}}
    third = decoder.decode(pack_map(changed))
    assert third.engine_config == changed["engine_config"] and third.engine_config is not first.engine_config
    assert decoder.decode(pack_map({**changed, "seq": 4})).engine_config is third.engine_config
    assert decoder.decode(pack_map({**good, "instance_id": "b"})).engine_config is not first.engine_config
