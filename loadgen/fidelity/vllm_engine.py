"""A real vLLM engine as a replay engine, and the subprocess that runs one.

vLLM V1's ``LLMEngine`` runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
each :meth:`VllmReplayEngine.step` is one whole engine iteration: schedule, the model's
forward pass and sampling, the scheduler's update and the output processing a server does.
Its wall time is what a request waits for, and what the profile fits. What the scheduler
did is read from vLLM's own objects: the ``SchedulerOutput`` of each step (tokens per
request, requests preempted) and the prefix-cache stats it counts (hits of new and of
resumed requests). Timestamps are taken when ``step()`` returns: a token is visible to a
client then. vLLM's own iteration timing (``enable_logging_iteration_details``) is not
used: it times only the wait on the executor's future (``v1/engine/core.py``,
``capture_iteration_details``), which the in-process CPU executor has already completed,
so it reads 0.3 ms for steps that take 10-170 ms.

Run as ``python -m loadgen.fidelity.vllm_engine ENGINE_ARGS_JSON`` (the vLLM environment,
pinned to one core by the caller, :mod:`loadgen.fidelity.engine_process`): it answers on
stdout, one JSON line each, first the engine configuration vLLM settled on (as an
:class:`~blockq.engine_model.config.EngineConfig`), then one replay per line of requests
read from stdin. One engine serves the profile's sweep and the replays after it, so both
are measured on the same process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO

from loadgen.fidelity.replay_loop import ReplayRequest, RequestTimes, StepRecord, replay

# The first steps of a fresh engine pay one-off costs (kernel selection, allocator growth):
# a few requests of every kind run first and are not recorded.
_WARM_UP_REQUESTS = ((512, 1), (1000, 8), (8, 24), (8, 24), (8, 24), (8, 24))


class VllmReplayEngine:
    """One in-process vLLM engine; see the module docstring."""

    def __init__(self, engine_args: dict[str, Any]) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if "kv_cache_memory_bytes" not in engine_args:
            # vLLM-CPU's KV space overrides kv_cache_memory_bytes; without either it sizes
            # the cache from the node's memory. 1 GiB unless a size is asked for.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        args = {"enable_chunked_prefill": True, "disable_log_stats": False,
                "async_scheduling": False,
                "seed": 0, **engine_args}
        self._engine = LLMEngine.from_engine_args(EngineArgs(**args))
        self._core = self._engine.engine_core.engine_core
        self._scheduler = self._core.scheduler
        self._last_output: Any = None
        self._batch = (0, 0, 0, 0)
        self._prefix_hits_total = 0
        self._instrument()
        self.times: dict[str, RequestTimes] = {}
        self.steps: list[StepRecord] = []

    def _instrument(self) -> None:
        """Keep each step's SchedulerOutput and the prefix-cache hits vLLM counts."""
        scheduler = self._scheduler
        schedule, make_stats = scheduler.schedule, scheduler.make_stats

        def recording_schedule(*args: Any, **kwargs: Any) -> Any:
            self._last_output = schedule(*args, **kwargs)
            self._batch = self._count_batch(self._last_output)
            return self._last_output

        def counting_make_stats(*args: Any, **kwargs: Any) -> Any:
            stats = make_stats(*args, **kwargs)
            if stats is not None and stats.prefix_cache_stats is not None:
                self._prefix_hits_total += (stats.prefix_cache_stats.hits
                                            + stats.prefix_cache_stats.preempted_hits)
            return stats

        scheduler.schedule, scheduler.make_stats = recording_schedule, counting_make_stats

    def engine_config(self) -> dict[str, Any]:
        """The engine model's configuration for what vLLM runs (its null block left out)."""
        config = self._core.vllm_config
        scheduler_config = config.scheduler_config
        return {"num_gpu_blocks": config.cache_config.num_gpu_blocks - 1,
                "block_size": config.cache_config.block_size,
                "max_num_seqs": scheduler_config.max_num_seqs,
                "max_num_batched_tokens": scheduler_config.max_num_batched_tokens,
                "max_model_len": config.model_config.max_model_len, "watermark": 0.0,
                "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
                "long_prefill_token_threshold": scheduler_config.long_prefill_token_threshold}

    def warm_up(self) -> None:
        """Run the warm-up requests, then forget them (and the prefix cache they filled)."""
        requests = [ReplayRequest(f"warm-up-{index}", tuple(31_000 - (index * 977 + k) % 30_000
                                                            for k in range(prompt)), max_tokens)
                    for index, (prompt, max_tokens) in enumerate(_WARM_UP_REQUESTS)]
        replay(self, requests)
        self.reset()

    def reset(self) -> None:
        """Forget the requests and steps recorded so far, and empty the prefix cache."""
        self._engine.reset_prefix_cache()
        self.times.clear()
        self.steps.clear()

    def now_s(self) -> float:
        return time.perf_counter()

    def wait_until(self, when_s: float) -> None:
        delay_s = when_s - time.perf_counter()
        if delay_s > 0:
            time.sleep(delay_s)

    def add(self, request: ReplayRequest, arrival_s: float) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True, temperature=0.0,
                                output_kind=RequestOutputKind.DELTA)
        self._engine.add_request(request.request_id,
                                 {"prompt_token_ids": list(request.prompt_token_ids)}, params)
        self.times[request.request_id] = RequestTimes(request.request_id, arrival_s)

    def has_work(self) -> bool:
        return self._engine.has_unfinished_requests()

    def step(self, phase: int) -> None:
        hits_before = self._prefix_hits_total
        self._last_output = None
        started_s = time.perf_counter()
        outputs = self._engine.step()
        ended_s = time.perf_counter()
        for output in outputs:
            times = self.times[output.request_id]
            num_new = sum(len(completion.token_ids) for completion in output.outputs)
            if num_new and times.first_token_s is None:
                times.first_token_s = ended_s
            times.num_output_tokens += num_new
            if output.finished:
                times.finished_s = ended_s
        if self._last_output is None or not self._last_output.num_scheduled_tokens:
            return  # nothing was scheduled: not an engine step
        self.steps.append(self._record(phase, started_s, ended_s - started_s,
                                       self._prefix_hits_total - hits_before))

    def _record(self, phase: int, started_s: float, duration_s: float, hits: int) -> StepRecord:
        num_prefill, num_decode, num_kv, num_pairs = self._batch
        return StepRecord(phase, started_s, duration_s, num_prefill, num_decode, num_kv, num_pairs,
                          len(self._last_output.preempted_req_ids or ()), hits)

    def _count_batch(self, output: Any) -> tuple[int, int, int, int]:
        """The step's batch as the engine model counts it (``step_builder``'s execute):
        prefill tokens, decode sequences, KV tokens attended, prefill attention pairs. Read
        right after ``schedule()``, which has advanced each request's computed tokens."""
        num_prefill = num_decode = num_kv = num_pairs = 0
        for request_id, num_new in output.num_scheduled_tokens.items():
            request = self._scheduler.requests[request_id]
            num_computed = request.num_computed_tokens - num_new
            if request.num_output_tokens and num_computed + 1 == request.num_tokens:
                num_decode += 1
            else:
                num_prefill += num_new
                num_pairs += num_new * (2 * num_computed + num_new + 1) // 2
            num_kv += num_computed + num_new
        return num_prefill, num_decode, num_kv, num_pairs


def serve(engine_args: dict[str, Any], commands: TextIO, replies: TextIO) -> None:
    """Build the engine and warm it up; write its configuration as one JSON line; then
    for each line read (a JSON list of requests) replay them on a clean prefix cache and
    write the replay as one JSON line, until the input ends."""
    engine = VllmReplayEngine(engine_args)
    engine.warm_up()
    replies.write(json.dumps({"engine_config": engine.engine_config()}) + "\n")
    replies.flush()
    for line in commands:
        requests = [ReplayRequest(**{**r, "prompt_token_ids": tuple(r["prompt_token_ids"])})
                    for r in json.loads(line)]
        engine.reset()
        replies.write(json.dumps(replay(engine, requests).to_dict()) + "\n")
        replies.flush()


def main() -> None:
    # vLLM logs to stdout; the replies go through a duplicate of it, stdout itself to stderr.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(json.loads(sys.argv[1]), sys.stdin, replies)


if __name__ == "__main__":
    main()
