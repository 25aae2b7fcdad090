"""Small builders shared by tests (messages, heartbeats)."""

from __future__ import annotations

import time
import uuid

from blockq.keys import Keys
from blockq.protocol import Heartbeat, Prediction, Request, RequestProgress


def make_request(prompt: str = "hello", max_tokens: int = 16, *, keys: Keys | None = None,
                 predicted: int | None = None, **overrides: object) -> Request:
    request_id = str(overrides.pop("id", uuid.uuid4().hex))
    request = Request(id=request_id, prompt=prompt, max_tokens=max_tokens,
                      reply_stream=(keys or Keys()).reply(request_id), submitted_at_s=time.time(),
                      **overrides)  # type: ignore[arg-type]
    if predicted is not None:
        request = request.with_prediction(Prediction(len(prompt.split()) if isinstance(prompt, str) else len(prompt),
                                                     predicted, max(1, predicted // 2), predicted * 2, "test"))
    return request


def make_heartbeat(instance_id: str, *, seq: int = 1, state: str = "live", sent_at_s: float | None = None,
                   running: tuple[RequestProgress, ...] = (), waiting: tuple[RequestProgress, ...] = (),
                   num_used_blocks: int = 0, num_gpu_blocks: int = 1052, finished_ids: tuple[str, ...] = (),
                   engine_time_s: float = 0.0) -> Heartbeat:
    return Heartbeat(
        instance_id=instance_id, state=state, seq=seq, sent_at_s=time.time() if sent_at_s is None else sent_at_s,
        engine_time_s=engine_time_s, model="emulated", preset="llama2-7b-a30",
        engine_config={"num_gpu_blocks": num_gpu_blocks, "block_size": 16, "max_num_seqs": 48,
                       "max_num_batched_tokens": 512, "max_model_len": 4096},
        latency_model=None, num_used_blocks=num_used_blocks, running=running, waiting=waiting,
        num_running_total=len(running), num_waiting_total=len(waiting), finished_ids=finished_ids)
