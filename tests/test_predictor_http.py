"""The predictor's HTTP API in-process: /predict single and batched (one model call),
400 naming the field for each kind of invalid input, /healthz, /metrics; the bearer token
(401 without it) and the cap on concurrent model requests (503 with Retry-After), and
their validation at start-up."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import AsyncIterator, Sequence

import pytest
from aiohttp.test_utils import TestClient, TestServer

from blockq.config import ConfigError, Settings
from blockq.text.tokenizer import get_token_counter
from blockq.wire.streams import connect_async
from predictor_service.feedback import FeedbackConsumer, FeedbackOptions
from predictor_service.http_api import (
    API_APP_KEY,
    TOKEN_ENV,
    HttpAccessOptions,
    HttpApiOptions,
    create_app,
    parse_predict_body,
)
from predictor_service.models import LengthPrediction, PredictionInput
from predictor_service.models.fast import FastLengthModel
from predictor_service.quality import QualityMonitor
from predictor_service.serve import add_serve_arguments, http_access_from_args
from predictor_service.stage import PredictorStage
from tests.predictor_helpers import StaticSlot
from tests.test_predictor_stage import make_tiny_fast_model

OPTIONS = HttpApiOptions(max_prompts=8, max_body_bytes=4096, max_prompt_chars=1000, max_max_tokens=2048)


class CountingPredictor:
    """Wraps a predictor and records the size of every model call."""

    def __init__(self, inner: FastLengthModel) -> None:
        self.inner = inner
        self.backend = inner.backend
        self.version = inner.version
        self.call_sizes: list[int] = []

    def predict(self, inputs: Sequence[PredictionInput]) -> list[LengthPrediction]:
        self.call_sizes.append(len(inputs))
        return self.inner.predict(inputs)


@pytest.fixture(scope="module")
def tiny_model() -> FastLengthModel:
    return make_tiny_fast_model()


@pytest.fixture
async def api(tiny_model: FastLengthModel) -> AsyncIterator[TestClient]:
    app = create_app(StaticSlot(CountingPredictor(tiny_model)), get_token_counter(), options=OPTIONS)
    async with TestClient(TestServer(app)) as client:
        yield client


async def test_predict_one_prompt(api: TestClient, tiny_model: FastLengthModel) -> None:
    prompt = "List 10 ideas related to chess."
    response = await api.post("/predict", json={"prompt": prompt, "max_tokens": 512})
    assert response.status == 200
    body = await response.json()
    (expected,) = tiny_model.predict([PredictionInput(prompt, body["prompt_tokens"], 512)])
    assert body["prompt_tokens"] == get_token_counter().count([prompt])[0]
    assert body["predicted_output_tokens"] == expected.predicted_output_tokens
    assert (body["p10_tokens"], body["p90_tokens"]) == (expected.p10_tokens, expected.p90_tokens)
    assert body["predictor_version"] == tiny_model.version and body["backend"] == "fast"


async def test_predict_batch_is_one_model_call_in_order(api: TestClient) -> None:
    prompts = ["Explain coffee in one sentence.", "Write a short text about jazz music in 250 words.",
               "List 3 ideas related to the moon.", "Briefly, what is chess?"]  # fmt: skip
    response = await api.post("/predict", json={"prompts": prompts, "max_tokens": 30})
    assert response.status == 200
    body = await response.json()
    predictions = body["predictions"]
    assert len(predictions) == 4 and body["backend"] == "fast" and body["predictor_version"]
    assert [p["prompt_tokens"] for p in predictions] == get_token_counter().count(prompts)
    assert all(1 <= p["p10_tokens"] <= p["predicted_output_tokens"] <= p["p90_tokens"] <= 30
               for p in predictions)  # fmt: skip
    predictor = api.server.app[API_APP_KEY].slot.predictor
    assert predictor.call_sizes == [4]
    # The short answer is predicted shorter than the 250-word one (before the cap).
    uncapped = await (await api.post("/predict", json={"prompts": prompts[:2]})).json()
    first, second = uncapped["predictions"]
    assert first["predicted_output_tokens"] < second["predicted_output_tokens"]


@pytest.mark.parametrize(("body", "field"), [
    (b"{not json", "body"),
    (b"[1, 2]", "body"),
    (json.dumps({"max_tokens": 5}).encode(), "prompt"),
    (json.dumps({"prompt": ""}).encode(), "prompt"),
    (json.dumps({"prompt": 7}).encode(), "prompt"),
    (json.dumps({"prompt": "x" * 1001}).encode(), "prompt"),
    (json.dumps({"prompt": "a", "prompts": ["b"]}).encode(), "prompt"),
    (json.dumps({"prompts": []}).encode(), "prompts"),
    (json.dumps({"prompts": "one"}).encode(), "prompts"),
    (json.dumps({"prompts": ["ok", ""]}).encode(), "prompts[1]"),
    (json.dumps({"prompts": ["p"] * 9}).encode(), "prompts"),
    (json.dumps({"prompt": "x", "max_tokens": "10"}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": 1.5}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": True}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": 2049}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x", "num_turns": 0}).encode(), "num_turns"),
    (json.dumps({"prompt": "x", "temperature": 1}).encode(), "temperature"),
    (json.dumps({"prompts": ["y" * 900] * 5}).encode(), "body"),
])  # fmt: skip
async def test_invalid_input_is_400_naming_the_field(api: TestClient, body: bytes, field: str) -> None:
    response = await api.post("/predict", data=body, headers={"Content-Type": "application/json"})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["field"] == field and error["message"].startswith(field)


def test_body_limit_is_checked_before_parsing() -> None:
    with pytest.raises(ValueError, match="body"):
        parse_predict_body(b" " * 5000, OPTIONS)


async def test_oversized_chunked_body_is_400(api: TestClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the limit applies while reading
        for _ in range(10):
            yield b" " * 1000

    response = await api.post("/predict", data=chunks())
    assert response.status == 400 and (await response.json())["error"]["field"] == "body"


async def test_healthz(api: TestClient, tiny_model: FastLengthModel) -> None:
    response = await api.get("/healthz")
    assert response.status == 200
    assert await response.json() == {"ok": True, "backend": "fast", "version": tiny_model.version}


async def test_metrics_name_every_figure(settings: Settings, tiny_model: FastLengthModel) -> None:
    client = connect_async(settings.redis_url)
    stage = PredictorStage(client, settings, tiny_model, get_token_counter())
    monitor = QualityMonitor(validation_acc50=0.5, model_version=tiny_model.version)
    feedback = FeedbackConsumer(client, settings, monitor, served_versions=stage.served_versions,
                                consumer_name="feedback-test", options=FeedbackOptions())  # fmt: skip
    app = create_app(stage, get_token_counter(), options=OPTIONS, stage=stage, feedback=feedback)
    async with TestClient(TestServer(app)) as api:
        await api.post("/predict", json={"prompts": ["a?", "b?", "c?"]})
        await api.post("/predict", json={"prompt": ""})
        response = await api.get("/metrics")
        assert response.status == 200 and response.content_type == "text/plain"
        text = await response.text()
    await client.aclose()
    for name in ("blockq_predictor_model_info", "blockq_predictor_predictions_total",
                 "blockq_predictor_batch_size_bucket", "blockq_predictor_http_responses_total",
                 "blockq_predictor_dead_letters_total", "blockq_predictor_rolling_mae_tokens",
                 "blockq_predictor_rolling_acc50_ratio", "blockq_predictor_rolling_acc100_ratio",
                 "blockq_predictor_prompt_drift_psi", "blockq_predictor_alerts_total",
                 "blockq_predictor_feedback_records_total"):  # fmt: skip
        assert f"# TYPE {name.removesuffix('_bucket')} " in text and name in text
    assert f'blockq_predictor_model_info{{backend="fast",version="{tiny_model.version}"}} 1' in text
    assert 'blockq_predictor_predictions_total{source="http"} 3' in text
    assert 'blockq_predictor_batch_size_bucket{le="2",source="http"} 0' in text
    assert 'blockq_predictor_batch_size_bucket{le="4",source="http"} 1' in text
    assert 'blockq_predictor_http_responses_total{code="400"} 1' in text
    assert "blockq_predictor_rolling_mae_tokens NaN" in text  # no feedback yet
    assert 'blockq_predictor_alerts_total{kind="accuracy_drop"} 0' in text


# --- access: bearer token and concurrency cap --------------------------------------------------

TOKEN = "tok-0123456789abcdef"


class GatedPredictor(CountingPredictor):
    """Holds every model call until :attr:`release` is set (calls run in worker threads)."""

    def __init__(self, inner: FastLengthModel) -> None:
        super().__init__(inner)
        self.release = threading.Event()
        self.num_waiting = 0

    def predict(self, inputs: Sequence[PredictionInput]) -> list[LengthPrediction]:
        self.num_waiting += 1
        self.release.wait(timeout=30)
        return super().predict(inputs)


async def test_a_token_is_required_on_model_routes_only(tiny_model: FastLengthModel) -> None:
    app = create_app(StaticSlot(CountingPredictor(tiny_model)), get_token_counter(), options=OPTIONS,
                     access=HttpAccessOptions(bearer_token=TOKEN))
    async with TestClient(TestServer(app)) as client:
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}):
            response = await client.post("/predict", json={"prompt": "hi"}, headers=headers)
            assert response.status == 401, headers
            assert response.headers["WWW-Authenticate"] == "Bearer"
            assert (await response.json())["error"]["field"] == "authorization"
        assert (await client.post("/nowhere", json={})).status == 401  # unknown paths reveal nothing
        response = await client.post("/predict", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status == 200
        assert (await client.get("/healthz")).status == 200  # probes carry no token
        metrics = await (await client.get("/metrics")).text()
    assert 'blockq_predictor_http_responses_total{code="401"} 6' in metrics
    assert app[API_APP_KEY].slot.predictor.call_sizes == [1]  # refused requests never reach the model


async def test_past_the_cap_requests_get_503_with_retry_after(tiny_model: FastLengthModel) -> None:
    predictor = GatedPredictor(tiny_model)
    app = create_app(StaticSlot(predictor), get_token_counter(), options=OPTIONS,
                     access=HttpAccessOptions(max_concurrent_requests=2, retry_after_s=3))
    async with TestClient(TestServer(app)) as client:
        held = [asyncio.create_task(client.post("/predict", json={"prompt": f"q{i}"})) for i in range(2)]
        try:
            for _ in range(500):  # both in the model (polling a deadline of ~5 s)
                if predictor.num_waiting == 2:
                    break
                await asyncio.sleep(0.01)
            assert predictor.num_waiting == 2
            response = await client.post("/predict", json={"prompt": "one too many"})
            assert response.status == 503 and response.headers["Retry-After"] == "3"
            assert (await response.json())["error"]["field"] == "concurrency"
            assert (await client.get("/healthz")).status == 200  # not capped
        finally:
            predictor.release.set()
            responses = await asyncio.gather(*held)
        assert [r.status for r in responses] == [200, 200]
        assert (await client.post("/predict", json={"prompt": "after"})).status == 200  # slots freed
        assert app[API_APP_KEY].num_in_flight == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"bearer_token": "CHANGE-ME"}, "placeholder"),
    ({"bearer_token": "change-me"}, "placeholder"),
    ({"bearer_token": "short"}, "at least 16"),
    ({"bearer_token": "has a space 0123456789"}, "printable"),
    ({"bearer_token": ""}, "at least 16"),
    ({"max_concurrent_requests": 0}, "max_concurrent_requests"),
    ({"retry_after_s": 0}, "retry_after_s"),
])  # fmt: skip
def test_access_options_are_validated(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HttpAccessOptions(**kwargs)  # type: ignore[arg-type]
    assert TOKEN not in repr(HttpAccessOptions(bearer_token=TOKEN))


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_start_up_builds_and_checks_the_access_options() -> None:
    assert http_access_from_args(_serve_args(), {}) is None  # no HTTP port, nothing to check
    access = http_access_from_args(_serve_args("--http-port", "8080", "--http-max-concurrent", "4"), {TOKEN_ENV: TOKEN})
    assert access == HttpAccessOptions(bearer_token=TOKEN, max_concurrent_requests=4)
    assert http_access_from_args(_serve_args("--http-port", "8080"), {}) == HttpAccessOptions()  # loopback
    with pytest.raises(ConfigError, match=f"^{TOKEN_ENV}: .*placeholder"):
        http_access_from_args(_serve_args("--http-port", "8080"), {TOKEN_ENV: "CHANGE-ME"})
    with pytest.raises(ConfigError, match="^--http-max-concurrent: "):
        http_access_from_args(_serve_args("--http-port", "8080", "--http-max-concurrent", "0"), {})
    public = ("--http-port", "8080", "--http-host", "0.0.0.0")
    with pytest.raises(ConfigError, match=f"^--http-host: .*{TOKEN_ENV}"):
        http_access_from_args(_serve_args(*public), {})
    assert http_access_from_args(_serve_args(*public), {TOKEN_ENV: TOKEN}).bearer_token == TOKEN
    assert http_access_from_args(_serve_args(*public, "--http-allow-unauthenticated"), {}).bearer_token is None
