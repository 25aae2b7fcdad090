"""Draining: with nobody waiting, the running requests decode to their ends in one pass.

Preconditions, checked by :meth:`DecodeDrain.try_plan`: the waiting queue is empty (so
nothing is ever admitted), every running request is decoding, and the blocks the running
requests will still take until each finishes fit in the free ones (so nothing is ever
preempted; blocks that finishes free only add room). Then the batch changes only when
requests finish: between consecutive finish steps it is fixed, and each such *segment* is
a decode span summed in closed form (see :mod:`blockq.engine_model.decode_span`). The
segments are walked in finish order, so a drain costs a sort and O(1) per finish instead
of a scan of the batch per finish.
"""

from __future__ import annotations

from collections import deque
from operator import itemgetter

import numpy as np

from blockq.engine_model.block_pool import BlockPool
from blockq.engine_model.latency import StepLatencyModel
from blockq.engine_model.request import EngineRequest


class DecodeDrain:
    """A planned drain of ``num_steps`` steps over ``num_segments`` segments;
    :meth:`try_plan`, then :meth:`apply`.

    ``finish_step_to_time_s``: for each span step (1-based) at which requests finish
    within the drain, when that step ends. ``ended_at_s``: when the drain's last step ends.
    """

    __slots__ = ("num_steps", "num_segments", "ended_at_s", "finish_step_to_time_s",
                 "block_size")

    def __init__(self, started_at_s: float, block_size: int) -> None:
        self.num_steps = 0
        self.num_segments = 0
        self.ended_at_s = started_at_s
        self.finish_step_to_time_s: dict[int, float] = {}
        self.block_size = block_size

    @classmethod
    def try_plan(cls, running: list[EngineRequest], waiting: deque[EngineRequest],
                 pool: BlockPool, block_size: int, latency_model: StepLatencyModel,
                 now_s: float, max_num_steps: int, until_s: float,
                 stop_request: EngineRequest | None) -> DecodeDrain | None:
        """The drain from the current state, within ``max_num_steps`` (>= 1) steps, only
        steps starting before ``until_s`` (> ``now_s``), and ending at the finish of
        ``stop_request`` if given; None when the preconditions do not hold."""
        if waiting or not running:
            return None
        batch = _DecodeBatch.try_scan(running, block_size)
        if batch is None:
            return None
        finish_steps = sorted(batch.finish_step_to_batch)
        if batch.num_blocks_to_finish > pool.num_free_blocks:
            # Finishes free blocks on the way: find the segments that still never preempt.
            num_safe_segments = batch.num_segments_without_preemption(
                finish_steps, pool.num_free_blocks, block_size)
            if num_safe_segments == 0:
                return None
            max_num_steps = min(max_num_steps, finish_steps[num_safe_segments - 1])
        if stop_request is not None:
            num_stop_steps = stop_request.output_target_tokens - stop_request.num_generated_tokens
            max_num_steps = min(max_num_steps, num_stop_steps)
        drain = cls(now_s, block_size)
        drain._walk_segments(batch.finish_step_to_batch, finish_steps, len(running),
                             latency_model, max_num_steps, until_s)
        return drain

    def _walk_segments(self, finish_step_to_batch: dict[int, tuple[int, int]],
                       finish_steps: list[int], num_seqs: int, latency_model: StepLatencyModel,
                       max_num_steps: int, until_s: float) -> None:
        """Sum the segments in finish order until the last finish or a stop rule."""
        kv_token_s = latency_model.kv_token_s
        num_kv_tokens = sum(num_computed for _, num_computed in finish_step_to_batch.values())
        num_steps_done = 0
        time_s = self.ended_at_s
        for finish_step in finish_steps:
            base_s = latency_model.step_seconds(0, num_seqs, 0, 0)
            segment = (num_steps_done, num_seqs, num_kv_tokens, base_s, kv_token_s)
            num_steps = _max_steps_starting_before(
                segment, min(finish_step, max_num_steps) - num_steps_done, time_s, until_s)
            if num_steps == 0:
                break
            self.num_segments += 1
            num_steps_done += num_steps
            time_s += _segment_seconds(num_steps, *segment)
            if num_steps_done < finish_step:
                break  # cut by until_s or the step budget
            self.finish_step_to_time_s[finish_step] = time_s
            num_finishing, num_finishing_kv_tokens = finish_step_to_batch[finish_step]
            num_seqs -= num_finishing
            num_kv_tokens -= num_finishing_kv_tokens
            if num_steps_done >= max_num_steps:
                break
        self.num_steps = num_steps_done
        self.ended_at_s = time_s

    def apply(self, running: list[EngineRequest], pool: BlockPool) -> list[EngineRequest]:
        """Advance every running request by the drain's steps (or to its finish), take
        their blocks, and stamp, free and remove the finished ones; returns those in the
        order stepping finishes them (by finish time, then running order)."""
        num_steps = self.num_steps
        block_size = self.block_size
        finish_step_to_time_s = self.finish_step_to_time_s
        num_new_blocks = 0
        finished: list[tuple[int, EngineRequest]] = []  # (finish step, request)
        unfinished: list[EngineRequest] = []
        for request in running:
            num_remaining = request.output_target_tokens - request.num_generated_tokens
            num_advanced = num_remaining if num_remaining < num_steps else num_steps
            num_computed = request.num_computed_tokens + num_advanced
            request.num_computed_tokens = num_computed
            request.num_generated_tokens += num_advanced
            if num_remaining <= num_steps:
                # what it took during the drain it gave back: only its first blocks return
                pool.free(request)
                request.finished_at_s = finish_step_to_time_s[num_remaining]
                finished.append((num_remaining, request))
                continue
            num_blocks = -(-num_computed // block_size)
            if num_blocks > request.num_blocks:
                num_new_blocks += num_blocks - request.num_blocks
                request.num_blocks = num_blocks
            unfinished.append(request)
        pool.allocate(num_new_blocks)
        running[:] = unfinished
        finished.sort(key=itemgetter(0))  # stable: running order within one step
        return [request for _, request in finished]


class _DecodeBatch:
    """The running requests' figures a drain needs, in running order."""

    __slots__ = ("computed", "blocks", "remaining", "finish_step_to_batch",
                 "num_blocks_to_finish")

    def __init__(self) -> None:
        self.computed: list[int] = []
        self.blocks: list[int] = []
        self.remaining: list[int] = []
        # finish step -> (requests finishing then, sum of their computed tokens now)
        self.finish_step_to_batch: dict[int, tuple[int, int]] = {}
        # blocks the requests take until each finishes, ignoring what finishes free
        self.num_blocks_to_finish = 0

    @classmethod
    def try_scan(cls, running: list[EngineRequest], block_size: int) -> _DecodeBatch | None:
        """The figures, or None if some running request is still prefilling."""
        batch = cls()
        finish_step_to_batch = batch.finish_step_to_batch
        num_blocks_to_finish = 0
        for request in running:
            num_generated = request.num_generated_tokens
            num_computed = request.num_computed_tokens
            if num_generated == 0 or num_computed + 1 != request.prompt_tokens + num_generated:
                return None
            num_remaining = request.output_target_tokens - num_generated
            # the finishing step computes token num_computed + num_remaining - 1
            num_needed = -(-(num_computed + num_remaining) // block_size) - request.num_blocks
            if num_needed > 0:
                num_blocks_to_finish += num_needed
            batch.computed.append(num_computed)
            batch.blocks.append(request.num_blocks)
            batch.remaining.append(num_remaining)
            count, num_kv_tokens = finish_step_to_batch.get(num_remaining, (0, 0))
            finish_step_to_batch[num_remaining] = (count + 1, num_kv_tokens + num_computed)
        batch.num_blocks_to_finish = num_blocks_to_finish
        return batch

    def num_segments_without_preemption(self, finish_steps: list[int], num_free_blocks: int,
                                        block_size: int) -> int:
        """How many leading segments (ending at ``finish_steps``) no step preempts in.

        A step ``j`` fits when the blocks the requests still running at ``j`` took through
        ``j`` are at most the free blocks plus those held at the start by requests that
        finished before ``j`` (what a finished request took during the drain, it gave back).
        Within a segment the running set is fixed and its demand only grows, so checking
        each segment's last step is enough.
        """
        computed = np.array(self.computed)
        blocks = np.array(self.blocks)
        remaining = np.array(self.remaining)
        ends = np.array(finish_steps)[:, None]  # one row per segment
        still_running = remaining >= ends
        taken = np.maximum(-(-(computed + ends) // block_size) - blocks, 0)
        demand = np.where(still_running, taken, 0).sum(axis=1)
        given_back = np.where(still_running, 0, blocks).sum(axis=1)
        fits = demand <= num_free_blocks + given_back
        return len(finish_steps) if fits.all() else int(np.argmin(fits))


def _segment_seconds(num_steps: int, num_steps_before: int, num_seqs: int,
                     num_kv_tokens: int, base_s: float, kv_token_s: float) -> float:
    """Duration of a segment's first ``num_steps`` steps: drain steps
    ``num_steps_before + 1 ..`` of ``num_seqs`` decodes whose computed tokens summed to
    ``num_kv_tokens`` before the drain (step ``j`` reads ``num_kv_tokens + num_seqs * j``)."""
    num_kv_read = num_kv_tokens * num_steps + num_seqs * (
        num_steps * num_steps_before + num_steps * (num_steps + 1) // 2)
    return num_steps * base_s + kv_token_s * num_kv_read


def _max_steps_starting_before(segment: tuple[int, int, int, float, float], num_steps: int,
                               started_at_s: float, until_s: float) -> int:
    """The most steps of a segment (<= ``num_steps``) whose last one starts before
    ``until_s``; ``segment``: the arguments of :func:`_segment_seconds` after the first."""
    if started_at_s + _segment_seconds(num_steps - 1, *segment) < until_s:
        return num_steps
    starts_before, starts_after = 0, num_steps
    while starts_after - starts_before > 1:
        middle = (starts_before + starts_after) // 2
        if started_at_s + _segment_seconds(middle - 1, *segment) < until_s:
            starts_before = middle
        else:
            starts_after = middle
    return starts_before
