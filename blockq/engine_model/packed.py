"""A scheduler whose state lives in a few numpy arrays and whose steps run compiled.

:class:`PackedScheduler` is the dispatcher's fast twin of :class:`EngineScheduler`: built
from one (:meth:`PackedScheduler.from_scheduler`), it steps exactly as the reference does
(:mod:`.packed_kernel`; the tests compare both on random states), but a clone is four
array copies and a simulation to the end of an A30-sized instance takes tens of
microseconds instead of milliseconds. Requests are rows; a row is never reused, so a
finished request's times stay readable. Prefix caching is not modelled; LoRA adapters are
(each row's adapter id, the resident adapters and their loads: :mod:`.packed_lora`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from blockq.engine_model import packed_kernel as kernel
from blockq.engine_model import packed_layout as layout
from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import StepLatencyModel
from blockq.engine_model.packed_lora import num_lora_slots
from blockq.engine_model.packed_step import prefill_alone_s
from blockq.engine_model.request import EngineRequest
from blockq.engine_model.restore_checks import RestoredRow, check_restored_rows
from blockq.engine_model.scheduler import EngineScheduler

MAX_STEPS = 10_000_000


class PackedScheduler:
    """Packed scheduler state (see :mod:`.packed_kernel` for the layout).

    ``request_ids[row]`` names each row. Times are model seconds; NaN means "not yet".
    """

    __slots__ = ("config", "latency_model", "requests", "times", "running", "waiting",
                 "counters", "clock", "request_ids", "_config_array", "_latency_array",
                 "_linear_table_s")

    def __init__(self, config: EngineConfig, latency_model: StepLatencyModel, now_s: float = 0.0,
                 capacity: int = 64, loaded_loras: Sequence[int] = (), lora_slots: int = 0) -> None:
        """``loaded_loras``: the adapters resident at the start, least recently used first
        (ignored without LoRA); ``lora_slots``: room for more adapters than ``max_loras``
        in the resident list, as a restored state may need (:func:`.packed_lora.num_lora_slots`)."""
        if config.enable_prefix_caching:
            raise ValueError("enable_prefix_caching: not supported by the packed scheduler")
        self.config = config
        self.latency_model = latency_model
        capacity = max(1, capacity)
        self.requests = np.zeros((capacity, layout.NUM_REQUEST_FIELDS), np.int64)
        self.times = np.full((capacity, layout.NUM_TIME_FIELDS), np.nan)
        self.running = np.zeros(capacity, np.int64)
        self.waiting = np.zeros(capacity, np.int64)
        if config.max_loras:
            loaded_loras = list(loaded_loras)
            num_slots = max(lora_slots, num_lora_slots(config.max_loras, len(loaded_loras), []))
            self.counters = np.zeros(layout.NUM_COUNTERS + 2 * num_slots, np.int64)
            self.counters[layout.NUM_LOADED_LORAS] = len(loaded_loras)
            self.counters[layout.LOADED_LORAS:layout.LOADED_LORAS + len(loaded_loras)] = loaded_loras
        else:  # (a replica rebuild makes one of these per beat: nothing more than before LoRA)
            self.counters = np.zeros(layout.NUM_COUNTERS, np.int64)
        self.counters[layout.NUM_FREE_BLOCKS] = config.num_gpu_blocks
        self.clock = np.array([float(now_s)])
        self.request_ids: list[str] = []
        self._config_array = np.array([config.block_size, config.max_num_seqs,
                                       config.max_num_batched_tokens, config.watermark_blocks,
                                       config.long_prefill_token_threshold, config.max_loras], np.int64)
        self._latency_array, self._linear_table_s = _latency_arrays(latency_model, float(config.lora_load_ms))

    @classmethod
    def from_scheduler(cls, scheduler: EngineScheduler, spare_rows: int = 16) -> PackedScheduler:
        """The packed copy of ``scheduler`` (running then waiting, in their orders)."""
        requests = [*scheduler.running, *scheduler.waiting]
        packed = cls(scheduler.config, scheduler.latency_model, scheduler.now_s,
                     capacity=len(requests) + spare_rows, loaded_loras=scheduler.loaded_loras,
                     lora_slots=num_lora_slots(scheduler.config.max_loras, len(scheduler.loaded_loras),
                                               [r.lora_id for r in scheduler.running]))
        num_rows = len(requests)
        if num_rows:
            # One array write per table.
            packed.requests[:num_rows] = [
                (r.prompt_tokens, r.output_target_tokens, r.num_computed_tokens, r.num_generated_tokens,
                 r.num_blocks, r.num_preemptions, r.lora_id) for r in requests]
            packed.times[:num_rows] = [
                (r.arrival_s, _nan_if_none(r.first_scheduled_at_s), _nan_if_none(r.first_token_at_s),
                 _nan_if_none(r.finished_at_s)) for r in requests]
            packed.request_ids.extend(r.request_id for r in requests)
        packed._set_queues(len(scheduler.running), len(scheduler.waiting), scheduler.num_free_blocks)
        return packed

    @classmethod
    def restored(cls, config: EngineConfig, latency_model: StepLatencyModel, now_s: float,
                 running: Sequence[RestoredRow], waiting: Sequence[RestoredRow],
                 spare_rows: int = 16, engine_used_blocks: int | None = None) -> PackedScheduler:
        """What :meth:`EngineScheduler.restore` then :meth:`from_scheduler` build, written
        straight into the arrays (the tests compare both): a dispatcher rebuilds a replica
        from a beat every few hundred milliseconds, and the objects in between cost more
        than the rest of the rebuild.

        Each row is (request id, prompt tokens, output target, computed, generated).
        Running rows keep their computed tokens (clipped to known tokens - 1) and the
        blocks for them, in order, while they fit; from the first that does not, the rest
        queue before ``waiting`` with nothing computed.

        ``engine_used_blocks``: the blocks the engine reports in use, given where running
        requests may share blocks (a prefix cache shares a prompt's; the packed rows cannot
        say which). What the running rows hold beyond it is shared: each row counts those
        blocks, the engine once, so they are credited to the free blocks. The count stays
        right as rows finish: the last holder's release is the one the credit stands for.

        Raises:
            ValueError: as :meth:`EngineScheduler.restore`, naming the field.
        """
        rows = [*running, *waiting]
        values = np.array([row[1:] for row in rows], np.int64).reshape(len(rows), 4)
        return cls.restored_columns(config, latency_model, now_s, [row[0] for row in rows], values, len(running),
                                    spare_rows=spare_rows, engine_used_blocks=engine_used_blocks)

    @classmethod
    def restored_columns(cls, config: EngineConfig, latency_model: StepLatencyModel, now_s: float,
                         ids: Sequence[str], values: np.ndarray, num_running: int, *,
                         spare_rows: int = 16, engine_used_blocks: int | None = None,
                         lora_ids: Sequence[int] | None = None, loaded_loras: Sequence[int] = ()) -> PackedScheduler:
        """:meth:`restored` from columns: ``ids`` and ``values`` (int64, one row per id:
        prompt tokens, output target, computed, generated), the first ``num_running`` of
        them running. In one compiled call (:func:`.packed_kernel.restore`), not row by row:
        a rebuild restores ~70 rows, and the per-row Python was most of it
        (docs/results/decisions-at-scale.md).

        With LoRA: ``lora_ids`` (one per id, 0 none; None: no adapters) and the resident
        adapters ``loaded_loras``, least recently used first, as
        :class:`EngineScheduler` numbers them."""
        num_rows = len(ids)
        slots = num_lora_slots(config.max_loras, len(loaded_loras), list(lora_ids[:num_running])) \
            if lora_ids is not None else 0
        packed = cls(config, latency_model, now_s, capacity=num_rows + spare_rows, loaded_loras=loaded_loras,
                     lora_slots=slots)
        if not num_rows:
            packed._set_queues(0, 0, config.num_gpu_blocks)
            return packed
        values = np.ascontiguousarray(values, np.int64)
        num_admitted, free_blocks = (-1, 0) if not all(ids) or len(set(ids)) != num_rows else kernel.restore(
            packed.requests, packed.times, values, num_running, packed._config_array, config.max_model_len,
            config.num_gpu_blocks, -1 if engine_used_blocks is None else engine_used_blocks)
        if num_admitted < 0:
            # Raises, naming the first bad row as the reference does.
            check_restored_rows(list(zip(ids, *values.T.tolist(), strict=True)), config.max_model_len)
            raise ValueError("restored rows: refused by the kernel's checks")  # the two disagree: a bug
        packed.request_ids.extend(ids)
        if lora_ids is not None:
            packed.requests[:num_rows, layout.LORA] = lora_ids
        packed._set_queues(num_admitted, num_rows - num_admitted, free_blocks)
        return packed

    def clone(self) -> PackedScheduler:
        """An independent copy (config, latency model and their arrays shared)."""
        return self._with_state((self.requests.copy(), self.times.copy(), self.running.copy(), self.waiting.copy(),
                                 self.counters.copy(), self.clock.copy()), list(self.request_ids))

    def _with_state(self, state: tuple[np.ndarray, ...], request_ids: list[str]) -> PackedScheduler:
        """A scheduler of this one's config and latency model over ``state`` (requests,
        times, running, waiting, counters, clock: taken, not copied)."""
        other = PackedScheduler.__new__(PackedScheduler)
        other.config = self.config
        other.latency_model = self.latency_model
        other.requests, other.times, other.running, other.waiting, other.counters, other.clock = state
        other.request_ids = request_ids
        other._config_array = self._config_array
        other._latency_array = self._latency_array
        other._linear_table_s = self._linear_table_s
        return other

    def rebased(self, now_s: float) -> PackedScheduler:
        """A copy on another clock: every time shifted so that its clock reads ``now_s``
        (NaN stays NaN), e.g. to simulate instances started at different times together."""
        other = self.clone()
        offset_s = now_s - self.now_s
        other.times += offset_s
        other.clock[0] = now_s
        return other

    # --- state ----------------------------------------------------------------------------

    @property
    def now_s(self) -> float:
        return float(self.clock[0])

    @property
    def num_rows(self) -> int:
        return int(self.counters[layout.NUM_ROWS])

    @property
    def num_free_blocks(self) -> int:
        return int(self.counters[layout.NUM_FREE_BLOCKS])

    @property
    def num_preemptions(self) -> int:
        """Preemptions since this state was packed (clones carry the count on)."""
        return int(self.counters[layout.NUM_PREEMPTIONS])

    @property
    def num_lora_loads(self) -> int:
        """Adapter loads since this state was packed (clones carry the count on)."""
        return int(self.counters[layout.NUM_LORA_LOADS])

    @property
    def loaded_loras(self) -> list[int]:
        """The resident adapters, least recently used first."""
        return self.counters[layout.LOADED_LORAS:layout.LOADED_LORAS + self.counters[layout.NUM_LOADED_LORAS]].tolist()

    def running_rows(self) -> list[int]:
        return self.running[:self.counters[layout.NUM_RUNNING]].tolist()

    def waiting_rows(self) -> list[int]:
        head, count, capacity = self.counters[layout.WAITING_HEAD], self.counters[layout.NUM_WAITING], len(self.waiting)
        return [int(self.waiting[(head + k) % capacity]) for k in range(count)]

    def finished_at_s(self, row: int) -> float | None:
        return _time_or_none(self.times[row, layout.FINISHED])

    def request(self, row: int) -> EngineRequest:
        """Row ``row`` as an :class:`EngineRequest` (a copy; for inspection and tests)."""
        values = self.requests[row].tolist()
        times = [_time_or_none(t) for t in self.times[row].tolist()]
        return EngineRequest(
            request_id=self.request_ids[row], prompt_tokens=values[layout.PROMPT],
            output_target_tokens=values[layout.TARGET], arrival_s=times[layout.ARRIVAL] or 0.0,
            num_computed_tokens=values[layout.COMPUTED], num_generated_tokens=values[layout.GENERATED],
            num_preemptions=values[layout.PREEMPTIONS], first_scheduled_at_s=times[layout.FIRST_SCHEDULED],
            first_token_at_s=times[layout.FIRST_TOKEN], finished_at_s=times[layout.FINISHED],
            num_blocks=values[layout.BLOCKS], lora_id=values[layout.LORA])

    # --- changes --------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_tokens: int, output_target_tokens: int,
                    arrival_s: float | None = None, lora_id: int = 0) -> int:
        """Append a new request (nothing generated yet; adapter ``lora_id``, 0 none) to the
        waiting queue; returns its row. The output target is clipped to ``max_model_len``
        as vLLM stops there.

        Raises:
            ValueError: naming the field, for ``prompt_tokens`` outside [1, max_model_len)
                or ``output_target_tokens`` < 1.
        """
        self._check_size(prompt_tokens, output_target_tokens)
        max_model_len = self.config.max_model_len
        row = self.num_rows
        if row == len(self.requests):
            self._grow()
        self.requests[row] = 0
        self.requests[row, layout.PROMPT] = prompt_tokens
        self.requests[row, layout.TARGET] = min(output_target_tokens, max_model_len - prompt_tokens)
        self.requests[row, layout.LORA] = lora_id
        self.times[row] = math.nan
        self.times[row, layout.ARRIVAL] = self.now_s if arrival_s is None else arrival_s
        counters = self.counters
        self.waiting[(counters[layout.WAITING_HEAD] + counters[layout.NUM_WAITING]) % len(self.waiting)] = row
        counters[layout.NUM_WAITING] += 1
        counters[layout.NUM_ROWS] += 1
        self.request_ids.append(request_id)
        return row

    def add_requests(self, new: Sequence[tuple[str, int, int]], lora_ids: Sequence[int] | None = None) -> None:
        """:meth:`add_request` for each (request id, prompt tokens, output tokens), arriving
        now, in order, with one array write per table (same checks, same clipping);
        ``lora_ids``: their adapters (None: none)."""
        if not new:
            return
        max_model_len = self.config.max_model_len
        prompts = [prompt for _, prompt, _ in new]
        outputs = [output for _, _, output in new]
        if min(prompts) < 1 or max(prompts) >= max_model_len or min(outputs) < 1:
            for _, prompt_tokens, output_tokens in new:
                self._check_size(prompt_tokens, output_tokens)
        first, count = self.num_rows, len(new)
        while first + count > len(self.requests):
            self._grow()
        rows = np.arange(first, first + count)
        self.requests[rows] = 0
        self.requests[rows, layout.PROMPT] = prompts
        self.requests[rows, layout.TARGET] = np.minimum(outputs, max_model_len - np.array(prompts))
        if lora_ids is not None:
            self.requests[rows, layout.LORA] = lora_ids
        self.times[rows] = math.nan
        self.times[rows, layout.ARRIVAL] = self.now_s
        counters = self.counters
        tail = counters[layout.WAITING_HEAD] + counters[layout.NUM_WAITING]
        self.waiting[(tail + np.arange(count)) % len(self.waiting)] = rows
        counters[layout.NUM_WAITING] += count
        counters[layout.NUM_ROWS] += count
        self.request_ids.extend(request_id for request_id, _, _ in new)

    def simulate(self, *, until_s: float | None = None, stop_row: int = -1,
                 max_steps: int = MAX_STEPS) -> int:
        """Run steps as :meth:`EngineScheduler.step` runs them; returns the steps run.

        Stops at the first of: nothing left to run; the next step would start at or after
        ``until_s`` (when stopped idle before ``until_s``, the clock moves forward to it);
        row ``stop_row`` finished (-1: no such rule; the clock is then its finish time);
        ``max_steps`` steps done. The state afterwards is the one that stepping the
        reference under the same rule reaches: integers and times equal."""
        return int(kernel.simulate(
            self.requests, self.times, self.running, self.waiting, self.counters, self.clock,
            self._config_array, self._latency_array, self._linear_table_s,
            math.inf if until_s is None else float(until_s), stop_row, max_steps))

    def queue_drain_snapshot(self) -> PackedScheduler:
        """A copy advanced to the last step boundary before the step that leaves the
        waiting queue empty: a request appended now at the tail has not been looked at
        there, so a run with it equals a run without it up to that point, and a what-if
        run can start from the snapshot instead of from now (the argument is at
        :func:`.packed_kernel.advance_to_queue_drain`). Nothing waiting: a plain copy.
        ``self`` is not changed."""
        other = self.clone()
        kernel.advance_to_queue_drain(
            other.requests, other.times, other.running, other.waiting, other.counters, other.clock,
            other._config_array, other._latency_array, other._linear_table_s)
        return other

    def what_if(self, prompt_tokens: int, output_tokens: int, arrival_s: float,
                baseline_finished_at_s: np.ndarray, request_id: str = "what-if", lora_id: int = 0,
                whole_run: bool = True) -> tuple[float, float, float, float, int, np.ndarray, PackedScheduler]:
        """:func:`.packed_kernel.what_if` on this state (unchanged): a request of this size
        (and adapter: ``lora_id``, 0 none) appended and everything simulated to the end
        (without ``whole_run``: to the request's own finish), in one compiled call; last,
        the run's queue-drain snapshot (what :meth:`add_request` of ``request_id`` then
        :meth:`queue_drain_snapshot` give, without simulating its steps again).
        ``baseline_finished_at_s`` must cover every current row (unread without
        ``whole_run``)."""
        if whole_run and len(baseline_finished_at_s) < self.num_rows:
            raise ValueError("baseline_finished_at_s: must have a time for every row")
        output_tokens = min(output_tokens, self.config.max_model_len - prompt_tokens)
        *outputs, drained = kernel.what_if(
            self.requests, self.times, self.running, self.waiting, self.counters, self.clock,
            self._config_array, self._latency_array, self._linear_table_s,
            prompt_tokens, output_tokens, arrival_s, baseline_finished_at_s, lora_id, whole_run)
        return (*outputs, self._with_state(drained, [*self.request_ids, request_id]))

    def first_token_if(self, prompt_tokens: int, output_tokens: int, arrival_s: float,
                       lora_id: int = 0) -> tuple[float, float]:
        """:meth:`what_if`'s TTFT alone, from a run that stops at the new request's first
        token (:func:`.packed_kernel.first_token_if`): the same value, at a fraction of the
        cost; and the request's :meth:`prefill_alone_s`."""
        output_tokens = min(output_tokens, self.config.max_model_len - prompt_tokens)
        return kernel.first_token_if(
            self.requests, self.times, self.running, self.waiting, self.counters, self.clock,
            self._config_array, self._latency_array, self._linear_table_s,
            prompt_tokens, output_tokens, arrival_s, lora_id)

    def prefill_alone_s(self, prompt_tokens: int) -> float:
        """Model seconds to prefill ``prompt_tokens`` here with nothing else running
        (:func:`.packed_step.prefill_alone_s`)."""
        return prefill_alone_s(self._latency_array, self._linear_table_s,
                               max(1, self.config.max_num_batched_tokens), prompt_tokens)

    # --- helpers --------------------------------------------------------------------------

    def _set_queues(self, num_running: int, num_waiting: int, num_free_blocks: int) -> None:
        """For a state just packed: rows [0, num_running) run, the next num_waiting wait."""
        self.running[:num_running] = np.arange(num_running)
        self.waiting[:num_waiting] = np.arange(num_running, num_running + num_waiting)
        counters = self.counters
        counters[layout.NUM_ROWS] = num_running + num_waiting
        counters[layout.NUM_RUNNING] = num_running
        counters[layout.NUM_WAITING] = num_waiting
        counters[layout.NUM_FREE_BLOCKS] = num_free_blocks

    def _check_size(self, prompt_tokens: int, output_target_tokens: int) -> None:
        max_model_len = self.config.max_model_len
        if not 1 <= prompt_tokens < max_model_len:
            raise ValueError(f"prompt_tokens: must be in [1, {max_model_len}) (got {prompt_tokens})")
        if output_target_tokens < 1:
            raise ValueError(f"output_target_tokens: must be >= 1 (got {output_target_tokens})")

    def _grow(self) -> None:
        """Double the row capacity; the waiting ring is laid out again from slot 0."""
        capacity = len(self.requests)
        waiting_rows = self.waiting_rows()
        self.requests = np.concatenate([self.requests, np.zeros_like(self.requests)])
        self.times = np.concatenate([self.times, np.full_like(self.times, np.nan)])
        self.running = np.concatenate([self.running, np.zeros(capacity, np.int64)])
        self.waiting = np.zeros(2 * capacity, np.int64)
        self.waiting[:len(waiting_rows)] = waiting_rows
        self.counters[layout.WAITING_HEAD] = 0


@lru_cache(maxsize=256)
def warm_up() -> None:
    """Compile (or load from the on-disk cache) the kernel, so that the first real
    simulation does not pay for it; a service calls this at start-up."""
    from blockq.engine_model.presets import get_preset

    preset = get_preset("llama2-7b-a30")
    scheduler = PackedScheduler(preset.config, preset.latency_model)
    for index in range(3):
        scheduler.add_request(f"warm-up-{index}", 40, 20)
    scheduler.queue_drain_snapshot()
    scheduler.simulate(until_s=0.05)
    future = scheduler.clone()
    future.simulate()
    scheduler.what_if(40, 20, scheduler.now_s, future.times[:, layout.FINISHED].copy())
    scheduler.first_token_if(40, 20, scheduler.now_s)
    PackedScheduler.restored(preset.config, preset.latency_model, 0.0, [("warm-up-r", 40, 20, 10, 1)], [])
    # A replica rebuild's length targets are compiled too (blockq.lengths.median_targets).
    from blockq.lengths import median_targets
    median_targets(*np.ones((4, 1), np.int64))


@lru_cache(maxsize=256)
def _latency_arrays(latency_model: StepLatencyModel, lora_load_ms: float) -> tuple[np.ndarray, np.ndarray]:
    """The model (and the engine's adapter load time) as the kernel reads them (cached:
    the table has one entry per token)."""
    if type(latency_model).step_seconds is not StepLatencyModel.step_seconds:
        raise ValueError("latency_model: the packed scheduler needs StepLatencyModel's formula")
    coefficients = np.array([latency_model.linear_scale, latency_model.kv_token_s,
                             latency_model.prefill_pair_s, latency_model.step_overhead_s,
                             latency_model.tail_slope_s, lora_load_ms])
    return coefficients, np.array(latency_model.linear_table_s)


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value


def _time_or_none(value: float) -> float | None:
    return None if math.isnan(value) else float(value)
