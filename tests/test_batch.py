"""Batch jobs without a cluster: input parsing, progress, rate limiting, atomic output,
and a whole job run by :class:`BatchRun` against the test Redis with a fake worker."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import redis

from blockq.config import Settings
from blockq.frontdoors.batch.bookkeeping import BatchProgress, RateLimiter, write_lines_atomically
from blockq.frontdoors.batch.files import BatchFilesConfig
from blockq.frontdoors.batch.keys import BatchKeys, batch_request_id
from blockq.frontdoors.batch.lines import BatchLine, LineError, LineLimits, read_batch_input
from blockq.frontdoors.batch.runner import BatchOptions, BatchRun
from blockq.frontdoors.gateway.chat_template import render_chatml
from blockq.frontdoors.gateway.openai_requests import RequestDefaults
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.protocol import Chunk, FinalRecord, decode_request, encode


def write_input(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def completion_line(custom_id: str, prompt: str = "hello", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": prompt, "max_tokens": 3, **body}}


def test_input_lines_are_validated_one_by_one(tmp_path: Path) -> None:
    chat = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
    path = write_input(tmp_path / "in.jsonl", [
        completion_line("a"), "{broken", "", chat, completion_line("a"), {"custom_id": "d", "url": "/v1/embeddings",
                                                                          "body": {}},
        completion_line("e", max_tokens=10**9), {"method": "POST"}, completion_line("f", stream=True),
    ])
    items = list(read_batch_input(path, render_chatml, RequestDefaults(), Settings(), LineLimits()))
    kinds = [(i.line_number, i.custom_id, i.code if isinstance(i, LineError) else "ok") for i in items]
    assert kinds == [(1, "a", "ok"), (2, None, "invalid_json"), (4, "c", "ok"), (5, "a", "duplicate_custom_id"),
                     (6, "d", "invalid_request"), (7, "e", "invalid_request"), (8, None, "invalid_request"),
                     (9, "f", "invalid_request")]
    params = {i.line_number: i.param for i in items if isinstance(i, LineError)}
    assert params[6] == "url" and params[7] == "body.max_tokens" and params[9] == "body.stream"
    assert isinstance(items[2], BatchLine) and items[2].plan.prompts[0].endswith("<|im_start|>assistant\n")


def test_request_ids_are_deterministic_per_job_and_custom_id() -> None:
    assert batch_request_id("job", "a") == batch_request_id("job", "a")
    assert len({batch_request_id("job", "a"), batch_request_id("job", "b"), batch_request_id("job2", "a")}) == 3
    assert len(batch_request_id("j" * 64, "x" * 512)) <= 128


def test_rate_limiter_and_progress() -> None:
    now = [0.0]
    limiter = RateLimiter(10.0, clock=lambda: now[0])
    assert limiter.take(5) == 1 and limiter.take(5) == 0
    assert abs(limiter.delay_s() - 0.1) < 1e-9
    now[0] = 10.0
    assert limiter.take(50) == 10  # at most one second's worth at once
    assert RateLimiter(None).take(1000) == 1000

    saved: list[dict[str, Any]] = []
    progress = BatchProgress(saved.append, clock=lambda: now[0])
    progress.start(total=3, done=1, failed=0)
    progress.add(done=1)
    progress.maybe_save()  # within 0.5 s of the last save: skipped
    now[0] += 1
    progress.maybe_save()
    progress.finish(canceled=False)
    assert [s["done"] for s in saved] == [1, 2, 2] and saved[-1]["total"] == 3


def test_atomic_write_replaces_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    write_lines_atomically(path, [b"one", "two"])
    assert path.read_text() == "one\ntwo\n" and [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def answer_requests(settings: Settings, stop: threading.Event, seen: list[str]) -> None:
    """A fake pipeline: every request gets one chunk and an ok final record (error when
    the prompt says "fail")."""
    client = redis.Redis.from_url(settings.redis_url or "")
    last_id = "0-0"
    while not stop.is_set():
        for _, entries in client.xread({settings.keys.requests: last_id}, block=50) or []:
            for entry_id, fields in entries:
                last_id = entry_id
                request = decode_request(fields[PAYLOAD_FIELD.encode()])
                seen.append(request.id)
                status = "error" if "fail" in str(request.prompt) else "ok"
                for message in (Chunk(request.id, 0, " x", 1),
                                FinalRecord(request.id, 1, status, " x", 1, 2, "inst-0", "length")):
                    client.xadd(request.reply_stream, {PAYLOAD_FIELD: encode(message)})
    client.close()


def test_batch_run_resumes_without_resubmitting_finished_lines(tmp_path: Path, settings: Settings,
                                                              sync_redis: redis.Redis) -> None:
    lines = [completion_line(f"r{i}", prompt="fail" if i == 13 else f"p{i}") for i in range(20)] + ["{bad"]
    path = write_input(tmp_path / "in.jsonl", lines)
    options = BatchOptions(input_path=str(path), output_path=str(tmp_path / "out.jsonl"),
                           errors_path=str(tmp_path / "errors.jsonl"), concurrency=4)
    keys = BatchKeys(settings.key_prefix)
    # A previous run finished r0..r9 (one stored result each) before its worker died.
    for i in range(10):
        sync_redis.hset(keys.results("job1"), f"r{i}", json.dumps({"custom_id": f"r{i}", "previous": True}))
    stop, seen = threading.Event(), []
    fake = threading.Thread(target=answer_requests, args=(settings, stop, seen))
    fake.start()
    saved: list[dict[str, Any]] = []
    try:
        files = BatchFilesConfig(input_root=tmp_path, output_root=tmp_path)
        summary = BatchRun("job1", options, settings, sync_redis, saved.append, files=files).run()
    finally:
        stop.set()
        fake.join()
    assert (summary["done"], summary["failed"], summary["total"]) == (19, 2, 21)
    assert sorted(seen) == sorted(batch_request_id("job1", f"r{i}") for i in range(10, 20))  # no resubmission
    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [f"r{i}" for i in range(20) if i != 13]
    assert results[0] == {"custom_id": "r0", "previous": True}
    assert results[15]["response"]["body"]["choices"][0]["text"] == " x"
    assert results[15]["response"]["request_id"] == batch_request_id("job1", "r16")
    errors = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert [(e["line"], e["custom_id"], e["error"]["code"]) for e in errors] == [
        (14, "r13", "generation_failed"), (21, None, "invalid_json")]
    assert saved[-1]["done"] == 19 and saved[-1]["failed"] == 2
