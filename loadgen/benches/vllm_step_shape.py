"""Whether a model's step time on vLLM-CPU is set by compute or by per-step overhead: the
time of a 512-token prefill step against a 16-sequence decode step, on one thread.

    taskset -c 1 .venv-vllm/bin/python -m loadgen.benches.vllm_step_shape MODEL_DIR

A prefill step is timed as a 512-token request generating one token (median of 3, after a
warm-up); a decode step as the difference between 16 short requests generating 65 tokens
and generating 1, over 64 steps. Both include the engine's per-step overhead, as a real
step does; the 1-token request's time is printed as that overhead's upper bound.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

PREFILL_TOKENS = 512
DECODE_SEQUENCES = 16
DECODE_STEPS = 64


def _median_s(run: Callable[[], Any], repeats: int = 3) -> float:
    times_s = []
    for _ in range(repeats):
        started_s = time.perf_counter()
        run()
        times_s.append(time.perf_counter() - started_s)
    return sorted(times_s)[len(times_s) // 2]


def measure(model_dir: str) -> dict[str, float]:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, tokenizer=model_dir, enforce_eager=True, max_model_len=2048,
              max_num_batched_tokens=PREFILL_TOKENS, max_num_seqs=DECODE_SEQUENCES, block_size=32,
              dtype="bfloat16", seed=0)
    counter = [0]

    def prompts(num_prompts: int, num_tokens: int) -> list[dict[str, list[int]]]:
        counter[0] += 1  # distinct prompts: nothing comes from a prefix cache
        return [{"prompt_token_ids": [100 + (counter[0] * 7919 + k * 104_729 + i) % 30_000
                                      for i in range(num_tokens)]} for k in range(num_prompts)]

    def generate(num_prompts: int, num_tokens: int, max_tokens: int) -> Callable[[], Any]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return lambda: llm.generate(prompts(num_prompts, num_tokens), params, use_tqdm=False)

    generate(1, PREFILL_TOKENS, 1)()
    generate(DECODE_SEQUENCES, 8, 3)()
    prefill_s = _median_s(generate(1, PREFILL_TOKENS, 1))
    overhead_s = _median_s(generate(1, 8, 1))
    decode_s = (_median_s(generate(DECODE_SEQUENCES, 8, DECODE_STEPS + 1))
                - _median_s(generate(DECODE_SEQUENCES, 8, 1))) / DECODE_STEPS
    return {"prefill_step_ms": 1000 * prefill_s, "one_token_request_ms": 1000 * overhead_s,
            "decode_step_ms": 1000 * decode_s, "prefill_to_decode": prefill_s / decode_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    figures = measure(parser.parse_args().model_dir)
    print(" ".join(f"{name} {value:.2f}" for name, value in figures.items()))


if __name__ == "__main__":
    main()
