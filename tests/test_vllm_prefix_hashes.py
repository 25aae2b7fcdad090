"""Prefix hits predicted against vLLM's measured hits on a multi-turn workload.

`blockq up --engine vllm` gives every child the served model's tokenizer and the engines'
block size (``BLOCKQ_PREFIX_*``): the predictor hashes prompts as vLLM tokenizes them, the
workers name vLLM's KV events by the same hashes, and the dispatcher's index predicts each
request's hit where it places it. Conversations of several turns (each turn's prompt is
the conversation so far: the earlier prompts and the answers vLLM gave) run through a
2-instance `block` cluster; every final record carries vLLM's ``num_cached_tokens`` and the
dispatcher's prediction.

Marked ``vllm``: run in the vLLM environment with ``make test-vllm``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from blockq.client import Client
from blockq.local.state import ClusterState
from tests.conftest import import_or_skip, run_blockq, write_tiny_model

import_or_skip("vllm")

pytestmark = pytest.mark.vllm

WORDS = ("river", "stone", "lamp", "orange", "cloud", "garden", "violin", "paper", "window", "silver",
         "forest", "engine", "maple", "copper", "harbor", "candle", "meadow", "rocket", "pencil", "thunder")
NUM_CONVERSATIONS = 6
NUM_TURNS = 4
ANSWER_TOKENS = 80
# Between a turn's answer and the next turn (a user reads, then types): the beat that names
# the answer's cached blocks reaches the dispatcher in one heartbeat interval.
THINK_S = 0.5
# The product's bound is ±10 %; the index fed by vLLM's KV events has matched exactly here,
# and without them (placements only: no answer's blocks, no evictions) it missed 5.1 %.
MAX_HIT_ERROR = 0.02


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def test_predicted_prefix_hits_match_vllms_on_multi_turn_conversations(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "model")
    env = {"BLOCKQ_STATE_DIR": str(tmp_path / "state"), "BLOCKQ_REDIS_URL": ""}
    up = run_blockq("up", "--engine", "vllm", "--model", str(tmp_path / "model"), "--instances", "2",
                    "--policy", "block", "--prefix-caching", "--block-size", "32",
                    "--kv-cache-bytes", str(3 * 1024 * 1024), "--max-model-len", "2048", "--enforce-eager",
                    "--metrics-base-port", "0", "--detach", "--json", "--ready-timeout-s", "400",
                    env=env, timeout_s=460)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        state = ClusterState.read(tmp_path / "state")
        assert state is not None
        rng = random.Random(5)
        systems = [_words(rng, 150), _words(rng, 220)]  # two system prompts, shared across conversations
        prompts = [f"system: {systems[i % 2]}\nuser: {_words(rng, 30)}\nassistant:" for i in range(NUM_CONVERSATIONS)]
        totals = {"prompt": 0, "measured": 0, "predicted": 0}
        with Client(state.redis_url) as client:
            for turn in range(NUM_TURNS):
                handles = [client.submit(prompt, max_tokens=ANSWER_TOKENS, ignore_eos=True, best_effort=True)
                           for prompt in prompts]
                records = [handle.result(timeout_s=180) for handle in handles]
                for record in records:
                    assert record.status == "ok", record.error
                    assert record.cached_tokens is not None and record.predicted_cached_tokens is not None
                measured = sum(r.cached_tokens or 0 for r in records)
                predicted = sum(r.predicted_cached_tokens or 0 for r in records)
                num_prompt = sum(r.prompt_tokens for r in records)
                print(f"\nturn {turn + 1}: {num_prompt} prompt tokens, vLLM found {measured} cached, "
                      f"the dispatcher predicted {predicted} "
                      f"(on {sorted({r.instance for r in records})})")
                totals = {"prompt": totals["prompt"] + num_prompt, "measured": totals["measured"] + measured,
                          "predicted": totals["predicted"] + predicted}
                prompts = [f"{prompt}{record.text}\nuser: {_words(rng, 20)}\nassistant:"
                           for prompt, record in zip(prompts, records, strict=True)]
                time.sleep(THINK_S)
        error = totals["predicted"] / totals["measured"] - 1
        print(f"\nall turns: {totals['prompt']} prompt tokens, measured hits {totals['measured']}, "
              f"predicted {totals['predicted']} ({100 * error:+.1f} %)")
        assert totals["measured"] > 0.3 * totals["prompt"]  # the conversations do reuse their past
        assert abs(error) <= MAX_HIT_ERROR
    finally:
        down = run_blockq("down", env=env, timeout_s=120)
        assert down.returncode == 0, down.stderr
