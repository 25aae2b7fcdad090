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
    (["r1", 10, 5, 1, 3], "6- or 8-element lists"),
    (["", 10, 5, 1, 3, 4], "request ids must be strings"),
    (["r1", 10, 5, 2**31, 3, 4], "counts must be ints"),
    (["r1", 10, 5, True, 3, 4], "counts must be ints"),
    (["r1", 10, 5, 1, 3, 4, "x", None], "counts must be ints"),
    ("r1", "6- or 8-element lists"),
])
def test_a_bad_entry_is_refused_naming_its_list(entry: object, message: str) -> None:
    data = make_heartbeat("a", running=progress(3)).to_map()
    data["waiting"] = [item.to_list() for item in progress(2)] + [entry]
    with pytest.raises(ValidationError, match=message) as caught:
        decode_heartbeat(pack_map(data))
    assert caught.value.field == "waiting"


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
