"""What the real-vLLM tests share: random LoRA adapters of the tiny model, written offline; a
``vllm serve`` of the tiny model on a free port; and the check that a one-instance cluster
serves the adapters it publishes (tests/test_vllm_lora.py, tests/test_vllm_http_engine.py,
tests/test_vllm_http_lora.py). They need the vLLM environment (torch, vllm)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

from blockq.client import Client
from blockq.config import Settings
from blockq.local.embedded_redis import free_port
from blockq.wire.beats import decode_heartbeat
from blockq.wire.keys import Keys
from tests.conftest import wait_until

LORA_RANK = 8
HIDDEN_SIZE, NUM_LAYERS = 128, 2  # blockq tiny-model's small shape (blockq/local/tiny_model.py)
SERVE_TIMEOUT_S = 300


def write_random_lora(directory: Path, base_model: Path, seed: int) -> Path:
    """A rank-8 LoRA adapter of q_proj and v_proj with random weights, as PEFT saves one
    (adapter_config.json, adapter_model.safetensors): nothing to download."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": 2 * LORA_RANK,
              "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
              "base_model_name_or_path": str(base_model), "modules_to_save": None, "use_rslora": False}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(NUM_LAYERS):
        for module in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(LORA_RANK, HIDDEN_SIZE, generator=generator) * 0.05
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(HIDDEN_SIZE, LORA_RANK, generator=generator) * 0.05
    save_file({name: t.to(torch.bfloat16).contiguous() for name, t in tensors.items()},
              str(directory / "adapter_model.safetensors"))
    return directory


@contextlib.contextmanager
def vllm_serve(model: Path, log_path: Path, *flags: str) -> Iterator[str]:
    """``vllm serve`` of ``model`` (served as ``tiny``) on a free port, with ``flags`` added: its
    URL once ``/health`` answers; stopped (its process group) on leaving."""
    port = free_port()
    log = log_path.open("w")
    # the KV size is the flag's: vLLM-CPU would let a VLLM_CPU_KVCACHE_SPACE replace it
    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}, "VLLM_LOGGING_LEVEL": "WARNING"}
    server = subprocess.Popen(
        # `vllm serve` itself, as a module: vllm-cpu's `vllm` command looks for a package named vllm
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
         "--host", "127.0.0.1", "--served-model-name", "tiny", "--max-model-len", "1024", "--block-size", "32",
         "--kv-cache-memory-bytes", str(4 * 1024 * 1024), "--max-num-seqs", "8", "--enforce-eager", *flags],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while True:
            assert server.poll() is None, log_path.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"vllm serve did not come up in {SERVE_TIMEOUT_S} s"
                time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=60)
        log.close()


def only_beat(redis_url: str) -> Any:
    """The beat of a cluster's one instance."""
    client = redis.Redis.from_url(redis_url)
    try:
        (payload,) = client.hvals(Keys().instances)
        return decode_heartbeat(payload)
    finally:
        client.close()


def check_adapters_served(redis_url: str, adapters: Sequence[str], max_loras: int) -> None:
    """A one-instance cluster serving the LoRA ``adapters`` publishes them and ``max_loras``;
    requests naming each adapter, the base model and none are answered ``ok`` through the
    client, predictor, dispatcher and worker, one naming a model nobody serves ``error``
    (``model_not_served``); afterwards the beat shows one adapter resident."""
    beat = only_beat(redis_url)
    assert beat.engine_config["lora_adapters"] == list(adapters) and beat.engine_config["max_loras"] == max_loras
    models = [*adapters, adapters[0], beat.model, None, "gpt-9"]
    with Client(settings=Settings(redis_url=redis_url)) as client:
        handles = [client.submit(f"tell me about adapter {i} please", max_tokens=8, model=model)
                   for i, model in enumerate(models)]
        finals = [handle.result(timeout_s=120) for handle in handles]
    for model, final in zip(models[:-1], finals[:-1], strict=True):
        assert final.status == "ok" and final.output_tokens >= 1, (model, final)
    refused = finals[-1]
    assert refused.status == "error" and "model_not_served" in (refused.error or "") and "gpt-9" in refused.error
    # The adapters ran: vLLM's stats named them running, and those resident (at most max_loras) are published.
    loaded = wait_until(lambda: only_beat(redis_url).engine_config.get("loaded_loras"), timeout_s=10)
    assert 1 <= len(loaded) <= max_loras and set(loaded) <= set(adapters)


def check_base_model_served(redis_url: str, gateway_url: str, name: str, unserved: Sequence[str]) -> None:
    """A one-instance cluster publishes its base model as ``name`` (the server's name for it):
    the gateway's ``/v1/models`` lists it and answers a completion naming it; through the
    client a request naming it is answered ``ok``, each naming one of ``unserved`` ``error``
    (``model_not_served``)."""
    assert only_beat(redis_url).model == name
    with urllib.request.urlopen(f"{gateway_url}/v1/models", timeout=30) as response:
        assert name in [card["id"] for card in json.loads(response.read())["data"]]
    body = json.dumps({"model": name, "prompt": "hello there", "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{gateway_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        completion = json.loads(response.read())
    assert completion["model"] == name and completion["usage"]["completion_tokens"] >= 1, completion
    models = [name, *unserved]
    with Client(settings=Settings(redis_url=redis_url)) as client:
        finals = [client.submit("hello again", max_tokens=4, model=model).result(timeout_s=120) for model in models]
    assert finals[0].status == "ok" and finals[0].output_tokens >= 1, finals[0]
    for model, final in zip(unserved, finals[1:], strict=True):
        assert final.status == "error" and "model_not_served" in (final.error or ""), (model, final)
