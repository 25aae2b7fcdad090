"""Output blocks in the prefix cache: an engine caches a block once it is full, prompt or
output (as vLLM does), so a conversation's next turn, whose prompt repeats the answer, finds
the answer's blocks; the beats name them, and the dispatcher's index learns them."""

from __future__ import annotations

import dataclasses
import time

import pytest

from blockq.engine_model import EngineScheduler
from blockq.frontdoors.gateway.chat_template import render_plain
from blockq.frontdoors.gateway.openai_requests import ChatMessage
from blockq.text.block_hashes import (
    PREFIX_BLOCK_TOKENS,
    answer_block_hashes,
    continued_block_hashes,
    prompt_block_hashes,
    prompt_token_ids,
)
from blockq.wire.beats import RequestProgress, decode_heartbeat
from blockq.wire.protocol import ValidationError, encode
from dispatcher.core import DispatcherCore
from dispatcher.instance_view import InstanceView
from dispatcher.replica import InstanceReplica
from loadgen.simulation.prefix_report import ideal_prefix_hit_rate
from tests.factories import make_heartbeat, make_request
from tests.test_engine_model_scheduler import add, make_scheduler, step
from workers.engines.base import EngineRequestSpec
from workers.engines.emulated import EmulatedEngine, EmulatedEngineOptions
from workers.heartbeat import HeartbeatBuilder


def _run_to_end(scheduler: EngineScheduler) -> None:
    while scheduler.has_unfinished_requests:
        step(scheduler)


def test_blocks_filled_by_the_output_are_cached_and_hit_by_a_prompt_that_repeats_it() -> None:
    # Block size 4: a 6-token prompt and 7 output tokens. The last output token's KV is
    # never computed, so 12 tokens are: 3 full blocks, 1 of them wholly the prompt's.
    sequence_hashes = (11, 12, 13)
    expected = {(11,): 14 - 4, sequence_hashes: 14 - 12}
    for hashes, expected_prefill in expected.items():
        scheduler = make_scheduler(block_size=4, num_gpu_blocks=32, max_model_len=64, enable_prefix_caching=True)
        add(scheduler, "turn-1", 6, 7, prefix_block_hashes=hashes)
        _run_to_end(scheduler)
        assert scheduler.num_used_blocks == 0  # freed, but cached
        # The next turn's 14-token prompt starts with turn 1's 13 tokens.
        add(scheduler, "turn-2", 14, 1, prefix_block_hashes=sequence_hashes)
        assert step(scheduler).num_prefill_tokens == expected_prefill


def test_an_output_block_is_cached_once_the_step_that_fills_it_is_scheduled() -> None:
    """As vLLM caches it (``allocate_slots`` -> ``cache_blocks``): a request admitted later in
    the step whose scheduled tokens fill a block already hits that block; one step before,
    only the blocks already full count."""
    scheduler = make_scheduler(block_size=4, num_gpu_blocks=32, max_model_len=64, enable_prefix_caching=True)
    add(scheduler, "turn-1", 6, 7, prefix_block_hashes=(11, 12, 13))
    step(scheduler)  # the prefill: 6 tokens computed, 1 block full
    probe = scheduler.clone()
    add(probe, "probe", 14, 1, prefix_block_hashes=(11, 12, 13))
    assert step(probe).num_prefill_tokens == 14 - 4  # turn-1's decode schedules token 7: block 2 not full
    step(scheduler)  # one decode: 7 computed
    add(scheduler, "probe", 14, 1, prefix_block_hashes=(11, 12, 13))
    assert step(scheduler).num_prefill_tokens == 14 - 8  # turn-1's decode, scheduled first, fills block 2


# --- the emulated engine and its beats -------------------------------------------------------

QUESTION = "Explain how a hash table handles collisions, with an example in Python."
ANSWER = ("A hash table maps each key to a bucket by its hash. When two keys land in the same "
          "bucket, the table either chains them in a list or probes for another free slot. "
          "In Python, dict uses open addressing: it probes a pseudo-random sequence of slots "
          "until it finds the key or an empty one. ") * 3


def _turn_prompt(history: list[str], message: str) -> str:
    roles = ("user", "assistant")
    messages = [ChatMessage(role=roles[i % 2], content=text) for i, text in enumerate(history)]
    return render_plain([*messages, ChatMessage(role="user", content=message)])


def _serve(engine: EmulatedEngine, now: list[float], spec: EngineRequestSpec) -> tuple[int, ...]:
    """Run one request to its end on an idle engine; the output blocks reported cached."""
    engine.add_request(spec)
    cached: list[int] = []
    while engine.has_unfinished_requests():
        result = engine.start_step()
        assert result is not None
        now[0] = engine.step_end_wall_s(result)
        cached.extend(engine.finish_step(result).cached_block_hashes)
    return tuple(cached)


@pytest.mark.parametrize("stream_tokens", [True, False])
def test_the_emulated_engine_caches_a_recorded_answer_and_the_next_turn_hits_it(stream_tokens: bool) -> None:
    now = [0.0]
    engine = EmulatedEngine(EmulatedEngineOptions(noise_sigma=0.0, stream_tokens=stream_tokens,
                                                  config_overrides=(("enable_prefix_caching", True),)),
                            clock=lambda: now[0])
    first_prompt = _turn_prompt([], QUESTION)
    (first_hashes,) = prompt_block_hashes([first_prompt])
    full = answer_block_hashes(first_prompt, ANSWER)
    num_prompt_tokens = len(prompt_token_ids(first_prompt))
    num_answer_tokens = 80  # of the answer's ~200: the engine stops there
    cached = _serve(engine, now, EngineRequestSpec(
        "turn-1", first_prompt, num_prompt_tokens, max_tokens=num_answer_tokens, true_output_tokens=num_answer_tokens,
        prefix_block_hashes=first_hashes, output_text=ANSWER))
    num_full = (num_prompt_tokens + num_answer_tokens - 1) // PREFIX_BLOCK_TOKENS
    assert cached == full[len(first_hashes):num_full] and len(cached) >= 4
    # The next turn's prompt repeats the first and its (whole) answer.
    second_prompt = _turn_prompt([QUESTION, ANSWER], "And how does it resize?")
    (second_hashes,) = prompt_block_hashes([second_prompt])
    assert second_hashes[:num_full] == full[:num_full]  # the tokenizations agree
    hits_before = engine.engine_stats()["prefix_cache_hits_total"]
    _serve(engine, now, EngineRequestSpec("turn-2", second_prompt, len(prompt_token_ids(second_prompt)),
                                          max_tokens=4, true_output_tokens=4, prefix_block_hashes=second_hashes))
    assert engine.engine_stats()["prefix_cache_hits_total"] - hits_before == num_full * PREFIX_BLOCK_TOKENS


def test_an_answer_tokenized_otherwise_keeps_the_prompts_hashes() -> None:
    hashes = (5, 6, 7)  # not this tokenizer's hashes of the prompt
    assert continued_block_hashes("user: hi\nassistant:", hashes, ANSWER) == hashes
    assert continued_block_hashes("user: hi\nassistant:", hashes, None) == hashes
    assert continued_block_hashes("user: hi\nassistant:", (), ANSWER) == ()


def test_beats_carry_the_cached_output_blocks_once_and_the_protocol_checks_them() -> None:
    now = [0.0]
    engine = EmulatedEngine(EmulatedEngineOptions(noise_sigma=0.0, config_overrides=(("enable_prefix_caching", True),)),
                            clock=lambda: now[0])
    beats = HeartbeatBuilder("gpu0", engine, clock=lambda: now[0])
    prompt = _turn_prompt([], QUESTION)
    (hashes,) = prompt_block_hashes([prompt])
    num_prompt_tokens = len(prompt_token_ids(prompt))
    engine.add_request(EngineRequestSpec("r", prompt, num_prompt_tokens, max_tokens=64, true_output_tokens=64,
                                         prefix_block_hashes=hashes, output_text=ANSWER))
    while engine.has_unfinished_requests():
        result = engine.start_step()
        assert result is not None
        now[0] = engine.step_end_wall_s(result)
        beats.record_step(engine.finish_step(result))
    beat = decode_heartbeat(encode(beats.build("live", ())))
    num_full = (num_prompt_tokens + 64 - 1) // 16
    assert beat.cached_block_hashes == answer_block_hashes(prompt, ANSWER)[len(hashes):num_full]
    assert beats.build("live", ()).cached_block_hashes == ()  # each block is reported once
    bad = {**beat.to_map(), "cached_block_hashes": [1, -2]}
    with pytest.raises(ValidationError, match="cached_block_hashes"):
        decode_heartbeat(encode(bad))


def test_the_dispatchers_index_learns_the_output_blocks_from_beats() -> None:
    core = DispatcherCore("block", seed=0, slo_ttft_ms=None)
    beat = make_heartbeat("a", sent_at_s=time.time())
    beat = dataclasses.replace(beat, engine_config={**beat.engine_config, "enable_prefix_caching": True})
    core.apply_heartbeat(beat, time.time())
    index = core.view.instances["a"].prefix_index
    assert index is not None and index.cached_prefix_blocks((1, 2, 3)) == 0
    core.apply_heartbeat(dataclasses.replace(beat, seq=2, sent_at_s=time.time(), cached_block_hashes=(1, 2, 3)),
                         time.time())
    assert index.cached_prefix_blocks((1, 2, 3, 4)) == 3


def test_the_ideal_hit_rate_counts_blocks_an_earlier_answer_filled() -> None:
    first_prompt = _turn_prompt([], QUESTION)
    second_prompt = _turn_prompt([QUESTION, ANSWER], "And how does it resize?")
    (first_hashes, second_hashes) = prompt_block_hashes([first_prompt, second_prompt])

    def request(prompt: str, hashes: tuple[int, ...], answer: str | None):  # noqa: ANN202
        made = make_request(prompt, max_tokens=2000, predicted=100, true_output_tokens=1000, trace_output_text=answer)
        made = dataclasses.replace(made, prompt_block_hashes=hashes)
        prediction = dataclasses.replace(made.prediction, prompt_tokens=len(hashes) * 16 + 1)
        return dataclasses.replace(made, prediction=prediction)

    with_answer = ideal_prefix_hit_rate([request(first_prompt, first_hashes, ANSWER),
                                         request(second_prompt, second_hashes, None)])
    prompt_only = ideal_prefix_hit_rate([request(first_prompt, first_hashes, None),
                                         request(second_prompt, second_hashes, None)])
    assert with_answer is not None and prompt_only is not None
    total_tokens = (len(first_hashes) + len(second_hashes)) * 16 + 2
    assert prompt_only == pytest.approx(len(first_hashes) * 16 / total_tokens)
    # The whole answer was served (1,000 tokens allowed): turn 2 finds every block up to
    # the one where the answer ends and the new message begins.
    answered = set(answer_block_hashes(first_prompt, ANSWER))
    num_found = next(i for i, block_hash in enumerate(second_hashes) if block_hash not in answered)
    assert num_found > len(first_hashes) + 5
    assert with_answer == pytest.approx(num_found * 16 / total_tokens)


# --- the dispatcher's replicas under sharing --------------------------------------------------


def _prefix_core(*, prefix_caching: bool, num_used_blocks: int) -> tuple[DispatcherCore, InstanceView, InstanceReplica]:
    # Two turns of one conversation run at once: each has 2,400 tokens computed (150 blocks),
    # and the engine holds the first turn's blocks once.
    running = tuple(RequestProgress(f"turn-{i}", 2400, 2400, 1, 200, 400) for i in (1, 2))
    beat = make_heartbeat("a", sent_at_s=time.time(), running=running, num_gpu_blocks=260,
                          num_used_blocks=num_used_blocks)
    beat = dataclasses.replace(beat, engine_config={**beat.engine_config, "enable_prefix_caching": prefix_caching})
    core = DispatcherCore("block", seed=0, slo_ttft_ms=None)
    core.apply_heartbeat(beat, time.time())
    view = core.view.instances["a"]
    return core, view, core.view.replica(view, time.time())


def test_the_replica_credits_blocks_that_running_requests_share() -> None:
    _, _, shared = _prefix_core(prefix_caching=True, num_used_blocks=160)
    assert len(shared.scheduler.running_rows()) == 2 and not shared.scheduler.waiting_rows()
    # (less a block each if the replica already ran their next decode, into block 151)
    assert 260 - 160 - 2 <= shared.scheduler.num_free_blocks <= 260 - 160
    # Without prefix caching nothing is shared: the rows' own blocks (150 + 150 > 260)
    # decide, and the second turn starts over (a recompute), as the engine would make it.
    computed = {}
    for prefix_caching, num_used_blocks in ((True, 160), (False, 150)):
        _, _, replica = _prefix_core(prefix_caching=prefix_caching, num_used_blocks=num_used_blocks)
        scheduler = replica.scheduler
        rows = scheduler.running_rows() + scheduler.waiting_rows()
        computed[prefix_caching] = sorted(scheduler.request(row).num_computed_tokens for row in rows)
    assert computed[True][0] >= 2400 and computed[False][0] <= 512


def test_a_placed_request_keeps_its_predicted_hit_while_it_waits() -> None:
    core, view, replica = _prefix_core(prefix_caching=True, num_used_blocks=160)
    assert view.prefix_index is not None
    hashes = tuple(range(500, 564))  # 64 blocks, all believed cached
    view.prefix_index.record(hashes)
    request = dataclasses.replace(make_request(" ".join(["w"] * 1024), max_tokens=256, predicted=100),
                                  prompt_block_hashes=hashes)
    core.view.record_assignment("a", request)
    assert replica.request_size(request)[0] == 1
    # The next beat shows it waiting, nothing computed: it is still simulated as a hit.
    beat = dataclasses.replace(view.heartbeat, seq=2, sent_at_s=time.time(),
                               waiting=(RequestProgress(request.id, 1024, 0, 0, 100, 200),), num_waiting_total=1)
    core.apply_heartbeat(beat, time.time())
    replica.sync(beat, (), time.time())
    row = replica.scheduler.request_ids.index(request.id)
    assert replica.scheduler.request(row).prompt_tokens == 1
