"""The engine model as a replay engine: :class:`~blockq.engine_model.scheduler.EngineScheduler`
in virtual time, with a step-latency profile."""

from __future__ import annotations

from blockq.engine_model.config import EngineConfig
from blockq.engine_model.latency import StepLatencyModel
from blockq.engine_model.request import EngineRequest
from blockq.engine_model.scheduler import EngineScheduler
from blockq.text.block_hashes import block_hashes
from loadgen.fidelity.replay_loop import ReplayRequest, RequestTimes, StepRecord


class ModelReplayEngine:
    """Steps the engine model; a wait moves its clock. With prefix caching on, prompts are
    hashed in the engine's blocks, so equal leading blocks hit as in vLLM."""

    def __init__(self, config: EngineConfig, latency_model: StepLatencyModel) -> None:
        self._scheduler = EngineScheduler(config, latency_model)
        self._config = config
        self.times: dict[str, RequestTimes] = {}
        self.steps: list[StepRecord] = []

    def now_s(self) -> float:
        return self._scheduler.now_s

    def wait_until(self, when_s: float) -> None:
        self._scheduler.now_s = max(self._scheduler.now_s, when_s)

    def add(self, request: ReplayRequest, arrival_s: float) -> None:
        # vLLM caches the blocks the output fills too: they never hit (no prompt repeats
        # this one's answer) but they queue for eviction like any cached block. Hashing
        # placeholder output tokens after the prompt gives each output block a hash of its
        # own (the chain starts from the prompt's), so the two caches evict alike; without
        # them the engine model spends uncached blocks first and keeps prefixes longer.
        hashes = (block_hashes(request.prompt_token_ids + (0,) * request.max_tokens,
                               self._config.block_size)
                  if self._config.enable_prefix_caching else ())
        self._scheduler.add_request(EngineRequest(
            request.request_id, len(request.prompt_token_ids), request.max_tokens,
            arrival_s=arrival_s, prefix_block_hashes=hashes))
        self.times[request.request_id] = RequestTimes(request.request_id, arrival_s)

    def has_work(self) -> bool:
        return self._scheduler.has_unfinished_requests

    def step(self, phase: int) -> None:
        _, hits_before = self._scheduler.prefix_cache_tokens
        result = self._scheduler.step()
        if result is None:
            return
        ended_s = result.finished_at_s
        for request_id in result.produced_token_ids:
            times = self.times[request_id]
            times.num_output_tokens += 1
            if times.first_token_s is None:
                times.first_token_s = ended_s
        for request in result.finished:
            self.times[request.request_id].finished_s = ended_s
        self.steps.append(StepRecord(
            phase, result.started_at_s, result.duration_s, result.num_prefill_tokens,
            result.num_decode_seqs, result.num_kv_tokens_attended,
            result.num_prefill_attention_pairs, len(result.preempted_ids),
            self._scheduler.prefix_cache_tokens[1] - hits_before))
