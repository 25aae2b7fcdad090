"""LoRA adapters over packed state, compiled: :mod:`blockq.engine_model.lora` on the
counters' adapter slots (:mod:`.packed_layout`).

Two lists of ``slots`` each follow the fixed counters: the resident adapters, least
recently used first (``NUM_LOADED_LORAS`` of them), and one step's batch adapters (scratch,
rebuilt whenever read). ``slots`` is fixed when a state is packed
(:func:`num_lora_slots`): ``max_loras``, or more where a restored state already runs or
holds more distinct adapters than that. No step can exceed it: admission adds an adapter
to a batch only while the batch holds fewer than ``max_loras``, so a batch never holds more
than the running rows did when packed or ``max_loras``; and the resident list grows past
``max_loras`` only by an adapter of a batch that uses every resident one.

With ``max_loras`` 0 nothing here runs (the callers check ``config[MAX_LORAS]``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from blockq.engine_model import kernel_cache  # noqa: F401 (drops a stale compiled cache first)
from blockq.engine_model.packed_layout import (
    LOADED_LORAS,
    LORA,
    MAX_LORAS,
    NUM_COUNTERS,
    NUM_LOADED_LORAS,
    NUM_LORA_LOADS,
    NUM_WAITING,
    WAITING_HEAD,
)

_NOT_SCHEDULED = 0  # packed_step's mark of a row outside the step's batch


def num_lora_slots(max_loras: int, num_loaded: int, running_lora_ids: list[int]) -> int:
    """Slots a packed state needs (0 without LoRA): see the module docstring."""
    if max_loras <= 0:
        return 0
    return max(max_loras, num_loaded, len(set(running_lora_ids) - {0}))


@njit(cache=True)
def batch_slots_start(counters: np.ndarray) -> int:
    """Index in ``counters`` of the first batch-adapter slot."""
    return LOADED_LORAS + (counters.shape[0] - NUM_COUNTERS) // 2


@njit(cache=True)
def holds(counters: np.ndarray, start: int, count: int, lora_id: int) -> int:
    """Position of ``lora_id`` in ``counters[start:start + count]``, or -1."""
    for k in range(count):
        if counters[start + k] == lora_id:
            return k
    return -1


@njit(cache=True)
def add_to_batch(counters: np.ndarray, num_batch: int, lora_id: int) -> int:
    """Add ``lora_id`` (0: none) to the batch adapters if new; returns their count."""
    start = batch_slots_start(counters)
    if lora_id != 0 and holds(counters, start, num_batch, lora_id) < 0:
        counters[start + num_batch] = lora_id
        num_batch += 1
    return num_batch


@njit(cache=True)
def scheduled_adapters(requests: np.ndarray, running: np.ndarray, num_running: int,
                       counters: np.ndarray, scheduled: np.ndarray) -> int:
    """Write the distinct adapters of the scheduled running rows, in running order (the
    batch's order: phase 1's rows, then those admitted), into the batch slots; returns
    how many."""
    num_batch = 0
    for k in range(num_running):
        row = running[k]
        if scheduled[row] != _NOT_SCHEDULED:
            num_batch = add_to_batch(counters, num_batch, requests[row, LORA])
    return num_batch


@njit(cache=True)
def skips(counters: np.ndarray, config: np.ndarray, num_batch: int, lora_id: int) -> bool:
    """:func:`blockq.engine_model.lora.skips_for_lora` against the batch slots."""
    return (lora_id != 0 and num_batch >= config[MAX_LORAS]
            and holds(counters, batch_slots_start(counters), num_batch, lora_id) < 0)


@njit(cache=True)
def _remove_loaded(counters: np.ndarray, position: int) -> None:
    num_loaded = counters[NUM_LOADED_LORAS]
    for k in range(position, num_loaded - 1):
        counters[LOADED_LORAS + k] = counters[LOADED_LORAS + k + 1]
    counters[NUM_LOADED_LORAS] = num_loaded - 1


@njit(cache=True)
def use_batch_adapters(counters: np.ndarray, config: np.ndarray, num_batch: int) -> int:
    """:func:`blockq.engine_model.lora.load_adapters` for the batch slots' adapters: each
    becomes the most recently used resident one, in batch order; one not resident is
    loaded, evicting the least recently used one the batch does not use while
    ``max_loras`` are resident. Returns the loads (also added to ``NUM_LORA_LOADS``)."""
    start = batch_slots_start(counters)
    max_loras = config[MAX_LORAS]
    num_loads = 0
    for j in range(num_batch):
        lora_id = counters[start + j]
        position = holds(counters, LOADED_LORAS, counters[NUM_LOADED_LORAS], lora_id)
        if position >= 0:
            _remove_loaded(counters, position)
        else:
            num_loads += 1
            if counters[NUM_LOADED_LORAS] >= max_loras:
                for victim in range(counters[NUM_LOADED_LORAS]):
                    if holds(counters, start, num_batch, counters[LOADED_LORAS + victim]) < 0:
                        _remove_loaded(counters, victim)
                        break
        counters[LOADED_LORAS + counters[NUM_LOADED_LORAS]] = lora_id
        counters[NUM_LOADED_LORAS] += 1
    counters[NUM_LORA_LOADS] += num_loads
    return num_loads


@njit(cache=True)
def all_resident(requests: np.ndarray, running: np.ndarray, num_running: int, counters: np.ndarray) -> bool:
    """Whether every running row's adapter is resident (a step of them all loads none)."""
    num_loaded = counters[NUM_LOADED_LORAS]
    for k in range(num_running):
        lora_id = requests[running[k], LORA]
        if lora_id != 0 and holds(counters, LOADED_LORAS, num_loaded, lora_id) < 0:
            return False
    return True


@njit(cache=True)
def touch_active(requests: np.ndarray, running: np.ndarray, num_running: int, counters: np.ndarray,
                 config: np.ndarray, remaining: np.ndarray, step_index: int) -> None:
    """The LRU after decode step ``step_index`` of a span, whose batch is the rows with
    ``remaining[k] >= step_index`` (every adapter resident: no load). Touching the same
    batch twice changes nothing, so the span needs this only at the steps where rows
    finish, and at its last."""
    num_batch = 0
    for k in range(num_running):
        if remaining[k] >= step_index:
            num_batch = add_to_batch(counters, num_batch, requests[running[k], LORA])
    use_batch_adapters(counters, config, num_batch)


@njit(cache=True)
def admission_candidate(requests: np.ndarray, running: np.ndarray, num_running: int, waiting: np.ndarray,
                        counters: np.ndarray, config: np.ndarray, remaining: np.ndarray, step_index: int) -> int:
    """The waiting row the next step's admission would look at first, after decode step
    ``step_index`` of a span (its batch: the rows with ``remaining[k] > step_index``, all
    decoding): the first not skipped for its adapter; -1 when every waiting row is."""
    num_batch = 0
    for k in range(num_running):
        if remaining[k] > step_index:
            num_batch = add_to_batch(counters, num_batch, requests[running[k], LORA])
    capacity = waiting.shape[0]
    for j in range(counters[NUM_WAITING]):
        row = waiting[(counters[WAITING_HEAD] + j) % capacity]
        if not skips(counters, config, num_batch, requests[row, LORA]):
            return row
    return -1
