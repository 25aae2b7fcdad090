"""Decode spans over packed state: runs of decode-only steps taken in a tight loop.

Within a span every running row decodes one token per step, so a step's cost and the
blocks it takes follow from a few running sums instead of a visit to every row (see
:func:`decode_span`). Durations are still summed one step at a time, in the order
:meth:`EngineScheduler.step` sums them, so the results equal stepping exactly.

With LoRA a span starts only where every running row's adapter is resident (a step that
loads is left to :func:`.packed_step.step`: its duration is not a decode step's) and the
first waiting row the ``max_loras`` rule does not skip cannot be admitted; it ends at the
first finish while rows wait (a finish may free an adapter slot); and the resident adapters
end in the order stepping leaves them.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from blockq.engine_model import kernel_cache  # noqa: F401 (drops a stale compiled cache first)
from blockq.engine_model.packed_layout import (
    BLOCK_SIZE,
    BLOCKS,
    COMPUTED,
    FINISHED,
    GENERATED,
    MAX_LORAS,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    NUM_FREE_BLOCKS,
    NUM_RUNNING,
    NUM_WAITING,
    PROMPT,
    TARGET,
    WAITING_HEAD,
    WATERMARK_BLOCKS,
)
from blockq.engine_model.packed_lora import admission_candidate, all_resident, touch_active
from blockq.engine_model.packed_step import ceil_div, step_seconds


@njit(cache=True)
def admits_next(requests: np.ndarray, waiting: np.ndarray, counters: np.ndarray, config: np.ndarray,
                num_running: int, num_free_blocks: int, num_new_blocks: int, head: int = -1) -> bool:
    """Whether the next step's phase 2 would admit the waiting row ``head`` (-1: the
    waiting head), given the running rows (all decoding) and the blocks their decodes take
    in that step: budget and a slot left, and the row's whole request fitting beside the
    watermark."""
    budget = config[MAX_NUM_BATCHED_TOKENS] - num_running
    if counters[NUM_WAITING] == 0 or budget <= 0 or num_running >= config[MAX_NUM_SEQS]:
        return False
    if head < 0:
        head = waiting[counters[WAITING_HEAD]]
    num_needed = ceil_div(requests[head, PROMPT] + requests[head, GENERATED], config[BLOCK_SIZE])
    watermark_blocks = config[WATERMARK_BLOCKS] if num_running > 0 else 0
    return num_free_blocks - num_new_blocks - num_needed >= watermark_blocks


@njit(cache=True)
def _lora_span_blocked(requests: np.ndarray, running: np.ndarray, waiting: np.ndarray, counters: np.ndarray,
                       config: np.ndarray, num_running: int, num_free_blocks: int, num_new_blocks: int,
                       remaining: np.ndarray, stop_if_all_skipped: bool) -> bool:
    """With LoRA, whether a span cannot start: the first step loads an adapter, or admits
    the first waiting row the ``max_loras`` rule does not skip, or (``stop_if_all_skipped``)
    passes over every waiting row (a row appended at the tail would be looked at: the
    queue-drain snapshot stops there)."""
    if not all_resident(requests, running, num_running, counters):
        return True
    if counters[NUM_WAITING] == 0:
        return False
    head = admission_candidate(requests, running, num_running, waiting, counters, config, remaining, 0)
    if head < 0:
        budget = config[MAX_NUM_BATCHED_TOKENS] - num_running
        return stop_if_all_skipped and budget > 0 and num_running < config[MAX_NUM_SEQS]
    return admits_next(requests, waiting, counters, config, num_running, num_free_blocks, num_new_blocks, head)


@njit(cache=True)
def _touch_as_stepped(requests: np.ndarray, running: np.ndarray, num_running: int, counters: np.ndarray,
                      config: np.ndarray, remaining: np.ndarray, finish_order: np.ndarray, num_finished: int,
                      num_steps: int) -> None:
    """The resident adapters as the span's steps leave them: each step uses its batch's
    adapters, and the batch changes only where rows finish, so touching each finishing
    step's batch in order, then the last step's, is touching every step's (once more
    changes nothing). Done after the span: a call in its loop slowed spans without LoRA."""
    last_touched = 0
    for j in range(num_finished):
        finish_step = remaining[finish_order[j]]
        if finish_step != last_touched:
            touch_active(requests, running, num_running, counters, config, remaining, finish_step)
            last_touched = finish_step
    touch_active(requests, running, num_running, counters, config, remaining, num_steps)


@njit(cache=True)
def decode_span(requests: np.ndarray, times: np.ndarray, running: np.ndarray, waiting: np.ndarray,
                counters: np.ndarray, clock: np.ndarray, config: np.ndarray,
                latency: np.ndarray, linear_table_s: np.ndarray, until_s: float,
                max_num_steps: int, stop_row: int, blocks_by_phase: np.ndarray,
                remaining: np.ndarray, stop_if_all_skipped: bool = False) -> int:
    """Run the decode-only steps ahead (0 if the next step is not one) and return how many.

    A span holds while every running row decodes, no step preempts and the waiting head
    cannot be admitted. Rows finish inside it (in the step their target is reached, as
    stepping finishes them); a finish frees blocks, so admission is checked again before
    the next step. Row ``r`` first needs a new block at span step
    ``first_r = blocks * block_size - computed + 1`` (in ``1 .. block_size``), then every
    ``block_size`` steps, so ``blocks_by_phase[(j - 1) % block_size]`` counts the blocks
    step ``j`` takes. Step ``j`` reads ``sum(computed) + num_rows * j`` KV tokens over the
    rows still running. ``stop_if_all_skipped``: see :func:`_lora_span_blocked`."""
    num_running = counters[NUM_RUNNING]
    if num_running == 0 or max_num_steps <= 0:
        return 0
    block_size = config[BLOCK_SIZE]
    blocks_by_phase[:block_size] = 0
    num_kv_tokens = 0
    for k in range(num_running):
        row = running[k]
        generated = requests[row, GENERATED]
        computed = requests[row, COMPUTED]
        if generated == 0 or computed + 1 != requests[row, PROMPT] + generated:
            return 0
        first_block_step = requests[row, BLOCKS] * block_size - computed + 1
        remaining[k] = requests[row, TARGET] - generated
        if first_block_step < 1 or first_block_step > block_size or remaining[k] < 1:
            return 0
        blocks_by_phase[first_block_step - 1] += 1
        num_kv_tokens += computed
    with_lora = config[MAX_LORAS] > 0
    num_free_blocks = counters[NUM_FREE_BLOCKS]
    if blocks_by_phase[0] > num_free_blocks:
        return 0  # the first step preempts
    if with_lora:
        if _lora_span_blocked(requests, running, waiting, counters, config, num_running, num_free_blocks,
                              blocks_by_phase[0], remaining, stop_if_all_skipped):
            return 0  # the first step loads, admits, or passes the whole queue
    elif admits_next(requests, waiting, counters, config, num_running, num_free_blocks, blocks_by_phase[0]):
        return 0  # the first step admits
    finish_order = np.argsort(remaining[:num_running])
    num_finished = 0
    num_active = num_running
    num_steps = 0
    now_s = clock[0]
    while num_steps < max_num_steps and now_s < until_s:
        num_new_blocks = blocks_by_phase[num_steps % block_size]
        if num_new_blocks > num_free_blocks:
            break  # this step preempts: left to step()
        num_free_blocks -= num_new_blocks
        num_steps += 1
        now_s = now_s + step_seconds(latency, linear_table_s, 0, num_active,
                                     num_kv_tokens + num_active * num_steps, 0)
        if remaining[finish_order[num_finished]] != num_steps:
            continue
        stopped = False
        while num_finished < num_running and remaining[finish_order[num_finished]] == num_steps:
            k = finish_order[num_finished]
            num_finished += 1
            row = running[k]
            computed = requests[row, COMPUTED]
            first_block_step = requests[row, BLOCKS] * block_size - computed + 1
            blocks_by_phase[first_block_step - 1] -= 1
            num_free_blocks += requests[row, BLOCKS] + (num_steps - first_block_step) // block_size + 1 \
                if num_steps >= first_block_step else requests[row, BLOCKS]
            num_kv_tokens -= computed
            num_active -= 1
            times[row, FINISHED] = now_s
            stopped = stopped or row == stop_row
        if stopped or num_active == 0:
            break
        # With LoRA a finish may free an adapter slot for a skipped row: the span ends
        # here while rows wait, and the next step is stepped (no LoRA call in this loop).
        if (with_lora and counters[NUM_WAITING] > 0) or admits_next(
                requests, waiting, counters, config, num_active, num_free_blocks,
                blocks_by_phase[num_steps % block_size]):
            break
    if num_steps == 0:
        return 0
    if with_lora:
        _touch_as_stepped(requests, running, num_running, counters, config, remaining, finish_order,
                          num_finished, num_steps)
    clock[0] = now_s
    counters[NUM_FREE_BLOCKS] = num_free_blocks
    num_kept = 0
    for k in range(num_running):
        row = running[k]
        if remaining[k] <= num_steps:
            requests[row, COMPUTED] += remaining[k]
            requests[row, GENERATED] += remaining[k]
            requests[row, BLOCKS] = 0  # given back at its finish (counted above)
            continue
        first_block_step = requests[row, BLOCKS] * block_size - requests[row, COMPUTED] + 1
        if num_steps >= first_block_step:
            requests[row, BLOCKS] += (num_steps - first_block_step) // block_size + 1
        requests[row, COMPUTED] += num_steps
        requests[row, GENERATED] += num_steps
        running[num_kept] = row
        num_kept += 1
    counters[NUM_RUNNING] = num_kept
    return num_steps
