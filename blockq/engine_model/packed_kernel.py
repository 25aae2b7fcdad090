"""The engine scheduler's step, compiled: the same policy as :mod:`.step_builder`, over
arrays, for the dispatcher's what-if simulations.

State layout (owned by :class:`blockq.engine_model.packed.PackedScheduler`):

* ``requests[row, field]`` (int64): the ``PROMPT`` ... ``PREEMPTIONS`` columns below;
* ``times[row, field]`` (float64, NaN = not yet): ``ARRIVAL`` ... ``FINISHED``;
* ``running[:num_running]``: rows, oldest admission first;
* ``waiting``: a ring buffer of rows (FCFS; preempted rows re-enter at the head);
* ``counters``: ``NUM_ROWS`` ... ``NUM_PREEMPTIONS``; ``clock[0]``: model time (s);
* ``config``: block size, max_num_seqs, token budget, watermark blocks;
* ``latency``: linear scale, s per KV token, s per prefill pair, step overhead, tail
  slope; ``linear_table_s``: the dense linear-layer table of :class:`StepLatencyModel`.

Every step is computed as :meth:`EngineScheduler.step` computes it, in the same order of
floating-point operations, so results are equal to stepping the reference scheduler (the
tests check it on random states). The one shortcut: a run of decode-only steps with a
fixed batch is taken in a tight loop that updates a handful of sums per step instead of
visiting every request (the batch cannot change inside it; see :mod:`.decode_span` for
why); its durations are still summed one step at a time. Prefix caching is not modelled
here (the dispatcher's replicas do not restore it).
"""

from __future__ import annotations

import numpy as np
from numba import njit

# requests[] columns
PROMPT, TARGET, COMPUTED, GENERATED, BLOCKS, PREEMPTIONS = range(6)
NUM_REQUEST_FIELDS = 6
# times[] columns
ARRIVAL, FIRST_SCHEDULED, FIRST_TOKEN, FINISHED = range(4)
NUM_TIME_FIELDS = 4
# counters[]
NUM_ROWS, NUM_RUNNING, WAITING_HEAD, NUM_WAITING, NUM_FREE_BLOCKS, NUM_PREEMPTIONS = range(6)
NUM_COUNTERS = 6
# config[]
BLOCK_SIZE, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, WATERMARK_BLOCKS = range(4)
# latency[]
LINEAR_SCALE, KV_TOKEN_S, PREFILL_PAIR_S, STEP_OVERHEAD_S, TAIL_SLOPE_S = range(5)

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
def _ceil_div(a: int, b: int) -> int:
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
        num_needed = _ceil_div(computed + num_new, block_size) - requests[row, BLOCKS]
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
            num_needed = _ceil_div(num_new, block_size)
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
    for k in range(counters[NUM_WAITING]):
        row = waiting[(counters[WAITING_HEAD] + k) % capacity]
        preempted[row] = False
        scheduled[row] = _NOT_SCHEDULED


@njit(cache=True)
def _admits_next(requests: np.ndarray, waiting: np.ndarray, counters: np.ndarray, config: np.ndarray,
                 num_running: int, num_free_blocks: int, num_new_blocks: int) -> bool:
    """Whether the next step's phase 3 would admit the waiting head, given the running
    rows (all decoding) and the blocks their decodes take in that step."""
    budget = config[MAX_NUM_BATCHED_TOKENS] - num_running
    if counters[NUM_WAITING] == 0 or budget <= 0 or num_running >= config[MAX_NUM_SEQS]:
        return False
    head = waiting[counters[WAITING_HEAD]]
    num_needed = _ceil_div(min(requests[head, PROMPT] + requests[head, GENERATED], budget), config[BLOCK_SIZE])
    return num_free_blocks - num_new_blocks - num_needed >= config[WATERMARK_BLOCKS]


@njit(cache=True)
def _decode_span(requests: np.ndarray, times: np.ndarray, running: np.ndarray, waiting: np.ndarray,
                 counters: np.ndarray, clock: np.ndarray, config: np.ndarray,
                 latency: np.ndarray, linear_table_s: np.ndarray, until_s: float,
                 max_num_steps: int, stop_row: int, blocks_by_phase: np.ndarray,
                 remaining: np.ndarray) -> int:
    """Run the decode-only steps ahead (0 if the next step is not one) and return how many.

    A span holds while every running row decodes, no step preempts and the waiting head
    cannot be admitted. Rows finish inside it (in the step their target is reached, as
    stepping finishes them); a finish frees blocks, so admission is checked again before
    the next step. Row ``r`` first needs a new block at span step
    ``first_r = blocks * block_size - computed + 1`` (in ``1 .. block_size``), then every
    ``block_size`` steps, so ``blocks_by_phase[(j - 1) % block_size]`` counts the blocks
    step ``j`` takes. Step ``j`` reads ``sum(computed) + num_rows * j`` KV tokens over the
    rows still running."""
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
    num_free_blocks = counters[NUM_FREE_BLOCKS]
    if blocks_by_phase[0] > num_free_blocks:
        return 0  # the first step preempts
    if _admits_next(requests, waiting, counters, config, num_running, num_free_blocks, blocks_by_phase[0]):
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
        if _admits_next(requests, waiting, counters, config, num_active, num_free_blocks,
                        blocks_by_phase[num_steps % block_size]):
            break
    if num_steps == 0:
        return 0
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


@njit(cache=True)
def _scratch(capacity: int, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                      np.ndarray, np.ndarray, np.ndarray]:
    """Scratch space for :func:`step` (per row, clean) and :func:`_decode_span`."""
    return (np.zeros(capacity, np.int64), np.zeros(capacity, np.int64), np.zeros(capacity, np.bool_),
            np.empty(capacity, np.int64), np.empty(capacity, np.int64), np.empty(max(block_size, 1), np.int64),
            np.empty(capacity, np.int64))


@njit(cache=True)
def simulate(requests: np.ndarray, times: np.ndarray, running: np.ndarray, waiting: np.ndarray,
             counters: np.ndarray, clock: np.ndarray, config: np.ndarray, latency: np.ndarray,
             linear_table_s: np.ndarray, until_s: float, stop_row: int, max_steps: int) -> int:
    """:meth:`EngineScheduler.simulate` over packed state; returns the steps run.

    Stops at the first of: nothing left to run; the next step would start at or after
    ``until_s`` (``np.inf``: no limit; when stopped idle, the clock moves to it); row
    ``stop_row`` finished (-1: none); ``max_steps`` steps."""
    scheduled, new_tokens, preempted, decodes, prefills, blocks_by_phase, remaining = _scratch(
        requests.shape[0], config[BLOCK_SIZE])
    num_steps = 0
    while counters[NUM_RUNNING] > 0 or counters[NUM_WAITING] > 0:
        if stop_row >= 0 and not np.isnan(times[stop_row, FINISHED]):
            return num_steps
        if clock[0] >= until_s or num_steps >= max_steps:
            return num_steps
        num_jumped = _decode_span(requests, times, running, waiting, counters, clock, config, latency,
                                  linear_table_s, until_s, max_steps - num_steps, stop_row,
                                  blocks_by_phase, remaining)
        if num_jumped:
            num_steps += num_jumped
            continue
        step(requests, times, running, waiting, counters, clock, config, latency, linear_table_s,
             scheduled, new_tokens, preempted, decodes, prefills)
        num_steps += 1
    stopped_on_row = stop_row >= 0 and not np.isnan(times[stop_row, FINISHED])
    if clock[0] < until_s < np.inf and not stopped_on_row:
        clock[0] = until_s
    return num_steps


@njit(cache=True)
def advance_to_queue_drain(requests: np.ndarray, times: np.ndarray, running: np.ndarray,
                           waiting: np.ndarray, counters: np.ndarray, clock: np.ndarray,
                           config: np.ndarray, latency: np.ndarray, linear_table_s: np.ndarray) -> None:
    """Advance to the last step boundary at which a row appended now to the waiting queue
    would not yet have been looked at (:meth:`EngineScheduler.queue_drain_snapshot`).

    Admission is FCFS without skipping, so the appended row is first considered in the
    step that empties the queue ahead of it; every step before that one runs the same
    with or without it. Nothing waiting: no change."""
    scheduled, new_tokens, preempted, decodes, prefills, blocks_by_phase, remaining = _scratch(
        requests.shape[0], config[BLOCK_SIZE])
    saved_requests = np.empty_like(requests)
    saved_times = np.empty_like(times)
    saved_running = np.empty_like(running)
    saved_waiting = np.empty_like(waiting)
    saved_counters = np.empty_like(counters)
    while counters[NUM_WAITING] > 0:
        # A decode span never admits anyone (its first step could not), so it keeps the queue.
        if _decode_span(requests, times, running, waiting, counters, clock, config, latency,
                        linear_table_s, np.inf, 1 << 62, -1, blocks_by_phase, remaining):
            continue
        saved_requests[:] = requests
        saved_times[:] = times
        saved_running[:] = running
        saved_waiting[:] = waiting
        saved_counters[:] = counters
        saved_now_s = clock[0]
        step(requests, times, running, waiting, counters, clock, config, latency, linear_table_s,
             scheduled, new_tokens, preempted, decodes, prefills)
        if counters[NUM_WAITING] == 0:
            requests[:] = saved_requests
            times[:] = saved_times
            running[:] = saved_running
            waiting[:] = saved_waiting
            counters[:] = saved_counters
            clock[0] = saved_now_s
            return


@njit(cache=True)
def what_if(requests: np.ndarray, times: np.ndarray, running: np.ndarray, waiting: np.ndarray,
            counters: np.ndarray, clock: np.ndarray, config: np.ndarray, latency: np.ndarray,
            linear_table_s: np.ndarray, prompt_tokens: int, output_tokens: int, arrival_s: float,
            baseline_finished_at_s: np.ndarray) -> tuple[float, float, float, float, int, np.ndarray]:
    """Append a request to a copy of the state and simulate until everything finishes;
    the state itself is not changed. ``output_tokens`` must already fit ``max_model_len``.

    Returns, in seconds after ``arrival_s``: the request's first token and finish, the
    sum over the rows already there of how much later each finishes than in
    ``baseline_finished_at_s`` (by row), the latest finish; the preemptions the run
    made; and every row's finish time (the new request's row last)."""
    num_rows = counters[NUM_ROWS]
    capacity = waiting.shape[0]
    # A copy with exactly one spare row, the waiting ring laid out from slot 0.
    new_requests = np.empty((num_rows + 1, NUM_REQUEST_FIELDS), np.int64)
    new_requests[:num_rows] = requests[:num_rows]
    new_times = np.empty((num_rows + 1, NUM_TIME_FIELDS), np.float64)
    new_times[:num_rows] = times[:num_rows]
    new_running = np.empty(num_rows + 1, np.int64)
    new_running[:counters[NUM_RUNNING]] = running[:counters[NUM_RUNNING]]
    new_waiting = np.empty(num_rows + 1, np.int64)
    num_waiting = counters[NUM_WAITING]
    for k in range(num_waiting):
        new_waiting[k] = waiting[(counters[WAITING_HEAD] + k) % capacity]
    new_waiting[num_waiting] = num_rows
    new_counters = counters.copy()
    new_counters[NUM_ROWS] = num_rows + 1
    new_counters[WAITING_HEAD] = 0
    new_counters[NUM_WAITING] = num_waiting + 1
    new_requests[num_rows, :] = 0
    new_requests[num_rows, PROMPT] = prompt_tokens
    new_requests[num_rows, TARGET] = output_tokens
    new_times[num_rows, :] = np.nan
    new_times[num_rows, ARRIVAL] = arrival_s
    new_clock = clock.copy()
    simulate(new_requests, new_times, new_running, new_waiting, new_counters, new_clock, config,
             latency, linear_table_s, np.inf, -1, 1 << 62)
    added_delay_s = 0.0
    latest_s = new_times[num_rows, FINISHED]
    for row in range(num_rows):
        finish_s = new_times[row, FINISHED]
        if np.isnan(finish_s):
            continue
        latest_s = max(latest_s, finish_s)
        before_s = baseline_finished_at_s[row]
        if finish_s > before_s:
            added_delay_s += finish_s - before_s
    finished_s = new_times[num_rows, FINISHED]
    first_token_s = new_times[num_rows, FIRST_TOKEN]
    if np.isnan(first_token_s):
        first_token_s = finished_s
    return (first_token_s - arrival_s, finished_s - arrival_s, added_delay_s, latest_s - arrival_s,
            new_counters[NUM_PREEMPTIONS] - counters[NUM_PREEMPTIONS], new_times[:, FINISHED].copy())
