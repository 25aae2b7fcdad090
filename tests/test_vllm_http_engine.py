"""The ``vllm-http`` engine: a worker driving a running ``vllm serve`` over its OpenAI API
(docs/engines.md, "Existing vLLM servers").

The parsing of vLLM's metrics and streamed chunks runs in the default suite; the tests
marked ``vllm`` start a real ``vllm serve`` on the tiny model (``BLOCKQ_REQUIRE_VLLM=1
.venv-vllm/bin/python -m pytest -q -m vllm -s tests/test_vllm_http_engine.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from blockq.local.embedded_redis import free_port
from blockq.local.state import ClusterState
from tests.conftest import import_or_skip, run_blockq, write_tiny_model
from tests.vllm_helpers import check_base_model_served, vllm_serve
from workers.engines.base import EngineRequestSpec
from workers.engines.vllm_http import ServerMetrics, VllmHttpEngine, VllmHttpOptions, served_models

METRICS_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 4.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 640.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 128.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",engine="0",num_gpu_blocks="512"} 1.0
"""


def test_server_metrics_parse_vllms_names() -> None:
    metrics = ServerMetrics.parse(METRICS_TEXT)
    assert (metrics.num_running, metrics.num_waiting, metrics.kv_cache_usage) == (3, 2, 0.25)
    assert (metrics.num_preemptions_total, metrics.prefix_cache_queries_total,
            metrics.prefix_cache_hits_total) == (4, 640, 128)
    assert metrics.cache_config["num_gpu_blocks"] == "512" and metrics.cache_config["block_size"] == "32"


# vLLM keeps a series of its LoRA gauge for every label set it has set; the value is when.
LORA_METRICS_TEXT = """\
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,poems",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="poems",waiting_lora_adapters="sql"} 1.7000001e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.6e9
"""

# /v1/models of `vllm serve --served-model-name tiny --lora-modules sql=/a/sql,poems=/a/poems`
MODEL_CARDS = [{"id": "tiny", "root": "/m/tiny", "parent": None, "max_model_len": 1024},
               {"id": "sql", "root": "/a/sql", "parent": "tiny", "max_model_len": None},
               {"id": "poems", "root": "/a/poems", "parent": "tiny", "max_model_len": None}]


def test_server_metrics_parse_the_newest_lora_info() -> None:
    assert ServerMetrics.parse(METRICS_TEXT).max_loras == 0  # the server has not set it (or has no LoRA)
    metrics = ServerMetrics.parse(METRICS_TEXT + LORA_METRICS_TEXT)
    assert (metrics.max_loras, metrics.running_lora_adapters, metrics.waiting_lora_adapters) == (2, ("poems",), ("sql",))
    assert metrics.num_running == 3  # the rest as before


def test_served_models_are_the_base_and_its_adapters() -> None:
    base, adapters = served_models(MODEL_CARDS)
    assert base["id"] == "tiny" and adapters == ("sql", "poems")
    assert served_models(MODEL_CARDS[:1]) == (MODEL_CARDS[0], ())
    # an adapter entry naming its base model in root rather than parent
    assert served_models([{"id": "tiny", "root": "tiny"}, {"id": "sql", "root": "tiny"}])[1] == ("sql",)
    # `--served-model-name tiny small`: a second name of the base model, not an adapter
    alias = {"id": "small", "root": "/m/tiny", "parent": None, "max_model_len": 1024}
    assert served_models([MODEL_CARDS[0], alias, *MODEL_CARDS[1:]]) == (MODEL_CARDS[0], ("sql", "poems"))


@contextlib.contextmanager
def _stub_server(metrics_text: str) -> Iterator[tuple[str, list[dict]]]:
    """A stand-in ``vllm serve``: MODEL_CARDS, ``metrics_text`` and completions of one token
    each; its URL and the completion bodies it was sent."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            text = json.dumps({"data": MODEL_CARDS}) if self.path == "/v1/models" else metrics_text
            self._send(text.encode(), "text/plain")

        def do_POST(self) -> None:
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            chunk = {"choices": [{"text": "x", "finish_reason": "length"}], "usage": {"completion_tokens": 1}}
            self._send(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(), "text/event-stream")

        def _send(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_the_engine_publishes_the_servers_adapters_and_names_them_in_completions() -> None:
    from dataclasses import replace

    async def run(engine: VllmHttpEngine, models: list[str | None]) -> list:
        for index, model in enumerate(models):
            engine.add_request(replace(_spec(f"r{index}", 1), model=model))
        events = []
        while engine.has_unfinished_requests():
            events.extend((await engine.step()).events)
        engine.shutdown()
        await asyncio.sleep(0.05)
        return events

    with _stub_server(METRICS_TEXT) as (url, bodies):  # no LoRA gauge yet: the worker's max_loras
        engine = VllmHttpEngine(VllmHttpOptions(url, max_loras=4))
        config = engine.engine_config()
        assert (config["lora_adapters"], config["max_loras"], config["loaded_loras"]) == (["sql", "poems"], 4, [])
        assert engine.engine_config() is config  # unchanged: the same dict
        # the base model by the server's name for it (its id), not its path (root)
        assert engine.model == "tiny" and engine.validate(replace(_spec("x", 1), model="tiny")) is None
        for model in ("gpt-9", "/m/tiny", "vllm:/m/tiny"):
            assert model in (engine.validate(replace(_spec("x", 1), model=model)) or "")
        assert engine.validate(replace(_spec("x", 1), model="sql")) is None
        events = asyncio.run(run(engine, ["sql", "tiny", None, "poems"]))
        assert all(e.finished and e.finish_reason == "length" for e in events) and len(events) == 4
        assert sorted(body["model"] for body in bodies) == ["poems", "sql", "tiny", "tiny"]
        assert engine.engine_config()["loaded_loras"] in (["sql", "poems"], ["poems", "sql"])  # seen streaming
    with _stub_server(METRICS_TEXT + LORA_METRICS_TEXT) as (url, bodies):  # the server's figures win
        engine = VllmHttpEngine(VllmHttpOptions(url, max_loras=4))
        assert engine.engine_config()["max_loras"] == 2 and engine.engine_config()["loaded_loras"] == ["poems"]
        stats = engine.engine_stats()
        assert stats["running_lora_adapters"] == ["poems"] and stats["waiting_lora_adapters"] == ["sql"]


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="url"):
        VllmHttpOptions("localhost:8000")
    with pytest.raises(ValueError, match="max_num_seqs"):
        VllmHttpOptions("http://127.0.0.1:8000", max_num_seqs=0)
    with pytest.raises(ValueError, match="max_loras"):
        VllmHttpOptions("http://127.0.0.1:8000", max_loras=0)


def test_up_runs_one_worker_per_server() -> None:
    from blockq.config import ConfigError
    from blockq.local.cluster_config import ClusterConfig

    config = ClusterConfig().with_overrides(engine="vllm-http", instances=2, vllm_max_num_seqs=16, vllm_max_loras=4,
                                            vllm_urls=("http://10.0.0.1:8000", "http://10.0.0.2:8000"))
    argvs = [config.worker_child(i, i, 1)[1] for i in range(config.num_worker_processes)]
    assert [argv[argv.index("--url") + 1] for argv in argvs] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert all(argv[argv.index("--max-num-seqs") + 1] == "16" and "--model" not in argv for argv in argvs)
    assert all(argv[argv.index("--max-loras") + 1] == "4" for argv in argvs)  # until the servers' /metrics say
    with pytest.raises(ConfigError, match="vllm_urls"):
        ClusterConfig().with_overrides(engine="vllm-http")
    with pytest.raises(ConfigError, match="instances"):
        ClusterConfig().with_overrides(engine="vllm-http", instances=3, vllm_urls=("http://10.0.0.1:8000",))


# --- against a real vLLM server ----------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``vllm serve`` of the tiny model on a free port: its URL."""
    import_or_skip("vllm")
    root = tmp_path_factory.mktemp("vllm-http")
    with vllm_serve(write_tiny_model(root / "model"), root / "serve.log") as url:
        yield url


def _spec(request_id: str, num_tokens: int) -> EngineRequestSpec:
    return EngineRequestSpec(request_id=request_id, prompt=tuple(range(100, 160)), prompt_tokens=60,
                             max_tokens=num_tokens, ignore_eos=True, predicted_output_tokens=num_tokens)


# Long enough that the six run together across several of the server's metrics updates
# (at 300 tokens, on a loaded machine, one read in several saw a single request running).
ANSWER_TOKENS = 600


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_the_engine_streams_from_a_running_server(vllm_server: str) -> None:
    async def run() -> tuple[list, list, dict, VllmHttpEngine]:
        engine = VllmHttpEngine(VllmHttpOptions(vllm_server, max_num_seqs=8))
        for index in range(6):
            engine.add_request(_spec(f"r{index}", ANSWER_TOKENS))
        engine.add_request(_spec("gone", 900))
        events, seen_running = [], []
        while engine.has_unfinished_requests():
            output = await engine.step()
            events.extend(output.events)
            running, _, _ = engine.progress()
            seen_running.append(len(running))
            # aborted once it streams: 900 tokens are far from done then
            if any(e.request_id == "gone" for e in output.events) and "gone" in engine._tracked:
                assert engine.abort_request("gone")
        await asyncio.sleep(0.5)  # a metrics read after the abort
        stats = engine.engine_stats()
        engine.shutdown()
        await asyncio.sleep(0.1)
        return events, seen_running, stats, engine

    events, seen_running, stats, engine = asyncio.run(run())
    config = engine.engine_config()
    assert config["block_size"] == 32 and config["num_gpu_blocks"] > 0 and config["max_model_len"] == 1024
    assert engine.model == "tiny"  # vllm_serve's --served-model-name, not the model's path
    for index in range(6):
        mine = [e for e in events if e.request_id == f"r{index}"]
        assert sum(e.num_new_tokens for e in mine) == ANSWER_TOKENS and mine[-1].finished, mine[-3:]
        assert mine[0].is_first and mine[-1].finish_reason == "length"
    assert not any(e.finished for e in events if e.request_id == "gone")  # aborted: no answer from the engine
    assert max(seen_running) >= 2  # the server's own counts, read from /metrics (every 0.25 s)
    assert stats["num_running_reqs"] == 0 and stats["prefix_cache_queries_total"] > 0


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_up_with_vllm_http_serves_through_the_pipeline(vllm_server: str, tmp_path: Path) -> None:
    env = {"BLOCKQ_STATE_DIR": str(tmp_path / "state"), "BLOCKQ_REDIS_URL": ""}
    up = run_blockq("up", "--engine", "vllm-http", "--url", vllm_server, "--policy", "block", "--max-num-seqs", "8",
                    "--gateway", "--gateway-port", str(free_port()), "--metrics-base-port", "0", "--detach", "--json",
                    env=env, timeout_s=300)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        submit = run_blockq("submit", "hello there", "--max-tokens", "8", "--json", env=env, timeout_s=60)
        assert submit.returncode == 0, submit.stderr[-3000:]
        record = json.loads(submit.stdout)
        assert record["status"] == "ok" and 1 <= record["output_tokens"] <= 8 and record["instance"] == "inst-0"
        state = ClusterState.read(tmp_path / "state")
        assert state is not None
        # the server's name for its model (vllm_serve's --served-model-name), not its path
        with urllib.request.urlopen(f"{vllm_server}/v1/models", timeout=30) as response:
            path = json.loads(response.read())["data"][0]["root"]
        assert state.gateway_url is not None
        check_base_model_served(state.redis_url, state.gateway_url, "tiny", unserved=(path, f"vllm:{path}"))
    finally:
        down = run_blockq("down", env=env, timeout_s=120)
        assert down.returncode == 0, down.stderr
