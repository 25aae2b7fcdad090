"""The engine's exact state from vLLM's own scheduler (workers/engines/vllm_state.py), on a
real vLLM engine: request ids mapped back, each running request's computed tokens, and
preemptions reported as they happen and as vLLM counts them.

Marked ``vllm``: ``BLOCKQ_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -q -m vllm -s
tests/test_vllm_state.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.conftest import import_or_skip, write_tiny_model
from workers.engines.base import EngineRequestSpec

PROMPT_TOKENS = 300
OUTPUT_TOKENS = 100


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import_or_skip("vllm")
    root = tmp_path_factory.mktemp("vllm-state")
    return write_tiny_model(root / "model")


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_snapshots_carry_vllms_own_state(tiny_model: Path) -> None:
    from workers.engines.vllm import VllmEngine
    from workers.engines.vllm_options import VllmEngineOptions

    # 12 x 400 tokens over a 2,048-token cache: vLLM must preempt
    options = VllmEngineOptions(model=str(tiny_model), max_num_seqs=8, block_size=32, kv_cache_bytes=2 * 1024 * 1024,
                                max_model_len=1024, enforce_eager=True)

    async def run() -> tuple[list[str], list[tuple[str, int, int]], set[str], dict, int]:
        engine = VllmEngine(options)
        try:
            specs = [EngineRequestSpec(request_id=f"req-{i}", prompt=tuple(range(100 + i, 100 + i + PROMPT_TOKENS)),
                                       prompt_tokens=PROMPT_TOKENS, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
                     for i in range(12)]
            for spec in specs:
                engine.add_request(spec)
            preempted: list[str] = []
            running_seen: list[tuple[str, int, int]] = []
            ids_seen: set[str] = set()
            while engine.has_unfinished_requests():
                output = await engine.step()
                preempted += output.preempted_ids
                running, waiting, _ = engine.progress()
                running_seen += [(r.request_id, r.num_computed_tokens, r.num_generated_tokens) for r in running]
                ids_seen |= {r.request_id for r in (*running, *waiting)}
            latest = engine.state.latest
            return preempted, running_seen, ids_seen, engine.engine_stats(), latest.num_steps if latest else 0
        finally:
            engine.shutdown()

    preempted, running_seen, ids_seen, stats, num_steps = asyncio.run(run())
    assert num_steps > 0  # the scheduler's snapshots reached the worker
    assert ids_seen == {f"req-{i}" for i in range(12)}  # vLLM's suffixes taken off
    # a decoding request has computed its prompt and all its tokens but the last
    decoding = [(c, g) for _, c, g in running_seen if g > 1]
    assert decoding and all(c == PROMPT_TOKENS + g - 1 for c, g in decoding)
    assert preempted and len(preempted) == stats["num_preemptions_total"], (preempted, stats)
    print(f"\n{len(preempted)} preemptions reported, vLLM counted {stats['num_preemptions_total']}")

