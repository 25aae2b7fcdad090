"""LoRA adapters on a real vLLM engine (the CPU build): one instance of the tiny random Llama
serving two random rank-8 adapters written here, offline, as PEFT writes them; requests
naming an adapter, the base model, no model and a model nobody serves go through the
project's path (client, predictor, dispatcher, worker); the beat publishes the adapters,
which are resident, and ``max_loras``.

Marked ``vllm``: run in the vLLM environment (``make test-vllm``). About a minute and a half,
most of it vLLM starting.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from blockq.local.state import ClusterState
from tests.conftest import import_or_skip, run_blockq, write_tiny_model
from tests.vllm_helpers import check_adapters_served, write_random_lora

import_or_skip("vllm")
import_or_skip("torch")

pytestmark = pytest.mark.vllm

ADAPTERS = ("sql", "poems")


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
        yield {"state": state}
    finally:
        down = run_blockq("down", env=env, timeout_s=120)
        assert down.returncode == 0, down.stderr


def test_requests_naming_adapters_are_answered_and_the_beat_shows_them(cluster: dict[str, Any]) -> None:
    check_adapters_served(cluster["state"].redis_url, ADAPTERS, max_loras=1)
