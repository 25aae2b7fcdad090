"""LoRA through the ``vllm-http`` engine, on a real ``vllm serve`` (the CPU build) of the tiny
random Llama with two random rank-8 adapters written here (``--enable-lora --lora-modules
sql=… poems=… --max-loras 1``): the worker's engine reads the adapters from ``/v1/models``,
sends each request's adapter as the completion's ``model`` (the server's own LoRA gauge named
it running), takes ``max_loras`` from ``/metrics`` over its own option, and publishes the
adapters running, waiting and resident; through ``blockq up --engine vllm-http`` requests
naming an adapter, the base model and none are answered, and one naming a model nobody serves
is refused.

Marked ``vllm``: ``BLOCKQ_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -q -m vllm -s
tests/test_vllm_http_lora.py`` (``make test-vllm``), most of it vLLM starting.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from blockq.local.state import ClusterState
from tests.conftest import import_or_skip, run_blockq, write_tiny_model
from tests.vllm_helpers import check_adapters_served, vllm_serve, write_random_lora
from workers.engines.base import EngineRequestSpec
from workers.engines.vllm_http import VllmHttpEngine, VllmHttpOptions

import_or_skip("vllm")
import_or_skip("torch")

pytestmark = pytest.mark.vllm

ADAPTERS = ("sql", "poems")
NUM_TOKENS = 200


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``vllm serve`` of the tiny model with the two adapters, at most one resident: its URL."""
    root = tmp_path_factory.mktemp("vllm-http-lora")
    model = write_tiny_model(root / "model")
    modules = [f"{name}={write_random_lora(root / name, model, seed)}" for seed, name in enumerate(ADAPTERS)]
    with vllm_serve(model, root / "serve.log", "--enable-lora", "--lora-modules", *modules, "--max-loras", "1",
                    "--max-lora-rank", "8") as url:
        yield url


def _spec(request_id: str, model: str | None) -> EngineRequestSpec:
    return EngineRequestSpec(request_id=request_id, prompt=tuple(range(100, 160)), prompt_tokens=60,
                             max_tokens=NUM_TOKENS, ignore_eos=True, predicted_output_tokens=NUM_TOKENS, model=model)


@pytest.mark.timeout(600)
def test_the_engine_sends_and_publishes_the_servers_adapters(lora_server: str) -> None:
    async def run(engine: VllmHttpEngine) -> tuple[list, list[dict]]:
        for model in (*ADAPTERS, None):
            engine.add_request(_spec(f"r-{model}", model))
        events, stats_seen = [], []
        while engine.has_unfinished_requests():
            events.extend((await engine.step()).events)
            stats_seen.append(engine.engine_stats())
        await asyncio.sleep(0.5)  # a metrics read after the last step
        engine.shutdown()
        await asyncio.sleep(0.1)
        return events, stats_seen

    # the worker's max_loras (4) is what it publishes until the server's /metrics say (1)
    engine = VllmHttpEngine(VllmHttpOptions(lora_server, max_num_seqs=8, max_loras=4))
    assert engine.lora_adapters == ADAPTERS and engine.model == "tiny"
    assert engine.engine_config()["lora_adapters"] == list(ADAPTERS)
    assert "gpt-9" in (engine.validate(_spec("x", "gpt-9")) or "")
    assert engine.validate(replace(_spec("x", None), model=engine.model)) is None
    events, stats_seen = asyncio.run(run(engine))
    for model in (*ADAPTERS, None):
        mine = [e for e in events if e.request_id == f"r-{model}"]
        assert sum(e.num_new_tokens for e in mine) == NUM_TOKENS and mine[-1].finish_reason == "length", mine[-3:]
    # The server ran each request with its adapter (it was sent as the completion's model), one
    # adapter at a time (its max_loras 1): its gauge keeps a series for every set it named.
    with urllib.request.urlopen(f"{lora_server}/metrics") as response:
        lora_series = [line for line in response.read().decode().splitlines()
                       if line.startswith("vllm:lora_requests_info")]
    assert any('running_lora_adapters="sql"' in line for line in lora_series), lora_series
    assert any('running_lora_adapters="poems"' in line for line in lora_series), lora_series
    assert not any("sql,poems" in line or "poems,sql" in line for line in lora_series), lora_series
    # While one adapter ran, the beat's stats showed the other waiting (skipped by the max_loras rule).
    assert any(set(s["waiting_lora_adapters"]) - set(s["running_lora_adapters"]) for s in stats_seen), stats_seen[:5]
    config = engine.engine_config()
    assert config["max_loras"] == 1 and len(config["loaded_loras"]) == 1 and config["loaded_loras"][0] in ADAPTERS


@pytest.mark.timeout(600)
def test_up_with_vllm_http_serves_the_servers_adapters(lora_server: str, tmp_path: Path) -> None:
    env = {"BLOCKQ_STATE_DIR": str(tmp_path / "state"), "BLOCKQ_REDIS_URL": ""}
    up = run_blockq("up", "--engine", "vllm-http", "--url", lora_server, "--policy", "block", "--max-num-seqs", "8",
                    "--max-loras", "1", "--metrics-base-port", "0", "--detach", "--json", env=env, timeout_s=300)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        state = ClusterState.read(tmp_path / "state")
        assert state is not None
        check_adapters_served(state.redis_url, ADAPTERS, max_loras=1)
    finally:
        down = run_blockq("down", env=env, timeout_s=120)
        assert down.returncode == 0, down.stderr
