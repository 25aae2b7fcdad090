"""One engine step over packed state, compiled: :class:`StepBuilder`'s phases (running
requests in order, FCFS admission, execution) on the arrays laid out in
:mod:`.packed_layout`, in the same order of floating-point operations as
:meth:`EngineScheduler.step`, so that times come out equal, not just close. With LoRA
(``config[MAX_LORAS]`` > 0), admission skips as vLLM does and the step pays the adapters
it loads (:mod:`.packed_lora`)."""

from __future__ import annotations

import numpy as np
from numba import njit

from blockq.engine_model import kernel_cache  # noqa: F401 (drops a stale compiled cache first)
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
    LONG_PREFILL_THRESHOLD,
    LORA,
    LORA_LOAD_MS,
    MAX_LORAS,
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
from blockq.engine_model.packed_lora import (
    add_to_batch,
    scheduled_adapters,
    skips,
    use_batch_adapters,
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
def prefill_alone_s(latency: np.ndarray, linear_table_s: np.ndarray, budget: int, prompt_tokens: int) -> float:
    """Seconds to prefill ``prompt_tokens`` with nothing else running: full chunks of the
    ``budget`` tokens a step takes, then the rest (what a TTFT is beyond the wait for
    the others, as a ranking estimates it)."""
    num_full, rest = prompt_tokens // budget, prompt_tokens % budget
    seconds = 0.0
    if num_full:
        seconds = num_full * step_seconds(latency, linear_table_s, budget, 0, 0, budget * (budget + 1) // 2)
    if rest:
        seconds += step_seconds(latency, linear_table_s, rest, 0, 0, rest * (rest + 1) // 2)
    return seconds


@njit(cache=True)
def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@njit(cache=True)
def _reserve_blocks(row: int, num_blocks: int, requests: np.ndarray, running: np.ndarray,
                    waiting: np.ndarray, counters: np.ndarray, preempted: np.ndarray) -> bool:
    """Allocate blocks for a running row, preempting from the end of ``running`` until
    they fit (victims lie beyond ``row``, so none is scheduled yet). Returns False if
    the row itself was preempted."""
    capacity = waiting.shape[0]
    while num_blocks > counters[NUM_FREE_BLOCKS]:
        counters[NUM_RUNNING] -= 1
        victim = running[counters[NUM_RUNNING]]
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
            return False
    counters[NUM_FREE_BLOCKS] -= num_blocks
    requests[row, BLOCKS] += num_blocks
    return True


@njit(cache=True)
def capped_new_tokens(num_tokens: int, threshold: int, budget: int) -> int:
    """Tokens a request lacking ``num_tokens`` gets: the long-prefill cap, then the budget."""
    if 0 < threshold < num_tokens:
        num_tokens = threshold
    return min(num_tokens, budget)


@njit(cache=True)
def step(requests: np.ndarray, times: np.ndarray, running: np.ndarray, waiting: np.ndarray,
         counters: np.ndarray, clock: np.ndarray, config: np.ndarray, latency: np.ndarray,
         linear_table_s: np.ndarray, scheduled: np.ndarray, new_tokens: np.ndarray,
         preempted: np.ndarray, decodes: np.ndarray, prefills: np.ndarray) -> int:
    """One engine iteration (:class:`StepBuilder`'s phases); there must be work.

    Returns the waiting rows that admission did not pass over (neither admitted nor
    skipped for their adapter; all of them when nothing was admitted after a preemption):
    0 means a row appended at the tail before this step would have been looked at.

    ``scheduled`` / ``new_tokens`` / ``preempted`` (per row) and ``decodes`` / ``prefills``
    (row lists) are scratch space, left clean for the next step."""
    num_preempted = counters[NUM_PREEMPTIONS]
    # vLLM lifts the long-prefill cap when one request is alone.
    threshold = config[LONG_PREFILL_THRESHOLD] if counters[NUM_RUNNING] + counters[NUM_WAITING] > 1 else 0
    budget, num_decodes, num_prefills = _schedule_running(
        requests, running, waiting, counters, config, threshold, scheduled, new_tokens, preempted,
        decodes, prefills)
    num_skipped = 0
    if counters[NUM_PREEMPTIONS] == num_preempted:
        num_prefills, num_skipped = _admit_waiting(requests, times, running, waiting, counters, clock, config,
                                                   threshold, budget, scheduled, new_tokens, prefills, num_prefills)
    lora_load_s = 0.0
    if config[MAX_LORAS] > 0:
        num_batch = scheduled_adapters(requests, running, counters[NUM_RUNNING], counters, scheduled)
        # As StepBuilder.execute: loads times the figure, in ms, then in seconds.
        lora_load_s = use_batch_adapters(counters, config, num_batch) * latency[LORA_LOAD_MS] / 1000
    _execute(requests, times, running, counters, clock, latency, linear_table_s, scheduled,
             new_tokens, decodes, num_decodes, prefills, num_prefills, lora_load_s)
    # Rows preempted this step are the only waiting ones marked: they were pushed to the
    # head, and no admission followed (phase 2 is skipped after a preemption); they were
    # never scheduled, so their `scheduled` mark is clear.
    capacity = waiting.shape[0]
    for k in range(counters[NUM_PREEMPTIONS] - num_preempted):
        preempted[waiting[(counters[WAITING_HEAD] + k) % capacity]] = False
    return counters[NUM_WAITING] - num_skipped


@njit(cache=True)
def _schedule_running(requests: np.ndarray, running: np.ndarray, waiting: np.ndarray,
                      counters: np.ndarray, config: np.ndarray, threshold: int,
                      scheduled: np.ndarray, new_tokens: np.ndarray, preempted: np.ndarray,
                      decodes: np.ndarray, prefills: np.ndarray) -> tuple[int, int, int]:
    """Phase 1: running rows in running order, until the budget or the blocks run out.
    Returns the budget left, and the decodes and prefill chunks listed."""
    block_size = config[BLOCK_SIZE]
    budget = config[MAX_NUM_BATCHED_TOKENS]
    num_decodes = 0
    num_prefills = 0
    index = 0
    while index < counters[NUM_RUNNING] and budget > 0:
        row = running[index]
        generated = requests[row, GENERATED]
        computed = requests[row, COMPUTED]
        num_known = requests[row, PROMPT] + generated
        num_new = capped_new_tokens(num_known - computed, threshold, budget)
        num_needed = ceil_div(computed + num_new, block_size) - requests[row, BLOCKS]
        if num_needed > 0 and not _reserve_blocks(row, num_needed, requests, running, waiting,
                                                  counters, preempted):
            break
        if generated > 0 and computed + 1 == num_known:
            scheduled[row] = _DECODE
            decodes[num_decodes] = row
            num_decodes += 1
        else:
            scheduled[row] = _PREFILL
            new_tokens[row] = num_new
            prefills[num_prefills] = row
            num_prefills += 1
        budget -= num_new
        index += 1
    return budget, num_decodes, num_prefills


@njit(cache=True)
def _admit_waiting(requests: np.ndarray, times: np.ndarray, running: np.ndarray,
                   waiting: np.ndarray, counters: np.ndarray, clock: np.ndarray,
                   config: np.ndarray, threshold: int, budget: int, scheduled: np.ndarray,
                   new_tokens: np.ndarray, prefills: np.ndarray, num_prefills: int) -> tuple[int, int]:
    """Phase 2: admit from the waiting queue, FCFS, while the whole request fits beside
    the watermark (kept only once a row is running). With LoRA, a row whose adapter would
    be one too many in the batch is skipped (vLLM's ``continue``): it stays at the front,
    in order, the skipped rows ahead of the rest. Returns the prefill chunks listed and
    the rows skipped."""
    block_size = config[BLOCK_SIZE]
    capacity = waiting.shape[0]
    with_lora = config[MAX_LORAS] > 0
    num_batch = scheduled_adapters(requests, running, counters[NUM_RUNNING], counters, scheduled) if with_lora else 0
    num_skipped = 0
    while (counters[NUM_WAITING] > num_skipped and budget > 0
           and counters[NUM_RUNNING] < config[MAX_NUM_SEQS]):
        head = counters[WAITING_HEAD]
        row = waiting[(head + num_skipped) % capacity]
        if with_lora and skips(counters, config, num_batch, requests[row, LORA]):
            num_skipped += 1
            continue
        num_known = requests[row, PROMPT] + requests[row, GENERATED]
        watermark_blocks = config[WATERMARK_BLOCKS] if counters[NUM_RUNNING] > 0 else 0
        if ceil_div(num_known, block_size) + watermark_blocks > counters[NUM_FREE_BLOCKS]:
            break
        num_new = capped_new_tokens(num_known, threshold, budget)
        num_needed = ceil_div(num_new, block_size)
        # The row leaves the queue: the skipped rows ahead of it move up one slot.
        for k in range(num_skipped, 0, -1):
            waiting[(head + k) % capacity] = waiting[(head + k - 1) % capacity]
        counters[WAITING_HEAD] = (head + 1) % capacity
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
        if with_lora:
            num_batch = add_to_batch(counters, num_batch, requests[row, LORA])
    return num_prefills, num_skipped


@njit(cache=True)
def _execute(requests: np.ndarray, times: np.ndarray, running: np.ndarray, counters: np.ndarray,
             clock: np.ndarray, latency: np.ndarray, linear_table_s: np.ndarray,
             scheduled: np.ndarray, new_tokens: np.ndarray, decodes: np.ndarray, num_decodes: int,
             prefills: np.ndarray, num_prefills: int, lora_load_s: float) -> None:
    """Phase 3: run the batch (``lora_load_s`` longer: its adapter loads), advance the
    clock, stamp first tokens and finishes, free finished rows' blocks and clear the
    `scheduled` marks."""
    num_kv_tokens = 0
    for k in range(num_decodes):
        row = decodes[k]
        computed = requests[row, COMPUTED] + 1
        requests[row, COMPUTED] = computed
        num_kv_tokens += computed
        requests[row, GENERATED] += 1
    num_prefill_tokens = 0
    num_pairs = 0
    for k in range(num_prefills):
        row = prefills[k]
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
    if num_decodes or num_prefills:
        duration_s = step_seconds(latency, linear_table_s, num_prefill_tokens, num_decodes,
                                  num_kv_tokens, num_pairs)
        if lora_load_s > 0.0:  # the reference adds 0.0 otherwise: the same sum
            duration_s = duration_s + lora_load_s
    ended_at_s = clock[0] + duration_s
    clock[0] = ended_at_s
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
