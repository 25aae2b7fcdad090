"""LoRA adapters on a real vLLM engine (the CPU build): one instance of the tiny random Llama
serving two random rank-8 adapters written here, offline, as PEFT writes them; requests
naming an adapter, the base model, no model and a model nobody serves go through the
project's path (client, predictor, dispatcher, worker); the beat publishes the adapters,
which are resident, and ``max_loras``.

Marked ``vllm``: run in the vLLM environment (``make test-vllm``). About a minute and a half,
most of it vLLM starting.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from blockq.client import Client
from blockq.config import Settings
from blockq.local.state import ClusterState
from blockq.wire.beats import decode_heartbeat
from blockq.wire.keys import Keys
from tests.conftest import import_or_skip, run_blockq, wait_until, write_tiny_model

import_or_skip("vllm")
torch: Any = import_or_skip("torch")

pytestmark = pytest.mark.vllm

ADAPTERS = ("sql", "poems")
RANK = 8
HIDDEN_SIZE, NUM_LAYERS = 128, 2  # blockq tiny-model's small shape (blockq/local/tiny_model.py)


def write_random_lora(directory: Path, base_model: Path, seed: int) -> Path:
    """A rank-8 LoRA adapter of q_proj and v_proj with random weights, as PEFT saves one
    (adapter_config.json, adapter_model.safetensors): nothing to download."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK, "lora_dropout": 0.0,
              "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
              "base_model_name_or_path": str(base_model), "modules_to_save": None, "use_rslora": False}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(NUM_LAYERS):
        for module in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, HIDDEN_SIZE, generator=generator) * 0.05
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(HIDDEN_SIZE, RANK, generator=generator) * 0.05
    save_file({name: t.to(torch.bfloat16).contiguous() for name, t in tensors.items()},
              str(directory / "adapter_model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("vllm-lora")
    model = write_tiny_model(root / "model")
    modules = ",".join(f"{name}={write_random_lora(root / name, model, seed)}" for seed, name in enumerate(ADAPTERS))
    env = {"BLOCKQ_STATE_DIR": str(root / "state"), "BLOCKQ_REDIS_URL": ""}
    started_s = time.monotonic()
    up = run_blockq("up", "--engine", "vllm", "--model", str(model), "--instances", "1", "--policy", "block",
                    "--block-size", "32", "--kv-cache-bytes", str(2 * 1024 * 1024), "--max-model-len", "1024",
                    "--lora-modules", modules, "--max-loras", "1", "--enforce-eager", "--detach", "--json",
                    "--ready-timeout-s", "400", env=env, timeout_s=460)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        state = ClusterState.read(root / "state")
        assert state is not None
        print(f"\n1 vLLM instance with LoRA up in {time.monotonic() - started_s:.1f} s")
        yield {"state": state, "model": f"vllm:{model}"}
    finally:
        down = run_blockq("down", env=env, timeout_s=120)
        assert down.returncode == 0, down.stderr


def _beat(redis_url: str) -> Any:
    client = redis.Redis.from_url(redis_url)
    try:
        (payload,) = client.hvals(Keys().instances)
        return decode_heartbeat(payload)
    finally:
        client.close()


def test_requests_naming_adapters_are_answered_and_the_beat_shows_them(cluster: dict[str, Any]) -> None:
    state: ClusterState = cluster["state"]
    beat = _beat(state.redis_url)
    assert beat.engine_config["lora_adapters"] == list(ADAPTERS) and beat.engine_config["max_loras"] == 1
    models = ["sql", "poems", "sql", cluster["model"], None, "gpt-9"]
    with Client(settings=Settings(redis_url=state.redis_url)) as client:
        handles = [client.submit(f"tell me about adapter {i} please", max_tokens=8, model=model)
                   for i, model in enumerate(models)]
        finals = [handle.result(timeout_s=120) for handle in handles]
    for model, final in zip(models[:-1], finals[:-1], strict=True):
        assert final.status == "ok" and final.output_tokens >= 1, (model, final)
    refused = finals[-1]
    assert refused.status == "error" and "model_not_served" in (refused.error or "") and "gpt-9" in refused.error
    # The adapters ran: vLLM's stats named them running, and the one resident (max_loras 1) is published.
    loaded = wait_until(lambda: _beat(state.redis_url).engine_config.get("loaded_loras"), timeout_s=10)
    assert len(loaded) == 1 and loaded[0] in ADAPTERS
