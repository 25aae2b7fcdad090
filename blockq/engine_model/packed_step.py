"""One engine step over packed state, compiled: :class:`StepBuilder`'s phases (running
decodes, running prefill chunks, FCFS admission, execution) on the arrays laid out in
:mod:`.packed_layout`, in the same order of floating-point operations as
:meth:`EngineScheduler.step`, so that times come out equal, not just close."""

from __future__ import annotations

import numpy as np
from numba import njit

from blockq.engine_model.packed_layout import (
    BLOCK_SIZE,
    BLOCKS,
    COMPUTED,
    FINISHED,
    FIRST_SCHEDULED,
    FIRST_TOKEN,
    GENERATED,
    KV_TOKEN_S,
    LINEAR_SCALE,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    NUM_FREE_BLOCKS,
    NUM_PREEMPTIONS,
    NUM_RUNNING,
    NUM_WAITING,
    PREEMPTIONS,
    PREFILL_PAIR_S,
    PROMPT,
    STEP_OVERHEAD_S,
    TAIL_SLOPE_S,
    TARGET,
    WAITING_HEAD,
    WATERMARK_BLOCKS,
)

# scheduled[] marks within one step
_NOT_SCHEDULED, _DECODE, _PREFILL = 0, 1, 2


@njit(cache=True)
def step_seconds(latency: np.ndarray, linear_table_s: np.ndarray, num_prefill_tokens: int,
                 num_decode_seqs: int, num_kv_tokens: int, num_pairs: int) -> float:
    """:meth:`StepLatencyModel.step_seconds`, term by term in the same order."""
    num_tokens = num_prefill_tokens + num_decode_seqs
    table_len = linear_table_s.shape[0]
    if num_tokens < table_len:
        linear_s = linear_table_s[num_tokens]
    else:
        linear_s = linear_table_s[table_len - 1] + (num_tokens - table_len + 1) * latency[TAIL_SLOPE_S]
    return (latency[LINEAR_SCALE] * linear_s + latency[KV_TOKEN_S] * num_kv_tokens
            + latency[PREFILL_PAIR_S] * num_pairs + latency[STEP_OVERHEAD_S])


@njit(cache=True)
def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@njit(cache=True)
def _reserve_blocks(row: int, num_blocks: int, requests: np.ndarray, running: np.ndarray,
                    waiting: np.ndarray, counters: np.ndarray, scheduled: np.ndarray,
                    new_tokens: np.ndarray, preempted: np.ndarray) -> tuple[bool, int]:
    """Allocate blocks for a running row, preempting from the end of ``running`` until
    they fit. Returns (False if the row itself was preempted, budget given back)."""
    budget_back = 0
    capacity = waiting.shape[0]
    while num_blocks > counters[NUM_FREE_BLOCKS]:
        counters[NUM_RUNNING] -= 1
        victim = running[counters[NUM_RUNNING]]
        if scheduled[victim] == _DECODE:
            budget_back += 1
        elif scheduled[victim] == _PREFILL:
            budget_back += new_tokens[victim]
        scheduled[victim] = _NOT_SCHEDULED
        counters[NUM_FREE_BLOCKS] += requests[victim, BLOCKS]
        requests[victim, BLOCKS] = 0
        requests[victim, COMPUTED] = 0
        requests[victim, PREEMPTIONS] += 1
        counters[WAITING_HEAD] = (counters[WAITING_HEAD] - 1) % capacity
        waiting[counters[WAITING_HEAD]] = victim
        counters[NUM_WAITING] += 1
        counters[NUM_PREEMPTIONS] += 1
        preempted[victim] = True
        if victim == row:
            return False, budget_back
    counters[NUM_FREE_BLOCKS] -= num_blocks
    requests[row, BLOCKS] += num_blocks
    return True, budget_back


@njit(cache=True)
def step(requests: np.ndarray, times: np.ndarray, running: np.ndarray, waiting: np.ndarray,
         counters: np.ndarray, clock: np.ndarray, config: np.ndarray, latency: np.ndarray,
         linear_table_s: np.ndarray, scheduled: np.ndarray, new_tokens: np.ndarray,
         preempted: np.ndarray, decodes: np.ndarray, prefills: np.ndarray) -> None:
    """One engine iteration (:class:`StepBuilder`'s phases); there must be work.

    ``scheduled`` / ``new_tokens`` / ``preempted`` (per row) and ``decodes`` / ``prefills``
    (row lists) are scratch space, left clean for the next step."""
    block_size = config[BLOCK_SIZE]
    capacity = waiting.shape[0]
    budget = config[MAX_NUM_BATCHED_TOKENS]
    num_preempted = counters[NUM_PREEMPTIONS]
    # Phase 1: running decodes; rows still prefilling are kept (in order) in `prefills`
    # for phase 2, then the list is rebuilt with the chunks actually scheduled.
    num_decodes = 0
    num_ongoing = 0
    index = 0
    while index < counters[NUM_RUNNING]:
        row = running[index]
        index += 1
        generated = requests[row, GENERATED]
        computed = requests[row, COMPUTED]
        if generated == 0 or computed + 1 != requests[row, PROMPT] + generated:
            prefills[num_ongoing] = row
            num_ongoing += 1
            continue
        if computed >= requests[row, BLOCKS] * block_size:
            fits, _ = _reserve_blocks(row, 1, requests, running, waiting, counters, scheduled,
                                      new_tokens, preempted)
            if not fits:
                break
        scheduled[row] = _DECODE
        decodes[num_decodes] = row
        num_decodes += 1
    budget -= num_decodes
    # Phase 2: chunks for running prefills.
    num_prefills = 0
    for k in range(num_ongoing):
        row = prefills[k]
        if budget <= 0:
            break
        if preempted[row]:
            continue
        computed = requests[row, COMPUTED]
        num_new = min(requests[row, PROMPT] + requests[row, GENERATED] - computed, budget)
        num_needed = ceil_div(computed + num_new, block_size) - requests[row, BLOCKS]
        if num_needed > 0:
            fits, budget_back = _reserve_blocks(row, num_needed, requests, running, waiting,
                                                counters, scheduled, new_tokens, preempted)
            budget += budget_back
            if not fits:
                break
        scheduled[row] = _PREFILL
        new_tokens[row] = num_new
        prefills[num_prefills] = row  # k >= num_prefills: overwrites only visited entries
        num_prefills += 1
        budget -= num_new
    # Phase 3: admit from the waiting queue, unless this step preempted.
    if counters[NUM_PREEMPTIONS] == num_preempted:
        while (counters[NUM_WAITING] > 0 and budget > 0
               and counters[NUM_RUNNING] < config[MAX_NUM_SEQS]):
            row = waiting[counters[WAITING_HEAD]]
            num_new = min(requests[row, PROMPT] + requests[row, GENERATED], budget)
            num_needed = ceil_div(num_new, block_size)
            if counters[NUM_FREE_BLOCKS] - num_needed < config[WATERMARK_BLOCKS]:
                break
            counters[WAITING_HEAD] = (counters[WAITING_HEAD] + 1) % capacity
            counters[NUM_WAITING] -= 1
            counters[NUM_FREE_BLOCKS] -= num_needed
            requests[row, BLOCKS] += num_needed
            if np.isnan(times[row, FIRST_SCHEDULED]):
                times[row, FIRST_SCHEDULED] = clock[0]
            running[counters[NUM_RUNNING]] = row
            counters[NUM_RUNNING] += 1
            scheduled[row] = _PREFILL
            new_tokens[row] = num_new
            prefills[num_prefills] = row
            num_prefills += 1
            budget -= num_new
    # Phase 4: execute.
    num_kv_tokens = 0
    num_decode_seqs = 0
    for k in range(num_decodes):
        row = decodes[k]
        if scheduled[row] != _DECODE:
            continue  # preempted in phase 2
        num_decode_seqs += 1
        computed = requests[row, COMPUTED] + 1
        requests[row, COMPUTED] = computed
        num_kv_tokens += computed
        requests[row, GENERATED] += 1
    num_prefill_tokens = 0
    num_pairs = 0
    num_prefill_seqs = 0
    for k in range(num_prefills):
        row = prefills[k]
        if scheduled[row] != _PREFILL:
            continue
        num_prefill_seqs += 1
        num_new = new_tokens[row]
        computed = requests[row, COMPUTED]
        num_prefill_tokens += num_new
        num_pairs += num_new * (2 * computed + num_new + 1) // 2
        computed += num_new
        requests[row, COMPUTED] = computed
        num_kv_tokens += computed
        if computed == requests[row, PROMPT] + requests[row, GENERATED]:
            requests[row, GENERATED] += 1
            if requests[row, GENERATED] == 1:
                times[row, FIRST_TOKEN] = np.inf  # stamped below, once the step's end is known
    duration_s = 0.0
    if num_decode_seqs or num_prefill_seqs:
        duration_s = step_seconds(latency, linear_table_s, num_prefill_tokens, num_decode_seqs,
                                  num_kv_tokens, num_pairs)
    ended_at_s = clock[0] + duration_s
    clock[0] = ended_at_s
    # Stamp first tokens and finishes, free finished rows' blocks, clean the scratch.
    for k in range(num_prefills):
        row = prefills[k]
        if times[row, FIRST_TOKEN] == np.inf:
            times[row, FIRST_TOKEN] = ended_at_s
    num_kept = 0
    for k in range(counters[NUM_RUNNING]):
        row = running[k]
        scheduled[row] = _NOT_SCHEDULED
        if requests[row, GENERATED] >= requests[row, TARGET]:
            times[row, FINISHED] = ended_at_s
            counters[NUM_FREE_BLOCKS] += requests[row, BLOCKS]
            requests[row, BLOCKS] = 0
        else:
            running[num_kept] = row
            num_kept += 1
    counters[NUM_RUNNING] = num_kept
    # Rows preempted this step are the only waiting ones marked: they were pushed to the
    # head, and no admission followed (phase 3 is skipped after a preemption).
    # _reserve_blocks already cleared their `scheduled` mark.
    for k in range(counters[NUM_PREEMPTIONS] - num_preempted):
        preempted[waiting[(counters[WAITING_HEAD] + k) % capacity]] = False
