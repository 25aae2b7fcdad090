"""Decode spans: runs of decode-only steps with a fixed batch, collapsed into one jump.

Within a span, step ``j`` (1-based) decodes the same ``n`` requests, reads ``K0 + n * j``
KV tokens (``K0``: the tokens computed before the span) and lasts
``base_s + kv_token_s * (K0 + n * j)`` seconds (the latency model is linear in KV tokens
for a fixed batch), so ``k`` steps of it are summed in closed form. Each request needs a
new block every ``block_size`` steps from a known first step, so the blocks the span takes
are counted in closed form too.

A span ends at the first of: a request reaching its output target (that step is part of
the jump: finishing only frees blocks after the step is built), the step that would
preempt (left to the step-by-step path), the step that would start at or after
``until_s``, and the step budget. The batch cannot change inside a span: admission is
blocked at the span's first step, and free blocks only shrink until a request finishes,
so it stays blocked; a decoding request stays decoding.
"""

from __future__ import annotations

from collections import deque

from blockq.engine_model.block_pool import BlockPool
from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import StepLatencyModel
from blockq.engine_model.request import EngineRequest, StepResult


class DecodeSpan:
    """A planned jump over ``num_steps`` decode-only steps; :meth:`try_plan`, then :meth:`apply`.

    ``first_block_steps``: for each running request (in no particular order), the span
    step at which it first needs a new block (then every ``block_size`` steps).
    """

    __slots__ = ("num_steps", "started_at_s", "base_s", "kv_token_s", "num_kv_tokens",
                 "first_block_steps", "block_size", "num_finishing_steps")

    def __init__(self, started_at_s: float, base_s: float, kv_token_s: float,
                 num_kv_tokens: int, first_block_steps: list[int], block_size: int,
                 num_finishing_steps: int) -> None:
        self.num_steps = 0
        self.started_at_s = started_at_s
        self.base_s = base_s
        self.kv_token_s = kv_token_s
        self.num_kv_tokens = num_kv_tokens
        self.first_block_steps = first_block_steps
        self.block_size = block_size
        self.num_finishing_steps = num_finishing_steps

    # --- planning -------------------------------------------------------------------------

    @classmethod
    def try_plan(cls, config: EngineConfig, running: list[EngineRequest],
                 waiting: deque[EngineRequest], pool: BlockPool,
                 latency_model: StepLatencyModel, now_s: float, max_num_steps: int,
                 until_s: float) -> DecodeSpan | None:
        """The longest span from the current state, within ``max_num_steps`` (>= 1) steps
        and only steps starting before ``until_s`` (> ``now_s``); None when the next step
        is not a decode-only step of a fixed batch (it must then run step by step)."""
        span = cls._try_scan_decodes(running, config.block_size, now_s)
        if span is None:
            return None
        num_free_blocks = pool.num_free_blocks
        num_first_step_blocks = span.num_new_blocks(1)
        if num_first_step_blocks > num_free_blocks:
            return None  # the first step preempts
        if _can_admit_head(config, waiting, len(running), num_free_blocks - num_first_step_blocks):
            return None
        span.base_s = latency_model.step_seconds(0, len(running), 0, 0)
        span.kv_token_s = latency_model.kv_token_s
        num_steps = min(span.num_finishing_steps, max_num_steps)
        num_steps = span._max_steps_within_blocks(num_steps, num_free_blocks)
        span.num_steps = span._max_steps_starting_before(num_steps, until_s)
        return span

    @classmethod
    def _try_scan_decodes(cls, running: list[EngineRequest], block_size: int,
                          now_s: float) -> DecodeSpan | None:
        """Per-request figures of the span, or None if some running request is not decoding."""
        if not running:
            return None
        num_kv_tokens = 0
        num_finishing_steps = running[0].output_target_tokens
        first_block_steps: list[int] = []
        # Newest first: a request still prefilling is most likely one just admitted, at
        # the end, so the scan that fails fails early. The figures do not depend on order.
        for request in reversed(running):
            num_generated = request.num_generated_tokens
            num_computed = request.num_computed_tokens
            if num_generated == 0 or num_computed + 1 != request.prompt_tokens + num_generated:
                return None  # still prefilling: the step schedules a chunk
            num_kv_tokens += num_computed
            num_remaining = request.output_target_tokens - num_generated
            if num_remaining < num_finishing_steps:
                num_finishing_steps = num_remaining
            # The step computing token `num_computed` needs a block once the held ones are full.
            first_block_steps.append(request.num_blocks * block_size - num_computed + 1)
        return cls(now_s, 0.0, 0.0, num_kv_tokens, first_block_steps, block_size,
                   num_finishing_steps)

    def num_new_blocks(self, num_steps: int) -> int:
        """Blocks the batch allocates over its first ``num_steps`` span steps."""
        block_size = self.block_size
        total = 0
        for first_step in self.first_block_steps:
            if first_step <= num_steps:
                total += (num_steps - first_step) // block_size + 1
        return total

    def _max_steps_within_blocks(self, num_steps: int, num_free_blocks: int) -> int:
        """The most steps (<= ``num_steps``, >= 1) whose blocks fit in the free ones.

        Within one step the requests allocate in running order, but the span's total only
        grows, so "no step preempts" is "the total after the last step fits".
        """
        if self.num_new_blocks(num_steps) <= num_free_blocks:
            return num_steps
        fits, overflows = 1, num_steps  # the caller checked that step 1 fits
        while overflows - fits > 1:
            middle = (fits + overflows) // 2
            if self.num_new_blocks(middle) <= num_free_blocks:
                fits = middle
            else:
                overflows = middle
        return fits

    def seconds(self, num_steps: int) -> float:
        """Duration of the span's first ``num_steps`` steps."""
        num_seqs = len(self.first_block_steps)
        # sum over j = 1..k of (K0 + n * j) KV tokens, exactly, in integers
        num_kv_tokens = self.num_kv_tokens * num_steps + num_seqs * num_steps * (num_steps + 1) // 2
        return num_steps * self.base_s + self.kv_token_s * num_kv_tokens

    def _max_steps_starting_before(self, num_steps: int, until_s: float) -> int:
        """The most steps (<= ``num_steps``, >= 1) whose last one starts before ``until_s``."""
        started_at_s = self.started_at_s
        if started_at_s + self.seconds(num_steps - 1) < until_s:
            return num_steps
        starts_before, starts_after = 1, num_steps  # step 1 starts at now_s < until_s
        while starts_after - starts_before > 1:
            middle = (starts_before + starts_after) // 2
            if started_at_s + self.seconds(middle - 1) < until_s:
                starts_before = middle
            else:
                starts_after = middle
        return starts_before

    # --- applying -------------------------------------------------------------------------

    def apply(self, running: list[EngineRequest], waiting: deque[EngineRequest], pool: BlockPool,
              step_results: list[StepResult] | None) -> list[EngineRequest]:
        """Advance every running request by ``num_steps`` decode steps, take their blocks,
        and finish (stamp, free, remove) those reaching their target at the last step.

        Appends one synthesised :class:`StepResult` per step to ``step_results`` unless it is
        None. Returns the finished requests, in running order; the span ends at
        ``started_at_s + seconds(num_steps)``.
        """
        num_steps = self.num_steps
        block_size = self.block_size
        num_used_before = pool.num_used_blocks
        batch_ids = tuple(request.request_id for request in running) if step_results is not None else ()
        num_new_blocks = 0
        finished: list[EngineRequest] = []
        for request in running:
            num_computed = request.num_computed_tokens + num_steps
            request.num_computed_tokens = num_computed
            num_generated = request.num_generated_tokens + num_steps
            request.num_generated_tokens = num_generated
            num_blocks = -(-num_computed // block_size)
            if num_blocks > request.num_blocks:
                num_new_blocks += num_blocks - request.num_blocks
                request.num_blocks = num_blocks
            if num_generated >= request.output_target_tokens:
                finished.append(request)
        # Every block is taken while the last step is built, before finishes free any.
        pool.allocate(num_new_blocks)
        if finished:
            _finish(finished, running, pool, self.started_at_s + self.seconds(num_steps))
        if step_results is not None:
            self._append_step_results(step_results, batch_ids, num_used_before, finished,
                                      len(running), len(waiting), pool.num_used_blocks)
        return finished

    def _append_step_results(self, step_results: list[StepResult], batch_ids: tuple[str, ...],
                             num_used_before: int, finished: list[EngineRequest],
                             num_running_after: int, num_waiting: int, num_used_after: int) -> None:
        """One :class:`StepResult` per span step, as :meth:`EngineScheduler.step` reports it."""
        num_steps = self.num_steps
        num_seqs = len(batch_ids)
        started_at_s = self.started_at_s
        base_s = self.base_s
        kv_token_s = self.kv_token_s
        num_new_blocks_by_step = [0] * (num_steps + 1)
        for first_step in self.first_block_steps:
            for step in range(max(first_step, 1), num_steps + 1, self.block_size):
                num_new_blocks_by_step[step] += 1
        num_used_blocks = num_used_before
        for step in range(1, num_steps + 1):
            num_kv_tokens = self.num_kv_tokens + num_seqs * step
            num_used_blocks += num_new_blocks_by_step[step]
            last = step == num_steps
            step_results.append(StepResult(
                started_at_s + self.seconds(step - 1), base_s + kv_token_s * num_kv_tokens, 0,
                num_seqs, num_kv_tokens, batch_ids, (), tuple(finished) if last else (), (), 0,
                num_used_after if last else num_used_blocks,
                num_running_after if last else num_seqs, num_waiting))


def _can_admit_head(config: EngineConfig, waiting: deque[EngineRequest], num_running: int,
                     num_free_blocks: int) -> bool:
    """Whether the step would admit the head of the queue after its decodes took their
    blocks (``num_free_blocks`` left), as phase 3 of a step decides without prefix caching."""
    if not waiting or num_running >= config.max_num_seqs:
        return False
    token_budget = config.max_num_batched_tokens - num_running
    if token_budget <= 0:
        return False
    num_new = min(waiting[0].num_tokens, token_budget)
    num_blocks_needed = -(-num_new // config.block_size)
    return num_free_blocks - num_blocks_needed >= config.watermark_blocks


def _finish(finished: list[EngineRequest], running: list[EngineRequest], pool: BlockPool,
            ended_at_s: float) -> None:
    """Stamp and free the finished requests and remove them from ``running``."""
    for request in finished:
        request.finished_at_s = ended_at_s
        pool.free(request)
    running[:] = [r for r in running if r.num_generated_tokens < r.output_target_tokens]
