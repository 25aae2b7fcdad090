"""Remaining-length refinements on their way from a worker's beats to the dispatcher's
replicas: the checkpoint rules, the heartbeat fields, and what a replica simulates."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import redis
from aiohttp.test_utils import TestClient, TestServer

from blockq.config import Settings
from blockq.engine_model import get_preset
from blockq.engine_model.config import EngineConfig
from blockq.text.tokenizer import AnswerTokenizer, get_token_counter
from blockq.wire.beats import Heartbeat, RequestProgress, decode_heartbeat
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.protocol import encode
from blockq.wire.streams import connect_async
from dispatcher.replica import InstanceReplica
from loadgen.simulation.config import SimulationConfig
from loadgen.simulation.precomputed_refinements import refine_sample
from loadgen.simulation.single_run import simulate_run
from loadgen.simulation.workload import annotate_sample, sample_trace
from predictor_service.http_api import HttpAccessOptions, create_app
from predictor_service.models import load_predictor
from predictor_service.models.fast import FastConfig
from predictor_service.models.refine import RefineInput, RefineModel
from predictor_service.models.refine_fit import RefineFitConfig
from predictor_service.refine_api import add_refine_route
from predictor_service.refine_training import RefineTrainOptions, train_refine_file
from predictor_service.training import train
from tests.conftest import wait_until
from tests.factories import list_conversations, make_heartbeat, make_request
from tests.predictor_helpers import StaticSlot
from tests.predictor_synthetic import write_sharegpt
from workers.engines.base import EngineRequestSpec
from workers.engines.emulated import EmulatedEngine, EmulatedEngineOptions
from workers.heartbeat import HeartbeatBuilder
from workers.refine_client import RefinementClient
from workers.refinement import (
    RefinedLength,
    RefinementBook,
    RefinementTable,
    checkpoint_of,
    checkpoints_below,
    with_refinement,
)
from workers.worker import InstanceWorker, WorkerOptions


def test_checkpoints_are_every_n_tokens_below_the_length() -> None:
    assert checkpoint_of(63, 64) == 0 and checkpoint_of(64, 64) == 64 and checkpoint_of(200, 64) == 192
    assert list(checkpoints_below(200, 64)) == [64, 128, 192]
    assert list(checkpoints_below(192, 64)) == [64, 128]  # at 192 it has finished: nothing to refine


def test_the_book_asks_once_per_checkpoint_and_keeps_the_newest_answer() -> None:
    book = RefinementBook(every_tokens=64)
    assert book.due("a", 10) is None
    assert book.due("a", 70) == 64
    book.mark_requested("a", 64)
    assert book.due("a", 100) is None
    assert book.due("a", 130) == 128
    book.record("a", RefinedLength.from_remaining(64, 10, 50, 200))
    assert book.refined("a", 100) == RefinedLength(64, 74, 114, 264)
    assert book.refined("a", 40) is None  # preempted and restarted below the refinement point
    book.mark_requested("a", 128)
    book.record("a", RefinedLength.from_remaining(128, 1, 2, 3))
    book.record("a", RefinedLength.from_remaining(64, 5, 6, 7))  # late answer to an older ask
    assert book.refined("a", 130).at_tokens == 128
    book.record("b", RefinedLength.from_remaining(64, 1, 2, 3))  # never asked: ignored
    assert book.refined("b", 100) is None
    book.forget("a")
    assert book.refined("a", 130) is None and book.due("a", 130) == 128


def test_the_table_answers_with_the_latest_checkpoint_passed() -> None:
    refinements = [RefinedLength(64, 70, 100, 200), RefinedLength(128, 130, 150, 300)]
    table = RefinementTable(64, {"a": refinements})
    assert table.refined("a", 63) is None
    assert table.refined("a", 64) == refinements[0]
    assert table.refined("a", 127) == refinements[0]
    assert table.refined("a", 500) == refinements[1]
    assert table.refined("b", 500) is None


def test_beats_carry_refined_quantiles_and_old_six_field_entries_still_decode() -> None:
    first_guess = RequestProgress("r", 10, 80, 70, 100, 300)
    refined = with_refinement(first_guess, RefinedLength(64, 90, 140, 400))
    assert refined.refined_at_tokens == 64 and refined.predicted_output_tokens == 140
    beat = make_heartbeat("i0", running=(first_guess, refined))
    decoded = decode_heartbeat(encode(beat))
    assert decoded.running == (first_guess, refined)
    assert len(first_guess.to_list()) == 6 and len(refined.to_list()) == 8


def _engine_with_one_request(output_tokens: int) -> EmulatedEngine:
    engine = EmulatedEngine(EmulatedEngineOptions(noise_sigma=0.0, stream_tokens=False))
    engine.add_request(EngineRequestSpec("r", "hello there", 16, 512, true_output_tokens=output_tokens,
                                         predicted_output_tokens=50, p90_tokens=120))
    return engine


def _step_until(engine: EmulatedEngine, num_generated_tokens: int) -> None:
    while True:
        running, _, _ = engine.progress()
        if running and running[0].num_generated_tokens >= num_generated_tokens:
            return
        result = engine.start_step()
        assert result is not None, "the request finished before the asked point"
        engine.finish_step(result)


def test_a_worker_beat_reports_the_latest_refinement_instead_of_the_first_guess() -> None:
    engine = _engine_with_one_request(400)
    table = RefinementTable(64, {"r": [RefinedLength(64, 200, 350, 500), RefinedLength(128, 300, 400, 450)]})
    beats = HeartbeatBuilder("i0", engine, clock=time.time, refinements=table)
    _step_until(engine, 30)
    assert beats.build("live", ()).running[0].refined_at_tokens is None  # below the first checkpoint
    _step_until(engine, 130)
    item = beats.build("live", ()).running[0]
    assert (item.refined_at_tokens, item.p10_tokens, item.predicted_output_tokens, item.p90_tokens) == \
        (128, 300, 400, 450)


def test_a_beat_reports_the_p99_and_the_mean_of_the_recent_step_lags() -> None:
    beats = HeartbeatBuilder("i0", _engine_with_one_request(40), clock=time.time)
    beat = beats.build("live", [0.0] * 98 + [4.0, 96.0])
    assert (beat.lag_p99_ms, beat.lag_mean_ms) == (96.0, 1.0)
    assert (beats.build("live", ()).lag_p99_ms, beats.build("live", ()).lag_mean_ms) == (0.0, 0.0)


def _replica_finish_s(beat: Heartbeat) -> float:
    preset = get_preset("llama2-7b-a30")
    replica = InstanceReplica(EngineConfig(**beat.engine_config), preset.latency_model)
    replica.sync(beat, (), beat.sent_at_s)
    return float(replica.baseline().finished_at_s[0])


def test_a_replica_simulates_a_refined_request_to_its_refined_length() -> None:
    """A request that generated 100 tokens with a first guess of 50 (p90 120) is, by the
    first guess's conditional median, nearly done; refined at 64 tokens to a median of
    900 it has hundreds of steps left, and the replica's forecast says so."""
    sent_at_s = time.time()
    first_guess = RequestProgress("r", 10, 110, 100, 50, 120)
    refined = with_refinement(first_guess, RefinedLength(64, 600, 900, 1500))
    stale_finish_s = _replica_finish_s(make_heartbeat("i0", running=(first_guess,), sent_at_s=sent_at_s))
    refined_finish_s = _replica_finish_s(make_heartbeat("i0", running=(refined,), sent_at_s=sent_at_s))
    step_s = 0.015  # about one decode step of one sequence on this preset
    assert refined_finish_s - stale_finish_s > 500 * step_s


# --- in the simulation ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def list_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A ShareGPT file of numbered lists, and a fast and a refinement model trained on it."""
    root = tmp_path_factory.mktemp("lists")
    data_path = write_sharegpt(root / "lists.json.gz", list_conversations(500))
    train(data_path, "fast", root / "fast", fast_config=FastConfig(num_rounds=30, num_threads=1))
    fit = RefineFitConfig(num_rounds=150, spread_num_rounds=60, min_data_in_leaf=10)
    train_refine_file(data_path, root / "fast", root / "refine", options=RefineTrainOptions(fit=fit))
    return data_path, root / "fast", root / "refine"


@pytest.mark.usefixtures("stdlib_logging")
def test_refined_beats_make_the_dispatchers_forecasts_right(list_models: tuple[Path, Path, Path]) -> None:
    """Answers that announce their length ("Here are 12 tips") from prompts that do not:
    the first guess is blind, the refinement after 64 tokens is not. On one instance near
    its capacity, the dispatcher judging TTFT from first guesses sees long queues that are
    not there (and refuses requests it could serve); with the refined beats its TTFT
    forecasts are several times closer and it refuses fewer."""
    data_path, fast_dir, refine_dir = list_models
    sample = annotate_sample(sample_trace(str(data_path), 300, 1, redraw=True), 1, predictor="fast",
                             predictor_model=str(fast_dir))
    refined = refine_sample(sample, RefineModel.load(refine_dir))
    assert refined.refinements is not None
    assert sum(len(r) for r in refined.refinements.by_request.values()) > 300
    config = SimulationConfig(instances=1, policy="block", seed=1)
    first = simulate_run(config, sample, rate_per_s=9).summary
    with_refinement_ = simulate_run(config, refined, rate_per_s=9).summary
    assert with_refinement_["ttft_prediction_mae_ms"] < 0.5 * first["ttft_prediction_mae_ms"]
    assert with_refinement_["infeasible"] < first["infeasible"]


# --- live: the predictor's POST /refine and a worker asking it -----------------------------


@pytest.fixture
async def refine_server(list_models: tuple[Path, Path, Path]) -> AsyncIterator[tuple[TestServer, RefineModel]]:
    _, fast_dir, refine_dir = list_models
    model = RefineModel.load(refine_dir)
    app = create_app(StaticSlot(load_predictor("fast", str(fast_dir))), get_token_counter())
    add_refine_route(app, model)
    async with TestServer(app) as server:
        yield server, model


def _refine_item(**changes: object) -> dict[str, object]:
    item: dict[str, object] = {"request_id": "r1", "prompt": "Give me tips about jazz.", "prompt_tokens": 8,
                               "first_guess": [40, 120, 300], "generated_tokens": 64,
                               "partial_text": "Here are 25 tips about jazz:\n1. the good idea", "max_tokens": 1000}
    item.update(changes)
    return item


@pytest.mark.usefixtures("stdlib_logging")
async def test_refine_answers_the_models_remaining_quantiles_and_names_bad_fields(
        refine_server: tuple[TestServer, RefineModel]) -> None:
    server, model = refine_server
    async with TestClient(server) as client:
        response = await client.post("/refine", json={"requests": [_refine_item()]})
        assert response.status == 200
        body = await response.json()
        expected = model.predict([RefineInput("Give me tips about jazz.", 8, 40, 120, 300, 64,
                                              "Here are 25 tips about jazz:\n1. the good idea", 1000)])[0]
        assert body["version"] == model.version
        assert body["refinements"] == [{"request_id": "r1", "at_tokens": 64,
                                        "remaining_p10_tokens": expected.p10_tokens,
                                        "remaining_p50_tokens": expected.predicted_output_tokens,
                                        "remaining_p90_tokens": expected.p90_tokens}]
        for bad, field in ((_refine_item(generated_tokens=-1), "requests[0].generated_tokens"),
                           (_refine_item(first_guess=[0, 1, 2]), "requests[0].first_guess"),
                           (_refine_item(colour="red"), "requests[0].colour")):
            response = await client.post("/refine", json={"requests": [_refine_item(), bad]})
            assert response.status == 400
            assert (await response.json())["error"]["field"] == field.replace("[0]", "[1]")


@pytest.mark.usefixtures("stdlib_logging")
async def test_a_worker_asks_for_refinements_and_its_beats_carry_them(
        refine_server: tuple[TestServer, RefineModel], settings: Settings, sync_redis: redis.Redis) -> None:
    server, _ = refine_server
    client = connect_async(settings.redis_url)
    engine = EmulatedEngine(EmulatedEngineOptions(time_scale=0.1, noise_sigma=0.0))
    options = WorkerOptions(stream_interval_ms=0, refine_url=str(server.make_url("")), refine_every_tokens=32)
    worker = InstanceWorker(client, settings, "w-refine", engine, options)
    for _ in range(3):
        request = make_request("Give me tips about bees.", max_tokens=2000, keys=settings.keys, predicted=100,
                               true_output_tokens=1000)
        sync_redis.xadd(settings.keys.instance_queue("w-refine"), {PAYLOAD_FIELD: encode(request)})
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))

    def refined_beat() -> Heartbeat | None:
        raw = sync_redis.hget(settings.keys.instances, "w-refine")
        beat = decode_heartbeat(raw) if raw else None
        return beat if beat and any(r.refined_at_tokens for r in beat.running) else None

    beat = await asyncio.to_thread(wait_until, refined_beat)
    refined = [r for r in beat.running if r.refined_at_tokens]
    assert all(r.refined_at_tokens >= 32 and r.num_generated_tokens >= r.refined_at_tokens for r in refined)
    assert all(r.p10_tokens > r.refined_at_tokens and r.p10_tokens <= r.predicted_output_tokens <= r.p90_tokens
               for r in refined)
    assert worker.refiner is not None and worker.refiner.stats.num_refined >= len(refined)
    assert worker.refiner.stats.num_failed_calls == 0
    stop.set()
    await task
    await client.aclose()


@pytest.mark.usefixtures("stdlib_logging")
async def test_a_worker_sends_the_predictors_token_with_its_refine_calls(
        list_models: tuple[Path, Path, Path]) -> None:
    """A predictor with a bearer token refuses /refine without it (401): the worker's client
    sends the token it was given, and without one its calls fail and are counted."""
    _, fast_dir, refine_dir = list_models
    token = "refine-token-0123456789"
    app = create_app(StaticSlot(load_predictor("fast", str(fast_dir))), get_token_counter(),
                     access=HttpAccessOptions(bearer_token=token))
    add_refine_route(app, RefineModel.load(refine_dir))
    async with TestServer(app) as server:
        for sent, num_refined, num_failed in ((token, 1, 0), (None, 0, 1)):
            book = RefinementBook(32)
            client = RefinementClient(str(server.make_url("")), book, token=sent)
            async with aiohttp.ClientSession() as session:
                assert await client._send(session, [_refine_item()]) is (num_failed == 0)
            assert (client.stats.num_refined, client.stats.num_failed_calls) == (num_refined, num_failed)


def test_the_emulated_engine_streams_a_replayed_answer_token_by_token() -> None:
    answer = "Here are 3 tips about bees:\n1. Plant clover.\n2. Skip sprays 🐝.\n3. Leave water out."
    num_tokens = len(AnswerTokenizer().encode([answer])[0])
    engine = EmulatedEngine(EmulatedEngineOptions(noise_sigma=0.0))
    engine.add_request(EngineRequestSpec("r", "tips about bees", 5, 512, true_output_tokens=num_tokens + 2,
                                         output_text=answer))
    texts = []
    while engine.has_unfinished_requests():
        result = engine.start_step()
        assert result is not None
        texts += [event.text for event in engine.finish_step(result).events]
    assert len(texts) == num_tokens + 2
    assert "".join(texts[:num_tokens]) == answer  # past the recorded answer: filler
