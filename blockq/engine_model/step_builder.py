"""One engine step: build the batch (vLLM V1's policy, phase by phase), then run it.

Phases, under one token budget (``max_num_batched_tokens``), as
``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule`` builds a step:

1. **Running requests**, in running order, each get the tokens they lack (one for a
   decode, a chunk for a prefill), capped by ``long_prefill_token_threshold`` when more
   than one request is running or waiting, and by what is left of the budget. Running
   order, not decodes first: a long chunk ahead of a decode can take the whole budget.
2. **New prefills** are admitted from the FCFS waiting queue while the budget and a
   sequence slot allow, and while the whole request (not just its first chunk) fits in
   the free blocks beside the watermark (vLLM's ``scheduler_reserve_full_isl``; the
   watermark only once some request is running). The first request that does not fit
   stops admission (no skipping). No request is admitted in a step that preempted one.
3. **Execution**: computed tokens advance; a request whose computed tokens reach its
   known tokens samples one output token; one at its output target finishes and frees
   its blocks.

A running request that needs a KV block when none is free preempts, by recompute, the
most recently started running request (the end of ``running``; itself if it is last).
With prefix caching, blocks are registered in the cache when the tokens that fill them
are scheduled (vLLM's ``allocate_slots`` caches them), so a request admitted later in the
same step already hits them.

With LoRA (``max_loras`` > 0), phase 2 skips a waiting request whose adapter would be one
too many in the batch, and phase 3 loads the adapters the batch needs that are not
resident (:mod:`blockq.engine_model.lora`).
"""

from __future__ import annotations

from collections import deque

from blockq.engine_model.block_pool import BlockPool
from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import StepLatencyModel
from blockq.engine_model.lora import load_adapters, skips_for_lora
from blockq.engine_model.request import EngineRequest, StepResult


class StepBuilder:
    """Builds one step over a scheduler's queues and block pool, which it mutates in place.

    Use once: :meth:`schedule`, then :meth:`execute`.
    """

    __slots__ = ("config", "block_size", "running", "waiting", "pool", "token_budget",
                 "long_prefill_threshold", "scheduled", "num_scheduled_tokens", "preempted", "loaded_loras")

    def __init__(self, config: EngineConfig, running: list[EngineRequest],
                 waiting: deque[EngineRequest], pool: BlockPool, loaded_loras: list[int] | None = None) -> None:
        self.config = config
        self.loaded_loras = loaded_loras if loaded_loras is not None else []  # resident adapters, LRU first
        self.block_size = config.block_size
        self.running = running
        self.waiting = waiting
        self.pool = pool
        self.token_budget = config.max_num_batched_tokens
        # vLLM lifts the cap when one request is alone: there is nobody to starve.
        self.long_prefill_threshold = (config.long_prefill_token_threshold
                                       if len(running) + len(waiting) > 1 else 0)
        # this step's batch: requests and their token counts, in parallel lists
        self.scheduled: list[EngineRequest] = []
        self.num_scheduled_tokens: list[int] = []
        self.preempted: list[EngineRequest] = []

    def schedule(self, now_s: float) -> None:
        """Phases 1-2: choose this step's batch, allocating blocks and preempting."""
        self._schedule_running()
        if not self.preempted:
            self._admit_waiting(now_s)

    def _num_new_tokens(self, request: EngineRequest, num_computed: int) -> int:
        num_new = request.num_tokens - num_computed
        threshold = self.long_prefill_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        return min(num_new, self.token_budget)

    def _schedule_running(self) -> None:
        """Phase 1: every running request, in order, until the budget or the blocks run out.
        A request stops at max_model_len, so vLLM's cap there never binds.

        The hot loop of every step (mostly decodes): its arithmetic (the caps of
        :meth:`_num_new_tokens`) is inline, and blocks are reserved only when a request's
        tokens cross into a block it does not hold."""
        running = self.running
        block_size = self.block_size
        threshold = self.long_prefill_threshold
        scheduled, num_scheduled_tokens = self.scheduled, self.num_scheduled_tokens
        register_prefix = self.config.enable_prefix_caching
        budget = self.token_budget
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_computed = request.num_computed_tokens
            num_new = request.prompt_tokens + request.num_generated_tokens - num_computed
            if num_new > 1:  # a decode's one token is under every cap and the budget (> 0)
                if 0 < threshold < num_new:
                    num_new = threshold
                if num_new > budget:
                    num_new = budget
            num_reached = num_computed + num_new
            # Victims come from the end of `running`, beyond this request: nothing
            # scheduled so far is undone.
            if num_reached > request.num_blocks * block_size and not self._try_reserve_blocks(
                    request, -(-num_reached // block_size) - request.num_blocks):
                break
            scheduled.append(request)
            num_scheduled_tokens.append(num_new)
            budget -= num_new
            if register_prefix:
                self.pool.register_computed(request, num_reached)
            index += 1
        self.token_budget = budget

    def _admit_waiting(self, now_s: float) -> None:
        """Phase 2: admit waiting requests in FCFS order; stop at the first that does not fit."""
        config = self.config
        pool = self.pool
        block_size = self.block_size
        waiting = self.waiting
        use_prefix_cache = config.enable_prefix_caching
        max_loras = config.max_loras
        scheduled_loras = {r.lora_id for r in self.scheduled if r.lora_id} if max_loras else set()
        skipped: list[EngineRequest] = []
        while waiting and self.token_budget > 0 and len(self.running) < config.max_num_seqs:
            request = waiting[0]
            if max_loras and skips_for_lora(request.lora_id, scheduled_loras, max_loras):
                skipped.append(waiting.popleft())  # vLLM's `continue`: later requests may go first
                continue
            num_hits = num_evictable_hits = 0
            if use_prefix_cache and request.prefix_block_hashes:
                num_hits, num_evictable_hits = pool.probe_prefix(request)
            num_computed = num_hits * block_size
            num_new = self._num_new_tokens(request, num_computed)
            # The watermark applies only beside requests already running (vLLM's
            # allocate_slots, has_scheduled_reqs); the whole request must fit.
            watermark_blocks = config.watermark_blocks if self.running else 0
            num_request_blocks = -(-request.num_tokens // block_size) - num_hits
            if num_request_blocks + num_evictable_hits + watermark_blocks > pool.num_free_blocks:
                break
            waiting.popleft()
            if use_prefix_cache:
                # Counted at every admission, re-admissions after a preemption included.
                pool.num_prefix_queried_tokens += request.num_tokens
                pool.num_prefix_hit_tokens += num_computed
            if num_hits:
                pool.claim_prefix(request, num_hits)
            num_blocks_needed = -(-(num_computed + num_new) // block_size) - num_hits
            pool.allocate(num_blocks_needed)
            request.num_blocks += num_blocks_needed
            if request.first_scheduled_at_s is None:
                request.first_scheduled_at_s = now_s
            self.running.append(request)
            self._add_to_batch(request, num_new)
            if request.lora_id:
                scheduled_loras.add(request.lora_id)
        waiting.extendleft(reversed(skipped))  # back at the front, in their order

    def _add_to_batch(self, request: EngineRequest, num_new_tokens: int) -> None:
        self.scheduled.append(request)
        self.num_scheduled_tokens.append(num_new_tokens)
        self.token_budget -= num_new_tokens
        if self.config.enable_prefix_caching:
            self.pool.register_computed(request, request.num_computed_tokens + num_new_tokens)

    def _try_reserve_blocks(self, request: EngineRequest, num_blocks: int) -> bool:
        """Allocate blocks for a running request, preempting from the end of ``running``
        until they fit; False if the request itself had to be preempted."""
        pool = self.pool
        while num_blocks > pool.num_free_blocks:
            victim = self.running.pop()
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

    # --- phase 3 ----------------------------------------------------------------------------

    def execute(self, started_at_s: float, duration_s: float | None,
                latency_model: StepLatencyModel) -> StepResult:
        """Phase 3: run the batch for ``duration_s`` (None: the latency model's time; zero
        for an empty batch) and report what happened."""
        produced: list[str] = []
        first_tokens: list[EngineRequest] = []
        finished: list[EngineRequest] = []
        num_decode_seqs = num_prefill_tokens = num_kv_tokens = num_pairs = 0
        # In scheduling order, as vLLM's update_from_output walks the batch: finished
        # requests free their blocks in this order, which orders the prefix cache's LRU.
        for request, num_new in zip(self.scheduled, self.num_scheduled_tokens, strict=True):
            num_computed = request.num_computed_tokens
            num_generated = request.num_generated_tokens
            num_known = request.prompt_tokens + num_generated
            if num_generated and num_computed + 1 == num_known:  # a decode
                num_decode_seqs += 1
            else:
                num_prefill_tokens += num_new
                num_pairs += num_new * (2 * num_computed + num_new + 1) // 2
            num_computed += num_new
            request.num_computed_tokens = num_computed
            num_kv_tokens += num_computed
            if num_computed == num_known:
                num_generated += 1
                request.num_generated_tokens = num_generated
                produced.append(request.request_id)
                if num_generated == 1:
                    first_tokens.append(request)
                if num_generated >= request.output_target_tokens:
                    finished.append(request)
        num_lora_loads, lora_load_s = 0, 0.0
        if self.config.max_loras:
            num_lora_loads = load_adapters(self.loaded_loras, (r.lora_id for r in self.scheduled),
                                           self.config.max_loras)
            lora_load_s = num_lora_loads * self.config.lora_load_ms / 1000
        if duration_s is None:
            duration_s = latency_model.step_seconds(
                num_prefill_tokens, num_decode_seqs, num_kv_tokens, num_pairs
            ) + lora_load_s if self.scheduled else 0.0
        else:
            lora_load_s = min(lora_load_s, duration_s)  # a measured time includes its loads
        self._finish(first_tokens, finished, started_at_s + duration_s)
        return StepResult(
            started_at_s, duration_s, num_prefill_tokens, num_decode_seqs, num_kv_tokens,
            tuple(produced), tuple(r.request_id for r in first_tokens), tuple(finished),
            tuple(r.request_id for r in self.preempted), num_pairs, self.pool.num_used_blocks,
            len(self.running), len(self.waiting),
            tuple(zip([r.request_id for r in self.scheduled], self.num_scheduled_tokens,
                      strict=True)), num_lora_loads, lora_load_s)

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
