"""One engine step: build the batch (vLLM's policy, phase by phase), then run it.

Phases, under one token budget (``max_num_batched_tokens``):

1. **Running decodes** get one token each, in running order.
2. **Running prefills** (prompts, or prompt + output after a preemption, not yet fully
   computed) get chunks from what is left of the budget, in running order.
3. **New prefills** are admitted from the FCFS waiting queue while the budget, a sequence
   slot and the KV watermark allow; the first request that does not fit stops admission
   (no skipping). No request is admitted in a step that preempted one, as in vLLM.
4. **Execution**: computed tokens advance; a request whose computed tokens reach its
   known tokens samples one output token; one at its output target finishes and frees
   its blocks.

A running request that needs a KV block when none is free preempts, by recompute, the
most recently started running request (the end of ``running``; itself if it is last).
"""

from __future__ import annotations

from collections import deque

from blockq.engine_model.block_pool import BlockPool
from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import StepLatencyModel
from blockq.engine_model.request import EngineRequest, StepResult


class StepBuilder:
    """Builds one step over a scheduler's queues and block pool, which it mutates in place.

    Use once: :meth:`schedule`, then :meth:`execute`.
    """

    __slots__ = ("config", "block_size", "running", "waiting", "pool", "token_budget",
                 "decodes", "prefills", "prefill_num_new_tokens", "preempted")

    def __init__(self, config: EngineConfig, running: list[EngineRequest],
                 waiting: deque[EngineRequest], pool: BlockPool) -> None:
        self.config = config
        self.block_size = config.block_size
        self.running = running
        self.waiting = waiting
        self.pool = pool
        self.token_budget = config.max_num_batched_tokens
        self.decodes: list[EngineRequest] = []
        # prefill chunks: requests and their token counts, in parallel lists
        self.prefills: list[EngineRequest] = []
        self.prefill_num_new_tokens: list[int] = []
        self.preempted: list[EngineRequest] = []

    def schedule(self, now_s: float) -> None:
        """Phases 1-3: choose this step's batch, allocating blocks and preempting."""
        ongoing_prefills = self._schedule_running_decodes()
        self._schedule_running_prefills(ongoing_prefills)
        if not self.preempted:
            self._admit_waiting(now_s)

    def _schedule_running_decodes(self) -> list[EngineRequest]:
        """Phase 1; returns the running requests that are still prefilling, in order."""
        running = self.running
        block_size = self.block_size
        decodes = self.decodes
        ongoing_prefills: list[EngineRequest] = []
        index = 0
        while index < len(running):
            request = running[index]
            index += 1
            num_generated = request.num_generated_tokens
            num_computed = request.num_computed_tokens
            if num_generated == 0 or num_computed + 1 != request.prompt_tokens + num_generated:
                ongoing_prefills.append(request)
                continue
            # Victims come from the end of `running`, beyond this request, so nothing
            # scheduled so far is undone here.
            if num_computed >= request.num_blocks * block_size \
                    and not self._try_reserve_blocks(request, 1):
                break
            decodes.append(request)
        # max_num_batched_tokens >= max_num_seqs, so every decode fits the budget.
        self.token_budget -= len(decodes)
        return ongoing_prefills

    def _schedule_running_prefills(self, ongoing_prefills: list[EngineRequest]) -> None:
        """Phase 2: budget-limited chunks for running requests still computing."""
        block_size = self.block_size
        for request in ongoing_prefills:
            if self.token_budget <= 0:
                break
            if self.preempted and any(victim is request for victim in self.preempted):
                continue  # preempted earlier in this phase to make room
            num_computed = request.num_computed_tokens
            num_new = min(request.num_tokens - num_computed, self.token_budget)
            num_blocks_needed = -(-(num_computed + num_new) // block_size) - request.num_blocks
            if num_blocks_needed > 0 and not self._try_reserve_blocks(request, num_blocks_needed):
                break
            self._add_prefill(request, num_new)

    def _admit_waiting(self, now_s: float) -> None:
        """Phase 3: admit waiting requests in FCFS order; stop at the first that does not fit."""
        config = self.config
        pool = self.pool
        block_size = self.block_size
        waiting = self.waiting
        watermark_blocks = config.watermark_blocks
        use_prefix_cache = config.enable_prefix_caching
        while waiting and self.token_budget > 0 and len(self.running) < config.max_num_seqs:
            request = waiting[0]
            num_hits = num_evictable_hits = 0
            if use_prefix_cache and request.prefix_block_hashes:
                num_hits, num_evictable_hits = pool.probe_prefix(request)
            num_computed = num_hits * block_size
            num_new = min(request.num_tokens - num_computed, self.token_budget)
            num_blocks_needed = -(-(num_computed + num_new) // block_size) - num_hits
            if pool.num_free_blocks - num_evictable_hits - num_blocks_needed < watermark_blocks:
                break
            waiting.popleft()
            if use_prefix_cache:
                # Counted at every admission, re-admissions after a preemption included.
                pool.num_prefix_queried_tokens += request.num_tokens
                pool.num_prefix_hit_tokens += num_computed
            if num_hits:
                pool.claim_prefix(request, num_hits)
            pool.allocate(num_blocks_needed)
            request.num_blocks += num_blocks_needed
            if request.first_scheduled_at_s is None:
                request.first_scheduled_at_s = now_s
            self.running.append(request)
            self._add_prefill(request, num_new)

    def _add_prefill(self, request: EngineRequest, num_new_tokens: int) -> None:
        self.prefills.append(request)
        self.prefill_num_new_tokens.append(num_new_tokens)
        self.token_budget -= num_new_tokens

    def _try_reserve_blocks(self, request: EngineRequest, num_blocks: int) -> bool:
        """Allocate blocks for a running request, preempting from the end of ``running``
        until they fit; False if the request itself had to be preempted."""
        pool = self.pool
        while num_blocks > pool.num_free_blocks:
            victim = self.running.pop()
            self._unschedule(victim)
            pool.free(victim)
            victim.num_computed_tokens = 0
            victim.num_preemptions += 1
            self.waiting.appendleft(victim)
            self.preempted.append(victim)
            if victim is request:
                return False
        pool.allocate(num_blocks)
        request.num_blocks += num_blocks
        return True

    def _unschedule(self, request: EngineRequest) -> None:
        """Take a request out of this step's batch (if in it) and return its tokens."""
        for index in range(len(self.decodes) - 1, -1, -1):
            if self.decodes[index] is request:
                del self.decodes[index]
                self.token_budget += 1
                return
        for index in range(len(self.prefills) - 1, -1, -1):
            if self.prefills[index] is request:
                del self.prefills[index]
                self.token_budget += self.prefill_num_new_tokens.pop(index)
                return

    # --- phase 4 ----------------------------------------------------------------------------

    def execute(self, started_at_s: float, duration_s: float | None,
                latency_model: StepLatencyModel) -> StepResult:
        """Phase 4: run the batch for ``duration_s`` (None: the latency model's time; zero
        for an empty batch) and report what happened."""
        produced: list[str] = []
        first_tokens: list[EngineRequest] = []
        finished: list[EngineRequest] = []
        num_decode_kv_tokens = self._advance_decodes(produced, finished)
        num_prefill_tokens, num_prefill_kv_tokens, num_pairs = self._advance_prefills(
            produced, first_tokens, finished)
        num_kv_tokens = num_decode_kv_tokens + num_prefill_kv_tokens
        if duration_s is None:
            duration_s = latency_model.step_seconds(
                num_prefill_tokens, len(self.decodes), num_kv_tokens, num_pairs
            ) if self.decodes or self.prefills else 0.0
        self._finish(first_tokens, finished, started_at_s + duration_s)
        return StepResult(
            started_at_s, duration_s, num_prefill_tokens, len(self.decodes), num_kv_tokens,
            tuple(produced), tuple(r.request_id for r in first_tokens), tuple(finished),
            tuple(r.request_id for r in self.preempted), num_pairs, self.pool.num_used_blocks,
            len(self.running), len(self.waiting))

    def _advance_decodes(self, produced: list[str], finished: list[EngineRequest]) -> int:
        """Every decode computes one token and samples one; returns the KV tokens read.
        With prefix caching, a token that fills a block registers that block, as vLLM
        caches output blocks (when the request's hashes reach that far: a known answer's)."""
        num_kv_tokens = 0
        pool, block_size = self.pool, self.config.block_size
        register_prefix = self.config.enable_prefix_caching
        for request in self.decodes:
            num_computed = request.num_computed_tokens + 1
            request.num_computed_tokens = num_computed
            num_kv_tokens += num_computed
            if register_prefix and num_computed % block_size == 0:
                pool.register_computed(request)
            num_generated = request.num_generated_tokens + 1
            request.num_generated_tokens = num_generated
            produced.append(request.request_id)
            if num_generated >= request.output_target_tokens:
                finished.append(request)
        return num_kv_tokens

    def _advance_prefills(self, produced: list[str], first_tokens: list[EngineRequest],
                          finished: list[EngineRequest]) -> tuple[int, int, int]:
        """Compute every prefill chunk; a chunk that completes the known tokens samples one.

        Returns prefill tokens, KV tokens read and (query, key) pairs of the chunks.
        """
        num_prefill_tokens = num_kv_tokens = num_pairs = 0
        register_prefix = self.config.enable_prefix_caching
        for request, num_new in zip(self.prefills, self.prefill_num_new_tokens, strict=True):
            num_computed = request.num_computed_tokens
            num_prefill_tokens += num_new
            num_pairs += num_new * (2 * num_computed + num_new + 1) // 2
            num_computed += num_new
            request.num_computed_tokens = num_computed
            num_kv_tokens += num_computed
            if register_prefix:
                self.pool.register_computed(request)
            if num_computed == request.prompt_tokens + request.num_generated_tokens:
                request.num_generated_tokens += 1
                produced.append(request.request_id)
                if request.num_generated_tokens == 1:
                    first_tokens.append(request)
                if request.num_generated_tokens >= request.output_target_tokens:
                    finished.append(request)
        return num_prefill_tokens, num_kv_tokens, num_pairs

    def _finish(self, first_tokens: list[EngineRequest], finished: list[EngineRequest],
                ended_at_s: float) -> None:
        """Stamp first tokens and finishes; free finished requests' blocks."""
        for request in first_tokens:
            request.first_token_at_s = ended_at_s
        if not finished:
            return
        for request in finished:
            request.finished_at_s = ended_at_s
            self.pool.free(request)
        self.running[:] = [r for r in self.running if r.num_generated_tokens < r.output_target_tokens]
