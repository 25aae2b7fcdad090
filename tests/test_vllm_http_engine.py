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
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from blockq.local.embedded_redis import free_port
from tests.conftest import import_or_skip, run_blockq, write_tiny_model
from workers.engines.base import EngineRequestSpec
from workers.engines.vllm_http import ServerMetrics, VllmHttpEngine, VllmHttpOptions

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


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="url"):
        VllmHttpOptions("localhost:8000")
    with pytest.raises(ValueError, match="max_num_seqs"):
        VllmHttpOptions("http://127.0.0.1:8000", max_num_seqs=0)


def test_up_runs_one_worker_per_server() -> None:
    from blockq.config import ConfigError
    from blockq.local.cluster_config import ClusterConfig

    config = ClusterConfig().with_overrides(engine="vllm-http", instances=2, vllm_max_num_seqs=16,
                                            vllm_urls=("http://10.0.0.1:8000", "http://10.0.0.2:8000"))
    argvs = [config.worker_child(i, i, 1)[1] for i in range(config.num_worker_processes)]
    assert [argv[argv.index("--url") + 1] for argv in argvs] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert all(argv[argv.index("--max-num-seqs") + 1] == "16" and "--model" not in argv for argv in argvs)
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
    write_tiny_model(root / "model")
    port = free_port()
    log = (root / "serve.log").open("w")
    # the KV size is the flag's: vLLM-CPU would let a VLLM_CPU_KVCACHE_SPACE replace it
    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}, "VLLM_LOGGING_LEVEL": "WARNING"}
    server = subprocess.Popen(
        # `vllm serve` itself, as a module: vllm-cpu's `vllm` command looks for a package named vllm
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(root / "model"), "--port", str(port),
         "--host", "127.0.0.1", "--served-model-name", "tiny", "--max-model-len", "1024", "--block-size", "32",
         "--kv-cache-memory-bytes", str(4 * 1024 * 1024), "--max-num-seqs", "8", "--enforce-eager"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (root / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not come up in 300 s"
                time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def _spec(request_id: str, num_tokens: int) -> EngineRequestSpec:
    return EngineRequestSpec(request_id=request_id, prompt=tuple(range(100, 160)), prompt_tokens=60,
                             max_tokens=num_tokens, ignore_eos=True, predicted_output_tokens=num_tokens)


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_the_engine_streams_from_a_running_server(vllm_server: str) -> None:
    async def run() -> tuple[list, list, dict, VllmHttpEngine]:
        engine = VllmHttpEngine(VllmHttpOptions(vllm_server, max_num_seqs=8))
        for index in range(6):
            engine.add_request(_spec(f"r{index}", 300))
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
    assert engine.served_model == "tiny"
    for index in range(6):
        mine = [e for e in events if e.request_id == f"r{index}"]
        assert sum(e.num_new_tokens for e in mine) == 300 and mine[-1].finished, mine[-3:]
        assert mine[0].is_first and mine[-1].finish_reason == "length"
    assert not any(e.finished for e in events if e.request_id == "gone")  # aborted: no answer from the engine
    assert max(seen_running) >= 2  # the server's own counts, read from /metrics (every 0.25 s)
    assert stats["num_running_reqs"] == 0 and stats["prefix_cache_queries_total"] > 0


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_up_with_vllm_http_serves_through_the_pipeline(vllm_server: str, tmp_path: Path) -> None:
    env = {"BLOCKQ_STATE_DIR": str(tmp_path / "state"), "BLOCKQ_REDIS_URL": ""}
    up = run_blockq("up", "--engine", "vllm-http", "--url", vllm_server, "--policy", "block",
                    "--max-num-seqs", "8", "--metrics-base-port", "0", "--detach", "--json", env=env, timeout_s=300)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        submit = run_blockq("submit", "hello there", "--max-tokens", "8", "--json", env=env, timeout_s=60)
        assert submit.returncode == 0, submit.stderr[-3000:]
        record = json.loads(submit.stdout)
        assert record["status"] == "ok" and 1 <= record["output_tokens"] <= 8 and record["instance"] == "inst-0"
    finally:
        down = run_blockq("down", env=env, timeout_s=120)
        assert down.returncode == 0, down.stderr
