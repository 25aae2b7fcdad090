"""Paged KV-cache accounting: free blocks and, with prefix caching, cached block hashes.

The pool counts blocks, it does not name them. A request holds ``num_blocks`` blocks; the
first ``num_hashed_blocks`` of them are registered under their block hash and may
be shared by several requests (counted once). When the last holder of a hashed block lets
it go, the block becomes free but keeps its content: it stays *evictable* in LRU order
and can be claimed again by a request with the same prefix until a fresh allocation
needs the space.
"""

from __future__ import annotations

from collections import OrderedDict

from blockq.engine_model.request import EngineRequest


class BlockPool:
    """Free-block counter with an optional prefix cache (see the module docstring).

    Invariant: ``0 <= num_free_blocks <= num_gpu_blocks`` and
    ``len(evictable_hashes) <= num_free_blocks``.
    """

    __slots__ = ("num_gpu_blocks", "block_size", "num_free_blocks", "hash_to_num_holders",
                 "evictable_hashes", "num_prefix_queried_tokens", "num_prefix_hit_tokens")

    def __init__(self, num_gpu_blocks: int, block_size: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.num_free_blocks = num_gpu_blocks
        self.hash_to_num_holders: dict[int, int] = {}
        self.evictable_hashes: OrderedDict[int, None] = OrderedDict()
        # vLLM's prefix-cache counters: tokens of admitted requests looked up, and found.
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0

    def clone(self) -> BlockPool:
        """An independent copy."""
        pool = BlockPool.__new__(BlockPool)
        pool.num_gpu_blocks = self.num_gpu_blocks
        pool.block_size = self.block_size
        pool.num_free_blocks = self.num_free_blocks
        pool.hash_to_num_holders = dict(self.hash_to_num_holders)
        pool.evictable_hashes = OrderedDict(self.evictable_hashes)
        pool.num_prefix_queried_tokens = self.num_prefix_queried_tokens
        pool.num_prefix_hit_tokens = self.num_prefix_hit_tokens
        return pool

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_gpu_blocks - self.num_free_blocks

    def allocate(self, num_blocks: int) -> None:
        """Take ``num_blocks`` free blocks, evicting least recently freed cached ones first
        only when uncached free blocks run short.

        Raises:
            RuntimeError: if fewer than ``num_blocks`` blocks are free (a scheduler bug).
        """
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"allocate: {num_blocks} blocks wanted, {self.num_free_blocks} free")
        evictable = self.evictable_hashes
        num_to_evict = num_blocks - (self.num_free_blocks - len(evictable))
        for _ in range(num_to_evict):
            evictable.popitem(last=False)
        self.num_free_blocks -= num_blocks

    def free(self, request: EngineRequest) -> None:
        """Release every block ``request`` holds; its hashed blocks stay cached if unshared."""
        num_private = request.num_blocks - request.num_hashed_blocks
        self.num_free_blocks += num_private
        if request.num_hashed_blocks:
            holders = self.hash_to_num_holders
            # Last block first, as vLLM frees them: the eviction order (oldest first) then
            # takes a prefix's tail before its head, so what stays cached is still a prefix.
            for block_hash in reversed(request.prefix_block_hashes[:request.num_hashed_blocks]):
                remaining = holders[block_hash] - 1
                if remaining:
                    holders[block_hash] = remaining
                else:
                    del holders[block_hash]
                    self.evictable_hashes[block_hash] = None
                    self.num_free_blocks += 1
        request.num_blocks = 0
        request.num_hashed_blocks = 0

    def probe_prefix(self, request: EngineRequest) -> tuple[int, int]:
        """Leading prompt blocks of a request holding no blocks that are cached, and how
        many of them are evictable (claiming those takes free blocks).

        At least one token is always left to compute, because the step that computes the
        last known token is the one that samples the next.
        """
        max_hits = min(len(request.prefix_block_hashes),
                       (request.num_tokens - 1) // self.block_size)
        holders = self.hash_to_num_holders
        evictable = self.evictable_hashes
        num_hits = num_evictable = 0
        for block_hash in request.prefix_block_hashes[:max_hits]:
            if block_hash in holders:
                num_hits += 1
            elif block_hash in evictable:
                num_hits += 1
                num_evictable += 1
            else:
                break
        return num_hits, num_evictable

    def claim_prefix(self, request: EngineRequest, num_hits: int) -> None:
        """Make ``request`` hold its first ``num_hits`` cached blocks (from :meth:`probe_prefix`)
        and count their tokens as computed."""
        holders = self.hash_to_num_holders
        evictable = self.evictable_hashes
        for block_hash in request.prefix_block_hashes[:num_hits]:
            if block_hash in evictable:
                del evictable[block_hash]
                self.num_free_blocks -= 1
                holders[block_hash] = 1
            else:
                holders[block_hash] += 1
        request.num_blocks = num_hits
        request.num_hashed_blocks = num_hits
        request.num_computed_tokens = num_hits * self.block_size

    def register_computed(self, request: EngineRequest, num_tokens: int) -> None:
        """Register the request's full blocks among its first ``num_tokens`` tokens (prompt,
        or output where its hashes cover it) under their hashes; vLLM's ``cache_blocks``,
        called when those tokens are scheduled.

        A hash already held by another request (two identical prefixes computed at once)
        stops registration: the duplicate stays private to this request.
        """
        hashes = request.prefix_block_hashes
        num_full = min(len(hashes), num_tokens // self.block_size, request.num_blocks)
        holders = self.hash_to_num_holders
        index = request.num_hashed_blocks
        while index < num_full:
            block_hash = hashes[index]
            if block_hash in holders:
                break
            # An evictable copy is superseded by this one; its free block stays free.
            self.evictable_hashes.pop(block_hash, None)
            holders[block_hash] = 1
            index += 1
        request.num_hashed_blocks = index
