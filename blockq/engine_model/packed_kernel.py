"""The dispatcher's simulations over packed state, compiled with numba: run until a stop
rule (:func:`simulate`), advance to the queue-drain point (:func:`advance_to_queue_drain`),
and a whole what-if run in one call (:func:`what_if`).

The state layout is :mod:`.packed_layout`; one step is :mod:`.packed_step`, a run of
decode-only steps :mod:`.packed_span`. Every step is computed as
:meth:`EngineScheduler.step` computes it, in the same order of floating-point operations,
so results equal stepping the reference scheduler (the tests compare both on random
states). Prefix caching is not modelled here (the dispatcher's replicas do not restore it).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from blockq.engine_model import kernel_cache  # noqa: F401 (drops a stale compiled cache first)
from blockq.engine_model.packed_layout import (
    ARRIVAL,
    BLOCK_SIZE,
    BLOCKS,
    COMPUTED,
    FINISHED,
    FIRST_TOKEN,
    GENERATED,
    LONG_PREFILL_THRESHOLD,
    LORA,
    MAX_LORAS,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    NUM_PREEMPTIONS,
    NUM_REQUEST_FIELDS,
    NUM_ROWS,
    NUM_RUNNING,
    NUM_TIME_FIELDS,
    NUM_WAITING,
    PROMPT,
    TARGET,
    WAITING_HEAD,
)
from blockq.engine_model.packed_span import decode_span
from blockq.engine_model.packed_step import prefill_alone_s, step


@njit(cache=True)
def _scratch(capacity: int, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                      np.ndarray, np.ndarray, np.ndarray]:
    """Scratch space for :func:`step` (per row, clean) and :func:`.packed_span.decode_span`."""
    return (np.zeros(capacity, np.int64), np.zeros(capacity, np.int64), np.zeros(capacity, np.bool_),
            np.empty(capacity, np.int64), np.empty(capacity, np.int64), np.empty(max(block_size, 1), np.int64),
            np.empty(capacity, np.int64))


@njit(cache=True)
def simulate(requests: np.ndarray, times: np.ndarray, running: np.ndarray, waiting: np.ndarray,
             counters: np.ndarray, clock: np.ndarray, config: np.ndarray, latency: np.ndarray,
             linear_table_s: np.ndarray, until_s: float, stop_row: int, max_steps: int,
             stop_field: int = FINISHED) -> int:
    """Steps as :meth:`EngineScheduler.step` runs them, decode-only runs taken as spans
    (:func:`.packed_span.decode_span`); returns the steps run.

    Stops at the first of: nothing left to run; the next step would start at or after
    ``until_s`` (``np.inf``: no limit; when stopped idle, the clock moves to it); row
    ``stop_row`` has its time ``stop_field`` (``FINISHED`` or ``FIRST_TOKEN``; -1: no
    row); ``max_steps`` steps."""
    scheduled, new_tokens, preempted, decodes, prefills, blocks_by_phase, remaining = _scratch(
        requests.shape[0], config[BLOCK_SIZE])
    num_steps = 0
    while counters[NUM_RUNNING] > 0 or counters[NUM_WAITING] > 0:
        if stop_row >= 0 and not np.isnan(times[stop_row, stop_field]):
            return num_steps
        if clock[0] >= until_s or num_steps >= max_steps:
            return num_steps
        num_jumped = decode_span(requests, times, running, waiting, counters, clock, config, latency,
                                 linear_table_s, until_s, max_steps - num_steps, stop_row,
                                 blocks_by_phase, remaining)
        if num_jumped:
            num_steps += num_jumped
            continue
        step(requests, times, running, waiting, counters, clock, config, latency, linear_table_s,
             scheduled, new_tokens, preempted, decodes, prefills)
        num_steps += 1
    stopped_on_row = stop_row >= 0 and not np.isnan(times[stop_row, stop_field])
    if clock[0] < until_s < np.inf and not stopped_on_row:
        clock[0] = until_s
    return num_steps


@njit(cache=True)
def _could_empty_queue(requests: np.ndarray, waiting: np.ndarray, counters: np.ndarray,
                       config: np.ndarray) -> bool:
    """False when the next step cannot admit the whole waiting queue. A step admits at
    most the free sequence slots (and none once it preempted); and admission goes on only
    while token budget is left, each row but the last taking all its tokens, or the
    long-prefill cap of them (a waiting row has none computed), so the queue empties only
    if those rows fit under the budget. The check stops as soon as the budget is
    exceeded: a long queue costs a few rows."""
    num_waiting = counters[NUM_WAITING]
    if num_waiting > config[MAX_NUM_SEQS] - counters[NUM_RUNNING]:
        return False
    capacity = waiting.shape[0]
    budget = config[MAX_NUM_BATCHED_TOKENS]
    threshold = config[LONG_PREFILL_THRESHOLD]
    num_tokens = 0
    for k in range(num_waiting - 1):
        row = waiting[(counters[WAITING_HEAD] + k) % capacity]
        num_row_tokens = requests[row, PROMPT] + requests[row, GENERATED]
        if 0 < threshold < num_row_tokens:
            num_row_tokens = threshold  # more than one row waits: the cap applies
        num_tokens += num_row_tokens
        if num_tokens >= budget:
            return False
    return True


@njit(cache=True)
def advance_to_queue_drain(requests: np.ndarray, times: np.ndarray, running: np.ndarray,
                           waiting: np.ndarray, counters: np.ndarray, clock: np.ndarray,
                           config: np.ndarray, latency: np.ndarray, linear_table_s: np.ndarray) -> int:
    """Advance to the last step boundary at which a row appended now to the waiting queue
    would not yet have been looked at: the boundary before the first step that leaves the
    waiting queue empty; returns the steps advanced. Nothing waiting: no change.

    Why that boundary: admission (phase 3 of a step) takes the queue head by head, FCFS,
    and stops at the first head that does not fit, never skipping one; preempted rows
    re-enter at the head, ahead of everyone. So a row appended at the tail is looked at
    only in a step that admits every row ahead of it, that is, a step after which the
    queue without it is empty. Phase 1 reads only the running rows, and the long-prefill
    cap is on with or without the appended row whenever a row waits beside a running one
    (alone, the one waiting row is always admitted: that step empties the queue). Every step
    before that first emptying step therefore runs the same with or without the appended
    row, and the appended row is still waiting, untouched, at its boundary (the emptying
    step itself may or may not look at it: its budget or sequence slots may run out
    first).

    With LoRA, admission passes over the rows the ``max_loras`` rule skips, so an appended
    row is looked at in the first step that admits or skips every row ahead of it (the
    step returns 0), even with rows left waiting; and a decode span stops where it would
    pass over the whole queue."""
    with_lora = config[MAX_LORAS] > 0
    scheduled, new_tokens, preempted, decodes, prefills, blocks_by_phase, remaining = _scratch(
        requests.shape[0], config[BLOCK_SIZE])
    saved_requests = np.empty_like(requests)
    saved_times = np.empty_like(times)
    saved_running = np.empty_like(running)
    saved_waiting = np.empty_like(waiting)
    saved_counters = np.empty_like(counters)
    num_steps = 0
    while counters[NUM_WAITING] > 0:
        # A decode span never admits anyone (its first step could not), so it keeps the queue.
        num_jumped = decode_span(requests, times, running, waiting, counters, clock, config, latency,
                                 linear_table_s, np.inf, 1 << 62, -1, blocks_by_phase, remaining, True)
        if num_jumped:
            num_steps += num_jumped
            continue
        # (_could_empty_queue counts every row as admitted: skipped rows take nothing.)
        if not with_lora and not _could_empty_queue(requests, waiting, counters, config):
            # No need to keep the state before a step that cannot empty the queue.
            step(requests, times, running, waiting, counters, clock, config, latency, linear_table_s,
                 scheduled, new_tokens, preempted, decodes, prefills)
            num_steps += 1
            continue
        saved_requests[:] = requests
        saved_times[:] = times
        saved_running[:] = running
        saved_waiting[:] = waiting
        saved_counters[:] = counters
        saved_now_s = clock[0]
        if step(requests, times, running, waiting, counters, clock, config, latency, linear_table_s,
                scheduled, new_tokens, preempted, decodes, prefills) == 0:
            requests[:] = saved_requests
            times[:] = saved_times
            running[:] = saved_running
            waiting[:] = saved_waiting
            counters[:] = saved_counters
            clock[0] = saved_now_s
            return num_steps
        num_steps += 1
    return num_steps


@njit(cache=True)
def _with_request(requests: np.ndarray, times: np.ndarray, running: np.ndarray, waiting: np.ndarray,
                  counters: np.ndarray, clock: np.ndarray, prompt_tokens: int, output_tokens: int,
                  arrival_s: float, lora_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A copy of the state with a request of this size appended to the waiting queue (its
    row last, exactly one spare row, the waiting ring laid out from slot 0; ``lora_id``: its
    adapter, 0 none)."""
    num_rows = counters[NUM_ROWS]
    capacity = waiting.shape[0]
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
    new_requests[num_rows, LORA] = lora_id
    new_times[num_rows, :] = np.nan
    new_times[num_rows, ARRIVAL] = arrival_s
    return new_requests, new_times, new_running, new_waiting, new_counters, clock.copy()


@njit(cache=True)
def first_token_if(requests: np.ndarray, times: np.ndarray, running: np.ndarray, waiting: np.ndarray,
                   counters: np.ndarray, clock: np.ndarray, config: np.ndarray, latency: np.ndarray,
                   linear_table_s: np.ndarray, prompt_tokens: int, output_tokens: int,
                   arrival_s: float, lora_id: int = 0) -> tuple[float, float]:
    """:func:`what_if`'s first output alone: the run stops at the new request's first token
    (or its finish), which is usually a few steps in, not at the end of everything. Every
    step up to there is the full run's, so the value is the same. With it, the request's
    prefill alone (:func:`.packed_step.prefill_alone_s`): what its TTFT is beyond its wait."""
    num_rows = counters[NUM_ROWS]
    new_requests, new_times, new_running, new_waiting, new_counters, new_clock = _with_request(
        requests, times, running, waiting, counters, clock, prompt_tokens, output_tokens, arrival_s, lora_id)
    simulate(new_requests, new_times, new_running, new_waiting, new_counters, new_clock, config,
             latency, linear_table_s, np.inf, num_rows, 1 << 62, FIRST_TOKEN)
    first_token_s = new_times[num_rows, FIRST_TOKEN]
    if np.isnan(first_token_s):
        first_token_s = new_times[num_rows, FINISHED]
    return first_token_s - arrival_s, prefill_alone_s(latency, linear_table_s, max(1, config[MAX_NUM_BATCHED_TOKENS]),
                                                      prompt_tokens)


@njit(cache=True)
def what_if(requests: np.ndarray, times: np.ndarray, running: np.ndarray, waiting: np.ndarray,
            counters: np.ndarray, clock: np.ndarray, config: np.ndarray, latency: np.ndarray,
            linear_table_s: np.ndarray, prompt_tokens: int, output_tokens: int, arrival_s: float,
            baseline_finished_at_s: np.ndarray, lora_id: int = 0,
            whole_run: bool = True) -> tuple[float, float, float, float, int, np.ndarray, tuple[np.ndarray, ...]]:
    """Append a request to a copy of the state and simulate until everything finishes
    (without ``whole_run``: until the request itself does; the added delay and the latest
    finish are then NaN, ``baseline_finished_at_s`` is not read, the preemptions and the
    finish times are those up to there); the
    state itself is not changed. ``output_tokens`` must already fit ``max_model_len``.

    Returns, in seconds after ``arrival_s``: the request's first token and finish, the
    sum over the rows already there of how much later each finishes than in
    ``baseline_finished_at_s`` (by row), the latest finish; the preemptions the run
    made; every row's finish time (the new request's row last); and the run's state at
    its queue-drain point (:func:`advance_to_queue_drain`: requests, times, running,
    waiting, counters, clock), where the run passes anyway: placed, the request makes it
    the replica's next baseline snapshot, which is then not simulated a second time.
    ``lora_id``: the request's adapter (0: none)."""
    num_rows = counters[NUM_ROWS]
    new_requests, new_times, new_running, new_waiting, new_counters, new_clock = _with_request(
        requests, times, running, waiting, counters, clock, prompt_tokens, output_tokens, arrival_s, lora_id)
    # The same steps as simulating from the start: advance_to_queue_drain stops at a step
    # boundary and leaves the state as stepping reached it.
    advance_to_queue_drain(new_requests, new_times, new_running, new_waiting, new_counters, new_clock,
                           config, latency, linear_table_s)
    drained = (new_requests.copy(), new_times.copy(), new_running.copy(), new_waiting.copy(),
               new_counters.copy(), new_clock.copy())
    simulate(new_requests, new_times, new_running, new_waiting, new_counters, new_clock, config,
             latency, linear_table_s, np.inf, -1 if whole_run else num_rows, 1 << 62)
    added_delay_s = latest_s = np.nan
    if whole_run:
        added_delay_s, latest_s = 0.0, new_times[num_rows, FINISHED]
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
            new_counters[NUM_PREEMPTIONS] - counters[NUM_PREEMPTIONS], new_times[:, FINISHED].copy(), drained)


@njit(cache=True)
def restore(requests: np.ndarray, times: np.ndarray, values: np.ndarray, num_running: int,
            config: np.ndarray, max_model_len: int, num_gpu_blocks: int,
            engine_used_blocks: int) -> tuple[int, int]:
    """Write restored rows (``values``: prompt tokens, output target, computed, generated,
    the first ``num_running`` running) into an empty state as
    :meth:`.PackedScheduler.restored` specifies; returns (rows admitted to run, free
    blocks left), or (-1, 0), nothing written, when a row fails the reference's checks
    (the caller then names it). ``engine_used_blocks`` < 0: no sharing to credit. One
    compiled call, not ~25 numpy ones: a replica rebuild of a few requests paid more for
    those than for the rows."""
    num_rows = values.shape[0]
    block_size, max_num_seqs = config[BLOCK_SIZE], config[MAX_NUM_SEQS]
    for row in range(num_rows):
        prompt, target, generated = values[row, 0], values[row, 1], values[row, 3]
        if prompt < 1 or prompt >= max_model_len or target < 1 or generated < 0 \
                or generated >= min(target, max_model_len - prompt):
            return -1, 0
    free_blocks = num_gpu_blocks
    if engine_used_blocks >= 0:
        num_held = 0
        for row in range(num_running):
            computed = max(0, min(values[row, 2], values[row, 0] + values[row, 3] - 1))
            num_held += -(-computed // block_size)
        free_blocks += max(0, num_held - engine_used_blocks)
    num_admitted = 0
    for row in range(num_rows):
        prompt, generated = values[row, 0], values[row, 3]
        requests[row, PROMPT] = prompt
        requests[row, TARGET] = min(values[row, 1], max_model_len - prompt)
        requests[row, GENERATED] = generated
        times[row, ARRIVAL] = 0.0
        # Running rows run, in order, while a slot and their blocks are free; from the
        # first that does not fit, every row queues (nothing computed, no blocks).
        if row == num_admitted and row < num_running and num_admitted < max_num_seqs:
            computed = max(0, min(values[row, 2], prompt + generated - 1))
            num_blocks = -(-computed // block_size)
            if num_blocks <= free_blocks:
                free_blocks -= num_blocks
                requests[row, COMPUTED] = computed
                requests[row, BLOCKS] = num_blocks
                num_admitted += 1
    return num_admitted, free_blocks
