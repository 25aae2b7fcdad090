"""OpenAI response bodies built from blockq final records and chunks.

Shapes follow OpenAI's API (and vLLM's server): ``text_completion`` and
``chat.completion`` objects, their streaming chunks (``chat.completion.chunk``), the
``usage`` object and the error object ``{"error": {"message", "type", "param", "code"}}``.

blockq extension: every choice and the response carry a ``"blockq"`` object (the
top-level one describes choice 0)::

    {"request_id", "instance", "status", "predicted_output_tokens",
     "predicted_ttft_ms", "predicted_e2e_ms", "queue_wait_ms", "ttft_ms", "e2e_ms"}

(times in model milliseconds as the worker measured them; ``None`` when unknown).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from blockq.frontdoors.gateway.openai_requests import ENDPOINT_CHAT, GenerationPlan
from blockq.wire.protocol import FinalRecord

EXTENSION_FIELD = "blockq"


def response_id(plan: GenerationPlan, base_id: str) -> str:
    return ("chatcmpl-" if plan.endpoint == ENDPOINT_CHAT else "cmpl-") + base_id


def blockq_extras(final: FinalRecord) -> dict[str, Any]:
    """The ``blockq`` extension object of one choice."""
    return {
        "request_id": final.request_id, "instance": final.instance, "status": final.status,
        "predicted_output_tokens": final.predicted_output_tokens,
        "predicted_ttft_ms": final.predicted_ttft_ms, "predicted_e2e_ms": final.predicted_e2e_ms,
        "queue_wait_ms": final.queue_wait_ms, "ttft_ms": final.ttft_ms, "e2e_ms": final.e2e_ms,
    }


def extras_headers(final: FinalRecord) -> dict[str, str]:
    """``x-blockq-*`` response headers for a (first) choice's final record."""
    headers = {"x-blockq-instance": final.instance}
    for name in ("predicted_output_tokens", "predicted_ttft_ms", "predicted_e2e_ms", "ttft_ms", "e2e_ms"):
        value = getattr(final, name)
        if value is not None:
            headers["x-blockq-" + name.replace("_", "-")] = f"{value:.1f}" if isinstance(value, float) else str(value)
    return headers


def usage(plan: GenerationPlan, finals: Sequence[FinalRecord]) -> dict[str, int]:
    """Prompt tokens count once per prompt (not per choice), completion tokens per choice."""
    prompt_tokens = sum(finals[i * plan.n].prompt_tokens for i in range(len(plan.prompts)))
    completion_tokens = sum(f.output_tokens for f in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _choice_text(plan: GenerationPlan, index: int, final: FinalRecord) -> str:
    prompt = plan.prompt_of(index)
    return (prompt if plan.echo and isinstance(prompt, str) else "") + final.text


def completion_body(plan: GenerationPlan, base_id: str, created_s: int,
                    finals: Sequence[FinalRecord]) -> dict[str, Any]:
    """The non-streaming response: ``text_completion`` or ``chat.completion``."""
    choices: list[dict[str, Any]] = []
    for i, final in enumerate(finals):
        choice: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": final.finish_reason}
        if plan.endpoint == ENDPOINT_CHAT:
            choice["message"] = {"role": "assistant", "content": final.text}
        else:
            choice["text"] = _choice_text(plan, i, final)
        choice[EXTENSION_FIELD] = blockq_extras(final)
        choices.append(choice)
    return {
        "id": response_id(plan, base_id),
        "object": "chat.completion" if plan.endpoint == ENDPOINT_CHAT else "text_completion",
        "created": created_s, "model": plan.model, "choices": choices, "system_fingerprint": None,
        "usage": usage(plan, finals), EXTENSION_FIELD: blockq_extras(finals[0]),
    }


class ChunkBuilder:
    """Builds the SSE chunk objects of one streaming response."""

    def __init__(self, plan: GenerationPlan, base_id: str, created_s: int) -> None:
        self.plan = plan
        self.is_chat = plan.endpoint == ENDPOINT_CHAT
        self.head = {"id": response_id(plan, base_id),
                     "object": "chat.completion.chunk" if self.is_chat else "text_completion",
                     "created": created_s, "model": plan.model}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = {**self.head, "choices": [choice]}
        if self.is_chat:
            body["system_fingerprint"] = None
        if self.plan.include_usage:
            body["usage"] = None
        return body

    def opening(self, index: int) -> dict[str, Any] | None:
        """The first chunk of a choice: the assistant role (chat) or the echoed prompt."""
        if self.is_chat:
            return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None})
        prompt = self.plan.prompt_of(index)
        if self.plan.echo and isinstance(prompt, str):
            return self.text(index, prompt)
        return None

    def text(self, index: int, text: str) -> dict[str, Any]:
        if self.is_chat:
            return self._chunk({"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None})
        return self._chunk({"index": index, "text": text, "logprobs": None, "finish_reason": None})

    def finish(self, index: int, final: FinalRecord) -> dict[str, Any]:
        """The last chunk of a choice: its finish reason and blockq extras."""
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": final.finish_reason,
                                  EXTENSION_FIELD: blockq_extras(final)}
        if self.is_chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        return self._chunk(choice)

    def usage(self, finals: Sequence[FinalRecord]) -> dict[str, Any]:
        """The extra last chunk sent when ``stream_options.include_usage`` is true."""
        body = {**self.head, "choices": [], "usage": usage(self.plan, finals)}
        if self.is_chat:
            body["system_fingerprint"] = None
        return body


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
