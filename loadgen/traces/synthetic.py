"""A seeded synthetic workload with ShareGPT-like lengths and text prompts.

Prompt and output lengths are lognormal (heavy-tailed prompts, output median about 250
tokens, the shape of ShareGPT answers under a Llama-2-class tokenizer), clipped so that a
prompt never exceeds ``max_prompt_tokens`` and prompt + output never exceeds
``max_model_len``. Prompts are filler text made of common short English words, each about
one token, so ``prompt_tokens`` is the word count unless a token counter is given (then
it is that counter's count of the text). The same seed gives the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from blockq.text.tokenizer import TokenCounter
from loadgen.traces.base import DEFAULT_MAX_MODEL_LEN, LengthPolicy, LoadedTrace, TraceRequest

DEFAULT_NUM_REQUESTS = 1000

# Common English words that a SentencePiece/BPE vocabulary holds as single pieces.
FILLER_WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with", "as", "was",
    "at", "by", "be", "this", "from", "or", "are", "an", "but", "not", "you", "all", "can",
    "had", "her", "one", "our", "out", "day", "get", "has", "him", "his", "how", "man",
    "new", "now", "old", "see", "two", "way", "who", "did", "its", "let", "put", "say",
    "she", "too", "use", "time", "work", "data", "plan", "code", "text", "list", "make",
    "write", "please", "about",
)  # fmt: skip


@dataclass(frozen=True)
class SyntheticTraceConfig:
    """Length distributions of the synthetic workload (lognormal: median and log-sigma)."""

    prompt_median_tokens: float = 40.0
    prompt_log_sigma: float = 1.5
    output_median_tokens: float = 250.0
    output_log_sigma: float = 0.7
    min_prompt_tokens: int = 4
    max_prompt_tokens: int = 2048
    max_model_len: int = DEFAULT_MAX_MODEL_LEN

    def __post_init__(self) -> None:
        if self.prompt_median_tokens <= 0 or self.output_median_tokens <= 0:
            raise ValueError("length medians must be positive")
        if self.prompt_log_sigma < 0 or self.output_log_sigma < 0:
            raise ValueError("log-sigmas must be >= 0")
        if not 1 <= self.min_prompt_tokens <= self.max_prompt_tokens < self.max_model_len:
            raise ValueError(
                "need 1 <= min_prompt_tokens <= max_prompt_tokens < max_model_len, got "
                f"{self.min_prompt_tokens}, {self.max_prompt_tokens}, {self.max_model_len}"
            )


def generate_synthetic(
    num_requests: int = DEFAULT_NUM_REQUESTS,
    *,
    seed: int = 0,
    config: SyntheticTraceConfig | None = None,
    token_counter: TokenCounter | None = None,
) -> LoadedTrace:
    """Generate ``num_requests`` requests; deterministic in (num_requests, seed, config).

    A longer list with the same seed starts with the shorter one's requests.
    ``trace_id`` is ``"synthetic-<index>"``; ``arrival_offset_s`` is None (use an arrival
    process from :mod:`loadgen.arrivals`).
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    config = config or SyntheticTraceConfig()
    policy = LengthPolicy(config.max_model_len)
    rng = np.random.default_rng(seed)
    words = np.asarray(FILLER_WORDS)
    requests: list[TraceRequest] = []
    for index in range(num_requests):
        # One draw of each kind per request, in a fixed order, keeps prefixes stable.
        prompt_draw = rng.lognormal(np.log(config.prompt_median_tokens), config.prompt_log_sigma)
        output_draw = rng.lognormal(np.log(config.output_median_tokens), config.output_log_sigma)
        num_words = int(
            np.clip(round(prompt_draw), config.min_prompt_tokens, config.max_prompt_tokens)
        )
        text = " ".join(words[rng.integers(0, len(words), size=num_words)].tolist())
        requests.append(
            TraceRequest(
                prompt=text,
                prompt_tokens=num_words,
                true_output_tokens=max(1, round(output_draw)),
                trace_id=f"synthetic-{index}",
            )
        )
    if token_counter is not None and requests:
        counts = token_counter.count([str(request.prompt) for request in requests])
        requests = [
            TraceRequest(
                prompt=request.prompt,
                prompt_tokens=max(1, count),
                true_output_tokens=request.true_output_tokens,
                trace_id=request.trace_id,
            )
            for request, count in zip(requests, counts, strict=True)
        ]
    kept: list[TraceRequest] = []
    for request in requests:
        fitted = policy.try_fit(request.prompt_tokens, request.true_output_tokens)
        if fitted is not None:
            kept.append(
                TraceRequest(
                    prompt=request.prompt,
                    prompt_tokens=request.prompt_tokens,
                    true_output_tokens=fitted[0],
                    trace_id=request.trace_id,
                )
            )
    return LoadedTrace(requests=kept, stats=policy.stats())
