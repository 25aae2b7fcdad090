"""The fidelity run's requests: a trace's lengths, Poisson arrivals, token ids of their own.

Each load's requests are the same sample of trace rows (``num_requests`` drawn with the
seed), arriving as a Poisson process at that load's rate; they form one replay phase, the
loads run one after the other on one engine. Prompts are synthetic token ids of the
recorded lengths, distinct per row and per load (a later load finds nothing of an earlier
one in the prefix cache). With ``prefix_groups`` > 0 each prompt begins with the shared
prefix of one of that many groups (row i: group i mod n), up to
``SHARED_PREFIX_TOKENS`` and at most half the prompt, so that the prefix cache has hits
to count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loadgen.arrivals import poisson_arrivals
from loadgen.fidelity.replay_loop import ReplayRequest
from loadgen.traces import load_trace
from loadgen.traces.base import row_block_keys, synthetic_token_ids

SHARED_PREFIX_TOKENS = 256
_KEY_BLOCK_TOKENS = 16
_LOAD_ROW_STRIDE = 1 << 20


@dataclass(frozen=True)
class RequestLengths:
    """One sampled trace row: prompt and output tokens."""

    row: int
    prompt_tokens: int
    output_tokens: int


def sample_lengths(trace: str, num_requests: int, seed: int, max_model_len: int
                   ) -> list[RequestLengths]:
    """``num_requests`` rows of the trace drawn without replacement (with, when the trace is
    shorter), prompt + output within ``max_model_len`` (longer prompts skipped, outputs
    clipped as the trace loader does).

    Raises:
        ValueError: when the trace has no usable request.
    """
    rows = load_trace(trace, seed=seed, max_model_len=max_model_len)
    rows = [r for r in rows if r.prompt_tokens >= 1 and r.true_output_tokens >= 1]
    if not rows:
        raise ValueError(f"--trace {trace}: no request fits max_model_len {max_model_len}")
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(rows), size=num_requests, replace=num_requests > len(rows))
    return [RequestLengths(int(i), rows[i].prompt_tokens, rows[i].true_output_tokens) for i in picks]


def prompt_token_ids(row: int, prompt_tokens: int, load_index: int, seed: int,
                     prefix_groups: int) -> tuple[int, ...]:
    """Token ids of one prompt (see the module docstring)."""
    unique_row = load_index * _LOAD_ROW_STRIDE + row
    num_blocks = -(-prompt_tokens // _KEY_BLOCK_TOKENS)
    keys = row_block_keys(unique_row, num_blocks)
    if prefix_groups > 0:
        shared_blocks = min(SHARED_PREFIX_TOKENS, prompt_tokens // 2) // _KEY_BLOCK_TOKENS
        group_keys = row_block_keys(_LOAD_ROW_STRIDE - 1 - row % prefix_groups
                                    + load_index * _LOAD_ROW_STRIDE, shared_blocks)
        keys = group_keys + keys[shared_blocks:]
    return synthetic_token_ids(keys, prompt_tokens, block_size_tokens=_KEY_BLOCK_TOKENS, seed=seed)


def build_requests(lengths: Sequence[RequestLengths], rates_per_s: Sequence[float], seed: int,
                   prefix_groups: int = 0) -> list[ReplayRequest]:
    """One phase per rate, in order; request ids ``L{load index}-{position}``."""
    requests: list[ReplayRequest] = []
    for load_index, rate_per_s in enumerate(rates_per_s):
        arrivals_s = poisson_arrivals(len(lengths), rate_per_s, seed)
        for position, (item, arrival_s) in enumerate(zip(lengths, arrivals_s, strict=True)):
            requests.append(ReplayRequest(
                f"L{load_index}-{position}",
                prompt_token_ids(position, item.prompt_tokens, load_index, seed, prefix_groups),
                item.output_tokens, arrival_s=float(arrival_s), phase=load_index))
    return requests
