"""Prefix-cache hit rates of a simulated run: predicted by the dispatcher and the ideal.

All are shares of prompt tokens served from cache, so they compare with what the engines
measure (``prefix_hit_rate`` of the run's summary, from their own counters):

- ``prefix_hit_rate_predicted``: what the dispatcher's prefix indexes predicted for the
  instances it chose (:mod:`dispatcher.prefix_index`), over every request it placed;
- ``prefix_hit_rate_ideal``: an infinite cache and every request on the instance holding
  its longest prefix, i.e. each request's longest leading run of blocks that any earlier
  request (in arrival order) had, its prompt's or (where the recorded answer names them)
  the blocks its answer filled, as if the earlier answer were complete. No placement can
  beat it; load balance costs from it.
"""

from __future__ import annotations

from collections.abc import Sequence

from blockq.text.block_hashes import PREFIX_BLOCK_TOKENS, continued_block_hashes, num_filled_blocks
from blockq.wire.protocol import Request
from dispatcher.core import CoreStats
from dispatcher.prefix_index import cached_tokens


def ideal_prefix_hit_rate(requests_in_arrival_order: Sequence[Request],
                          block_tokens: int = PREFIX_BLOCK_TOKENS) -> float | None:
    """See the module docstring; None when no request carries block hashes."""
    seen: set[int] = set()
    num_cached_tokens = num_prompt_tokens = 0
    for request in requests_in_arrival_order:
        hashes = request.prompt_block_hashes
        prompt_tokens = request.num_prompt_tokens
        num_prompt_tokens += prompt_tokens
        # Chained hashes: a block seen means every block before it was seen with it.
        num_blocks = 0
        for block_hash in hashes:
            if block_hash not in seen:
                break
            num_blocks += 1
        num_cached_tokens += cached_tokens(num_blocks, prompt_tokens, block_tokens)
        seen.update(_blocks_left_cached(request, prompt_tokens, block_tokens))
    if not seen or not num_prompt_tokens:
        return None
    return num_cached_tokens / num_prompt_tokens


def _blocks_left_cached(request: Request, prompt_tokens: int, block_tokens: int) -> tuple[int, ...]:
    """The prompt's blocks and those its answer fills, as far as it is served (the last
    sampled token is never computed), where the recorded answer names them."""
    hashes = continued_block_hashes(request.prompt, request.prompt_block_hashes, request.trace_output_text)
    if len(hashes) == len(request.prompt_block_hashes):
        return hashes
    num_output_tokens = min(request.true_output_tokens or request.max_tokens, request.max_tokens)
    return hashes[:max(len(request.prompt_block_hashes), num_filled_blocks(prompt_tokens, num_output_tokens, block_tokens))]


def predicted_prefix_hit_rate(stats: CoreStats) -> float | None:
    """The dispatcher's predicted share of placed prompt tokens found cached (None:
    nothing was placed)."""
    if not stats.num_placed_prompt_tokens:
        return None
    return stats.num_predicted_cached_tokens / stats.num_placed_prompt_tokens
