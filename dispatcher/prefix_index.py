"""What the dispatcher believes an instance's prefix cache holds, from its own placements.

An engine with prefix caching (vLLM's ``enable_prefix_caching``) keeps the KV blocks of
the prompts it served, keyed by chained block hashes (:mod:`blockq.text.block_hashes`: equal hashes
mean equal prefixes), and evicts them least recently used when it needs room. The
dispatcher sees every request it places, with its prompt's block hashes
(``Request.prompt_block_hashes``), so it keeps one :class:`PrefixIndex` per instance: the
hashes of the prompts placed there, most recently used last, at most the instance's KV
capacity in blocks. The engine also caches the blocks a request's output fills (a
conversation's next turn repeats the answer), which no placement shows: the instance's
beats name those of finished requests (``Heartbeat.cached_block_hashes``), and they are
recorded as they arrive. A request's predicted hit on an instance is its longest leading run of
hashes found there. Only instances whose KV blocks are the hashes' size
(:data:`~blockq.text.block_hashes.PREFIX_BLOCK_TOKENS`) get an index: another block size caches other
boundaries, and no hit is predicted there.

The index is an estimate, and errs on the side of hits: the engine also spends KV on
running requests' outputs and evicts sooner under load, and a placement the instance
never ran (it died, the request was moved) still counts. What it never does is see a hit
the engine could not have: a block is only believed cached after a request with it was
placed there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from blockq.text.block_hashes import PREFIX_BLOCK_TOKENS


def cached_tokens(num_cached_blocks: int, prompt_tokens: int, block_tokens: int = PREFIX_BLOCK_TOKENS) -> int:
    """Prompt tokens served from ``num_cached_blocks`` cached leading blocks; at least one
    token is always computed (the engine must run the last prompt position to produce the
    first output token)."""
    return min(num_cached_blocks * block_tokens, max(0, prompt_tokens - 1))


@dataclass
class PrefixIndex:
    """The block hashes believed cached on one instance (LRU, ``capacity_blocks`` at most)."""

    capacity_blocks: int
    block_tokens: int = PREFIX_BLOCK_TOKENS
    _blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.capacity_blocks < 1:
            raise ValueError(f"capacity_blocks: must be >= 1 (got {self.capacity_blocks})")

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many of ``block_hashes``' leading blocks are believed cached."""
        blocks = self._blocks
        for index, block_hash in enumerate(block_hashes):
            if block_hash not in blocks:
                return index
        return len(block_hashes)

    def cached_prompt_tokens(self, block_hashes: Sequence[int], prompt_tokens: int) -> int:
        """Prompt tokens a request would find cached (:func:`cached_tokens`)."""
        return cached_tokens(self.cached_prefix_blocks(block_hashes), prompt_tokens, self.block_tokens)

    def forget(self, block_hashes: Sequence[int]) -> None:
        """The engine evicted these blocks."""
        for block_hash in block_hashes:
            self._blocks.pop(block_hash, None)

    def record(self, block_hashes: Sequence[int]) -> None:
        """These blocks were placed here or reported cached: now the most recently used."""
        blocks = self._blocks
        for block_hash in block_hashes:
            if block_hash in blocks:
                blocks.move_to_end(block_hash)
            else:
                blocks[block_hash] = None
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
