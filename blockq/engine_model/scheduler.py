"""vLLM's scheduling of one engine instance, step by step, as a pure state machine.

One :meth:`EngineScheduler.step` is one engine iteration under a token budget, as vLLM
V1's ``Scheduler.schedule`` builds it: running requests in running order (decodes and
chunked prefills alike, a long prefill capped by ``long_prefill_token_threshold``), then
new prefills admitted from the FCFS waiting queue while the whole request fits; the batch
runs; requests that computed all their known tokens sample one (the phases are in
:mod:`blockq.engine_model.step_builder`). KV blocks are allocated as tokens are
scheduled; a running request short of a block preempts by recompute the most recently
started running request (itself if last). With LoRA, vLLM's ``max_loras`` rule and the
adapter loads (:mod:`blockq.engine_model.lora`). ``tests/test_vllm_scheduler_diff.py`` steps it
against vLLM's own scheduler; docs/engine-model-vs-vllm.md lists what still differs.

This is the executable specification. The one fast simulator,
:class:`~blockq.engine_model.packed.PackedScheduler` (the dispatcher's), must end every
run in the state that stepping this scheduler reaches, integers and times equal; the tests
compare the two on random states.

Time is passed in; nothing here reads a clock, draws random numbers or does I/O, so a
run is a pure function of its inputs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from blockq.engine_model.block_pool import BlockPool
from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import StepLatencyModel
from blockq.engine_model.request import EngineRequest, StepResult
from blockq.engine_model.step_builder import StepBuilder


class EngineScheduler:
    """The scheduler of one engine instance (see the module docstring for the policy).

    Attributes:
        now_s: model time in seconds; :meth:`step` advances it by the step duration.
        latency_model: step-latency model; may be reassigned (e.g. after a refit).
        running: running requests, oldest admission first.
        waiting: FCFS waiting queue (preempted requests re-enter at the front).

    The scheduler owns the requests it is given and mutates them in place.
    """

    __slots__ = ("_config", "latency_model", "now_s", "running", "waiting", "_pool",
                 "_block_size", "_watermark_blocks", "loaded_loras", "num_lora_loads")

    def __init__(self, config: EngineConfig, latency_model: StepLatencyModel,
                 now_s: float = 0.0) -> None:
        self._config = config
        self.latency_model = latency_model
        self.now_s = float(now_s)
        self.running: list[EngineRequest] = []
        self.waiting: deque[EngineRequest] = deque()
        self._pool = BlockPool(config.num_gpu_blocks, config.block_size)
        self._block_size = config.block_size
        self._watermark_blocks = config.watermark_blocks
        self.loaded_loras: list[int] = []  # resident LoRA adapters, least recently used first
        self.num_lora_loads = 0            # adapters loaded since start

    # --- state ----------------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The engine configuration (fixed for the scheduler's life)."""
        return self._config

    @property
    def num_free_blocks(self) -> int:
        """Free KV blocks (cached but unreferenced prefix blocks count as free)."""
        return self._pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """KV blocks held by running requests."""
        return self._pool.num_used_blocks

    @property
    def prefix_cache_tokens(self) -> tuple[int, int]:
        """(tokens looked up in the prefix cache, tokens found there) over every admission
        so far, as vLLM counts its prefix-cache queries and hits (0, 0 without caching)."""
        return self._pool.num_prefix_queried_tokens, self._pool.num_prefix_hit_tokens

    @property
    def has_unfinished_requests(self) -> bool:
        """True while any request is running or waiting."""
        return bool(self.running) or bool(self.waiting)

    def clone(self) -> EngineScheduler:
        """An independent copy: requests are copied, config and latency model shared."""
        other = EngineScheduler.__new__(EngineScheduler)
        other._config = self._config
        other.latency_model = self.latency_model
        other.now_s = self.now_s
        other.running = [request.copy() for request in self.running]
        other.waiting = deque([request.copy() for request in self.waiting])
        other._pool = self._pool.clone()
        other._block_size = self._block_size
        other._watermark_blocks = self._watermark_blocks
        other.loaded_loras = list(self.loaded_loras)
        other.num_lora_loads = self.num_lora_loads
        return other

    # --- requests -------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Append a request to the waiting queue.

        Its KV state is reset (a waiting request holds no blocks). An output target that
        would pass ``max_model_len`` is clipped to it, as vLLM stops at that length.

        Raises:
            ValueError: naming the field, for an empty or duplicate ``request_id``,
                ``prompt_tokens`` < 1 or >= ``max_model_len``, ``output_target_tokens`` < 1,
                or ``num_generated_tokens`` outside [0, target).
        """
        self._prepare_new_request(request)
        self.waiting.append(request)

    def _prepare_new_request(self, request: EngineRequest) -> None:
        """Validate, clip the output target and reset the KV state of an incoming request."""
        self._validate_new_request(request)
        request.output_target_tokens = min(
            request.output_target_tokens, self._config.max_model_len - request.prompt_tokens)
        if request.num_generated_tokens >= request.output_target_tokens:
            raise ValueError(
                f"num_generated_tokens: must be < output_target_tokens "
                f"({request.output_target_tokens} after clipping to max_model_len)")
        request.num_computed_tokens = 0
        request.num_blocks = 0
        request.num_hashed_blocks = 0
        request.finished_at_s = None

    def _validate_new_request(self, request: EngineRequest) -> None:
        if not request.request_id:
            raise ValueError("request_id: must be a non-empty string")
        if request.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens: must be >= 1 (got {request.prompt_tokens})")
        if request.prompt_tokens >= self._config.max_model_len:
            raise ValueError(f"prompt_tokens: must be < max_model_len "
                             f"({self._config.max_model_len}) (got {request.prompt_tokens})")
        if request.output_target_tokens < 1:
            raise ValueError(
                f"output_target_tokens: must be >= 1 (got {request.output_target_tokens})")
        if request.num_generated_tokens < 0:
            raise ValueError("num_generated_tokens: must be >= 0")
        if self.find_request(request.request_id) is not None:
            raise ValueError(f"request_id: {request.request_id!r} is already in this engine")

    def find_request(self, request_id: str) -> EngineRequest | None:
        """The running or waiting request with this id, or None."""
        for request in self.running:
            if request.request_id == request_id:
                return request
        for request in self.waiting:
            if request.request_id == request_id:
                return request
        return None

    def abort_request(self, request_id: str) -> bool:
        """Remove a running or waiting request, freeing its blocks; False if not here."""
        for index, request in enumerate(self.running):
            if request.request_id == request_id:
                del self.running[index]
                self._pool.free(request)
                return True
        for index, request in enumerate(self.waiting):
            if request.request_id == request_id:
                del self.waiting[index]
                return True
        return False

    def restore(self, running: Iterable[EngineRequest], waiting: Iterable[EngineRequest]) -> None:
        """Load a snapshot (e.g. from a heartbeat) into an empty scheduler.

        Running requests keep their ``num_computed_tokens`` (clipped to known tokens - 1)
        and get the blocks for them, in the order given; one that does not fit is treated
        as preempted and queued before ``waiting``. Prefix-cache sharing is not restored.

        Raises:
            ValueError: if the scheduler is not empty, or as :meth:`add_request`.
        """
        if self.has_unfinished_requests:
            raise ValueError("restore: the scheduler must be empty")
        overflow: list[EngineRequest] = []
        for request in running:
            computed = max(0, min(request.num_computed_tokens, request.num_tokens - 1))
            self._prepare_new_request(request)
            num_blocks = -(-computed // self._block_size)
            if overflow or len(self.running) >= self._config.max_num_seqs \
                    or num_blocks > self._pool.num_free_blocks:
                overflow.append(request)
                continue
            self._pool.allocate(num_blocks)
            request.num_blocks = num_blocks
            request.num_computed_tokens = computed
            self.running.append(request)
        for request in [*overflow, *waiting]:
            self.add_request(request)

    def can_admit(self, prompt_tokens: int) -> bool:
        """Whether a new request of this prompt size would be admitted soon.

        True when a sequence slot is left after the running and waiting requests, and the
        free blocks cover the full prompts of the waiting requests and of this one while
        keeping the watermark free. Running requests' growth is not reserved (preemption
        handles it, as in vLLM).
        """
        config = self._config
        if not 1 <= prompt_tokens < config.max_model_len:
            return False
        if len(self.running) + len(self.waiting) >= config.max_num_seqs:
            return False
        block_size = self._block_size
        num_needed = -(-prompt_tokens // block_size)
        for request in self.waiting:
            num_needed += -(-request.num_tokens // block_size)
        return self._pool.num_free_blocks - num_needed >= self._watermark_blocks

    # --- stepping -------------------------------------------------------------------------

    def step(self, duration_s: float | None = None) -> StepResult | None:
        """Run one engine iteration; None (and no time passes) when there is nothing to do.

        ``duration_s`` overrides the latency model (an emulated engine passes a noisy one).
        A step that could schedule nothing (all its work was preempted) takes zero time
        unless ``duration_s`` is given.
        """
        if not self.running and not self.waiting:
            return None
        builder = StepBuilder(self._config, self.running, self.waiting, self._pool, self.loaded_loras)
        builder.schedule(self.now_s)
        result = builder.execute(self.now_s, duration_s, self.latency_model)
        self.num_lora_loads += result.num_lora_loads
        self.now_s = result.started_at_s + result.duration_s
        return result
