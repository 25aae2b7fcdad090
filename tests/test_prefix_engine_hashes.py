"""Prefix hashes the engine's way: prompts hashed with the served model's tokenizer and the
engine's block size, vLLM's KV events turned into the same hashes, the dispatcher's index
fed from them, and hits predicted only where the scheme matches."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from blockq.config import ConfigError, Settings
from blockq.text.block_hashes import PrefixScheme, block_hashes, prompt_block_hashes
from blockq.text.model_tokenizer import (
    PROJECT_TOKENIZER,
    served_tokenizer_id,
    tokenizer_fingerprint,
)
from blockq.wire.beats import Heartbeat
from blockq.wire.protocol import Assignment, FinalRecord
from dispatcher.core import DispatcherCore, Placed
from tests.factories import make_heartbeat, make_request
from workers.engines.base import EngineStepOutput
from workers.engines.kv_events import KvEventFeed, KvEventMirror
from workers.heartbeat import HeartbeatBuilder

BLOCK = 4
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory with a tiny word-level tokenizer that adds BOS, as Llama's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{word: 3 + i for i, word in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    directory = tmp_path_factory.mktemp("model")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return directory


def test_prompts_are_hashed_with_the_models_tokenizer_and_block_size(model_dir: Path) -> None:
    scheme = PrefixScheme(BLOCK, str(model_dir))
    assert scheme.encode(["the cat sat on a mat and"]) == [[1, 3, 4, 5, 6, 7, 8, 9]]  # BOS first
    (hashes,) = prompt_block_hashes(["the cat sat on a mat and"], scheme)
    assert hashes == block_hashes([1, 3, 4, 5, 6, 7, 8, 9], BLOCK) and len(hashes) == 2
    assert prompt_block_hashes([(1, 3, 4, 5, 6)], scheme) == [block_hashes([1, 3, 4, 5, 6], BLOCK)]
    assert scheme.tokenizer_id == tokenizer_fingerprint(model_dir) == served_tokenizer_id(str(model_dir))
    assert scheme.tokenizer_id.startswith("sha256:") and PrefixScheme().tokenizer_id == PROJECT_TOKENIZER
    assert served_tokenizer_id(None) == served_tokenizer_id("/nonexistent") == "unknown"


def test_settings_validate_the_scheme_at_start_up(model_dir: Path, tmp_path: Path) -> None:
    settings = Settings.from_env({"BLOCKQ_PREFIX_TOKENIZER": str(model_dir), "BLOCKQ_PREFIX_BLOCK_TOKENS": "32"})
    assert settings.prefix_scheme == PrefixScheme(32, str(model_dir))
    with pytest.raises(ConfigError, match="prefix_tokenizer: .*no tokenizer files"):
        Settings.from_env({"BLOCKQ_PREFIX_TOKENIZER": str(tmp_path)})
    with pytest.raises(ConfigError, match="prefix_block_tokens: must be between 16 and 4096"):
        Settings.from_env({"BLOCKQ_PREFIX_BLOCK_TOKENS": "8"})


def _stored(hashes: list[int], tokens: list[int], parent: int | None, **extra: object) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None, **extra}


def test_kv_events_become_the_hashes_a_prompt_of_the_same_tokens_has() -> None:
    tokens = list(range(1, 13))  # three blocks
    mirror = KvEventMirror(BLOCK)
    noted: dict[int, bool] = {}
    # vLLM stores the prompt's first two blocks, then a third (an output block) chained to them.
    mirror.apply([_stored([901, 902], tokens[:8], None), _stored([903], tokens[8:], 902)], noted)
    assert list(noted) == list(block_hashes(tokens, BLOCK)) and all(noted.values())
    # Removals by vLLM's hash; a block whose parent was never seen is skipped, not guessed;
    # so are LoRA blocks, other tiers, partial blocks and garbage.
    noted = {}
    mirror.apply([{"type": "BlockRemoved", "block_hashes": [903], "medium": "GPU"},
                  _stored([950], [5, 5, 5, 5], 777), _stored([951], [5, 5, 5, 5], None, lora_name="ad"),
                  _stored([952], [5, 5, 5, 5], None, medium="CPU"), _stored([953], [5, 5], None),
                  "junk", {"type": "BlockStored", "block_hashes": "x"}, {"type": None}], noted)
    assert noted == {block_hashes(tokens, BLOCK)[2]: False}
    assert mirror.num_skipped_blocks == 4  # 950, 951, 952, 953 (the malformed one names no block)
    noted = {}
    mirror.apply([{"type": "AllBlocksCleared"}], noted)
    assert sorted(noted) == sorted(block_hashes(tokens, BLOCK)[:2]) and not any(noted.values())


def test_the_feed_reads_vllms_wire_format_and_nets_each_blocks_latest_event() -> None:
    feed = KvEventFeed(BLOCK)
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.bind(feed.publish_endpoint)
    try:
        tokens = [1, 2, 3, 4, 5, 6, 7, 8]
        batch = [time.time(), [_stored([11, 12], tokens, None), {"type": "BlockRemoved", "block_hashes": [12],
                                                                "medium": "GPU"}], None]
        deadline = time.monotonic() + 5
        cached: list[int] = []
        evicted: list[int] = []
        while not cached and time.monotonic() < deadline:  # PUB drops until the subscription arrives
            publisher.send_multipart([b"", (0).to_bytes(8, "big"), msgpack.packb(batch)])
            publisher.send_multipart([b"", (1).to_bytes(8, "big"), b"\xc1 not msgpack"])
            time.sleep(0.05)
            cached, evicted = feed.drain()
        first, second = block_hashes(tokens, BLOCK)
        assert cached == [first] and evicted == [second]
        assert feed.num_bad_messages >= 1
    finally:
        publisher.close(linger=0)
        feed.close()


class _Engine:
    """The little a heartbeat builder reads from an engine."""

    model, preset, time_scale = "m", "p", 1.0

    def progress(self):  # noqa: ANN201
        return [], [], 0

    def model_time_s(self) -> float:
        return 0.0

    def state_time_s(self) -> float:
        return 0.0

    def engine_config(self) -> dict:
        return {}

    def latency_model(self) -> None:
        return None

    def engine_stats(self) -> dict:
        return {}


def test_a_beat_carries_each_blocks_latest_event_and_survives_the_wire() -> None:
    builder = HeartbeatBuilder("a", _Engine())  # type: ignore[arg-type]
    builder.record_step(EngineStepOutput((), (), 0.0, cached_block_hashes=(1, 2, 3), evicted_block_hashes=(4,)))
    builder.record_step(EngineStepOutput((), (), 0.0, cached_block_hashes=(4,), evicted_block_hashes=(2,)))
    beat = builder.build("live", [])
    assert beat.cached_block_hashes == (1, 3, 4) and beat.evicted_block_hashes == (2,)
    decoded = Heartbeat.from_map(beat.to_map())
    assert decoded.evicted_block_hashes == (2,) and decoded.cached_block_hashes == (1, 3, 4)
    assert builder.build("live", []).evicted_block_hashes == ()


def _beat(instance_id: str, **config: object) -> Heartbeat:
    beat = make_heartbeat(instance_id, sent_at_s=time.time())
    return dataclasses.replace(beat, engine_config={**beat.engine_config, "enable_prefix_caching": True, **config})


def test_hits_are_predicted_where_the_scheme_matches_and_evictions_are_forgotten(model_dir: Path) -> None:
    scheme = PrefixScheme(32, str(model_dir))
    core = DispatcherCore("block", seed=0, slo_ttft_ms=None, prefix_scheme=scheme)
    now_s = time.time()
    shared = tuple(range(100, 132))  # 32 blocks of 32 tokens: a 1,024-token prompt
    core.apply_heartbeat(dataclasses.replace(
        _beat("vllm", block_size=32, prefix_tokenizer=scheme.tokenizer_id), cached_block_hashes=shared), now_s)
    core.apply_heartbeat(dataclasses.replace(_beat("other-tokenizer", block_size=32, prefix_tokenizer="sha256:0"),
                                             cached_block_hashes=shared), now_s)
    core.apply_heartbeat(_beat("emulated", block_size=16), now_s)
    assert core.view.instances["other-tokenizer"].prefix_index is None
    assert core.view.instances["emulated"].prefix_index is None
    request = dataclasses.replace(make_request(" ".join(["w"] * 1024), max_tokens=64, predicted=50),
                                  prompt_block_hashes=shared)
    (outcome,) = core.place([request], now_s)
    assert isinstance(outcome, Placed) and outcome.request.assignment is not None
    assert outcome.request.assignment.instance_id == "vllm"
    assert outcome.request.assignment.predicted_cached_tokens == 1023
    # The engine evicts the second half: the next request's hit stops at the first half.
    core.apply_heartbeat(dataclasses.replace(
        _beat("vllm", block_size=32, prefix_tokenizer=scheme.tokenizer_id), seq=2, evicted_block_hashes=shared[16:],
        sent_at_s=time.time()), time.time())
    index = core.view.instances["vllm"].prefix_index
    assert index is not None and index.cached_prefix_blocks(shared) == 16


def test_the_placement_and_final_record_carry_predicted_and_measured_hits() -> None:
    assignment = Assignment("a", "block", 1.0, 0.5, 10.0, 20.0, predicted_cached_tokens=96)
    assert Assignment.from_map(assignment.to_map()).predicted_cached_tokens == 96
    final = FinalRecord("r", 1, "ok", "x", 1, 100, "a", "stop", cached_tokens=64, predicted_cached_tokens=96)
    decoded = FinalRecord.from_map(final.to_map())
    assert (decoded.cached_tokens, decoded.predicted_cached_tokens) == (64, 96)
