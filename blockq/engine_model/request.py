"""Requests as the engine model sees them, and what one step reports."""

from __future__ import annotations

from dataclasses import dataclass

from blockq.engine_model.latency import StepSample


@dataclass(slots=True)
class EngineRequest:
    """One request inside an engine model; mutated in place by the scheduler that owns it.

    Token accounting follows vLLM: the request's known tokens are
    ``prompt_tokens + num_generated_tokens``; ``num_computed_tokens`` of them have their KV
    computed. A step that brings ``num_computed_tokens`` up to the known tokens samples one
    new output token. So a decoding request has ``num_computed_tokens == known - 1``, and a
    preempted one (``num_computed_tokens == 0``) recomputes prompt and output as prefill.

    ``output_target_tokens``: generation stops after this many output tokens.
    ``prefix_block_hashes``: hashes of the full leading blocks of the request's tokens, for
    prefix caching: the prompt's, and where the output is known in advance (a replayed
    answer) the output's too, so that blocks the output fills are cached as in vLLM.
    Times are model seconds; ``None`` means "not yet".
    ``num_blocks`` / ``num_hashed_blocks``: KV blocks held, and how many leading ones are
    registered in the prefix cache (maintained by the scheduler; zero while waiting).
    """

    request_id: str
    prompt_tokens: int
    output_target_tokens: int
    arrival_s: float = 0.0
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_at_s: float | None = None
    first_token_at_s: float | None = None
    finished_at_s: float | None = None
    prefix_block_hashes: tuple[int, ...] = ()
    num_blocks: int = 0
    num_hashed_blocks: int = 0
    lora_id: int = 0  # the LoRA adapter it runs with, as its engine numbers them (0: none)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus output generated so far."""
        return self.prompt_tokens + self.num_generated_tokens

    def copy(self) -> EngineRequest:
        """An independent copy (every field is an immutable value, so shallow is enough).

        Fields are set directly rather than through ``__init__``: this runs for every
        request each time the dispatcher clones an engine, and is about twice as fast.
        """
        other = _new_request(EngineRequest)
        other.request_id = self.request_id
        other.prompt_tokens = self.prompt_tokens
        other.output_target_tokens = self.output_target_tokens
        other.arrival_s = self.arrival_s
        other.num_computed_tokens = self.num_computed_tokens
        other.num_generated_tokens = self.num_generated_tokens
        other.num_preemptions = self.num_preemptions
        other.first_scheduled_at_s = self.first_scheduled_at_s
        other.first_token_at_s = self.first_token_at_s
        other.finished_at_s = self.finished_at_s
        other.prefix_block_hashes = self.prefix_block_hashes
        other.num_blocks = self.num_blocks
        other.num_hashed_blocks = self.num_hashed_blocks
        other.lora_id = self.lora_id
        return other


_new_request = object.__new__


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one engine step did; times are model seconds.

    ``produced_token_ids``: requests that produced one output token this step (a request
    whose prefill completes produces its first token); ``first_token_ids`` is the subset
    for which it was the first. ``finished``: requests that reached their output target
    (their final state). ``preempted_ids``: requests preempted by recompute this step.
    ``num_kv_tokens_attended`` and ``num_prefill_attention_pairs`` as in
    :class:`~blockq.engine_model.latency.StepSample`. ``num_used_blocks``,
    ``num_running`` and ``num_waiting`` describe the state after the step.
    ``num_scheduled_tokens``: (request id, tokens scheduled) for every request in the
    batch, in scheduling order (as vLLM's ``SchedulerOutput.num_scheduled_tokens``).
    ``num_lora_loads``: LoRA adapters the step loaded (not resident when it needed them),
    and ``lora_load_s`` the part of ``duration_s`` that took (left out of its latency sample).
    """

    started_at_s: float
    duration_s: float
    num_prefill_tokens: int
    num_decode_seqs: int
    num_kv_tokens_attended: int
    produced_token_ids: tuple[str, ...]
    first_token_ids: tuple[str, ...]
    finished: tuple[EngineRequest, ...]
    preempted_ids: tuple[str, ...]
    num_prefill_attention_pairs: int = 0
    num_used_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_scheduled_tokens: tuple[tuple[str, int], ...] = ()
    num_lora_loads: int = 0
    lora_load_s: float = 0.0

    @property
    def finished_at_s(self) -> float:
        """When the step ended (and its tokens became visible)."""
        return self.started_at_s + self.duration_s

    def to_step_sample(self) -> StepSample:
        """The step as a latency-model sample (batch and duration)."""
        return StepSample(self.num_prefill_tokens, self.num_decode_seqs,
                          self.num_kv_tokens_attended, self.duration_s - self.lora_load_s,
                          self.num_prefill_attention_pairs)
