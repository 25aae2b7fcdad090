"""Batch jobs confined to their files: every path a job names lies under the worker's roots
(symlinks and ``..`` resolved first), its chat template is checked again by the worker, and
its input is read line by line within a line-length and a line-count limit.

New names are imported inside the tests, so that each test fails on its own before the
feature exists rather than the whole module failing to import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import redis
from rq import Queue
from rq.job import Job, JobStatus

from blockq.config import ConfigError, Settings
from blockq.frontdoors.batch.jobs import JOB_FUNCTION, JOB_SERIALIZER, submit_batch
from blockq.frontdoors.batch.keys import BatchKeys
from blockq.frontdoors.batch.lines import BatchLine, LineError, read_batch_input
from blockq.frontdoors.batch.runner import BatchOptions
from blockq.frontdoors.gateway.chat_template import render_chatml
from blockq.frontdoors.gateway.openai_requests import RequestDefaults
from tests.conftest import REPO_ROOT, run_blockq
from tests.test_batch import answer_requests, completion_line, write_input

CHAT = {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}


def options_map(root: Path, input_path: Path | str, **overrides: Any) -> dict[str, Any]:
    """A job's options as stored in Redis, paths in ``root`` unless overridden."""
    return {"input_path": str(input_path), "output_path": str(root / "out.jsonl"),
            "errors_path": str(root / "out.errors.jsonl"), "priority": "batch", "tenant": "default",
            "max_rate_per_s": None, "concurrency": 8, "request_timeout_s": 30.0, "chat_template": "chatml",
            **overrides}


def enqueue_raw(sync_redis: redis.Redis, settings: Settings, options: dict[str, Any]) -> Job:
    """A job written straight into the queue, as anyone able to write to Redis could."""
    queue = Queue(BatchKeys(settings.key_prefix).queue_name, connection=sync_redis, serializer=JOB_SERIALIZER)
    return queue.enqueue_call(JOB_FUNCTION, kwargs={"options": options}, result_ttl=600, failure_ttl=600)


def failure_reason(job: Job) -> str:
    job.refresh()
    assert job.get_status() == JobStatus.FAILED, (job.id, job.get_status())
    result = job.latest_result()
    lines = ((result.exc_string or "") if result is not None else "").strip().splitlines()
    return lines[-1] if lines else ""


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """A root holding valid batch files, and an outside holding what a job must not touch."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    write_input(root / "in.jsonl", [completion_line("a"), CHAT])
    write_input(outside / "secret.jsonl", [completion_line("secret")])
    (outside / "victim.txt").write_text("precious\n")
    (outside / "t.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (root / "broken.jinja").write_text("{% for m in messages %}")
    (root / "link.jsonl").symlink_to(outside / "secret.jsonl")
    (root / "outlink").symlink_to(outside)
    return {"root": root.resolve(), "outside": outside.resolve()}


# --- the worker: a real process, jobs written straight into Redis ------------------------------------


def refused_jobs(files: dict[str, Path]) -> dict[str, tuple[dict[str, Any], str]]:
    """name -> (options, the field the refusal must name)."""
    root, outside = files["root"], files["outside"]
    return {
        "input outside": (options_map(root, outside / "secret.jsonl"), "input_path"),
        "input through a symlink": (options_map(root, root / "link.jsonl"), "input_path"),
        "input through ..": (options_map(root, f"{root}/../outside/secret.jsonl"), "input_path"),
        "input relative": (options_map(root, "in.jsonl"), "input_path"),
        "output outside": (options_map(root, root / "in.jsonl", output_path=str(outside / "victim.txt")),
                           "output_path"),
        "errors outside": (options_map(root, root / "in.jsonl", errors_path=str(outside / "victim.txt")),
                           "errors_path"),
        "output through a symlinked folder": (
            options_map(root, root / "in.jsonl", output_path=str(root / "outlink" / "victim.txt")), "output_path"),
        "template outside": (options_map(root, root / "in.jsonl", chat_template=str(outside / "t.jinja")),
                             "chat_template"),
        "template that does not compile": (
            options_map(root, root / "in.jsonl", chat_template=str(root / "broken.jinja")), "chat_template"),
    }


def run_burst_worker(settings: Settings, *flags: str) -> subprocess.CompletedProcess[bytes]:
    """``blockq batch worker --burst`` in the repository (not the root), with the fake pipeline answering."""
    stop, seen = threading.Event(), []
    fake = threading.Thread(target=answer_requests, args=(settings, stop, seen))
    fake.start()
    try:
        return subprocess.run([sys.executable, "-m", "blockq.frontdoors.batch", "worker", "--burst", *flags],
                              cwd=REPO_ROOT, env={**os.environ, "BLOCKQ_REDIS_URL": settings.redis_url or ""},
                              capture_output=True, timeout=120)
    finally:
        stop.set()
        fake.join()


def test_worker_confines_jobs_to_its_roots_and_limits(files: dict[str, Path], sync_redis: redis.Redis,
                                                       settings: Settings) -> None:
    root, outside = files["root"], files["outside"]
    refused = {name: (enqueue_raw(sync_redis, settings, options), field)
               for name, (options, field) in refused_jobs(files).items()}
    # Within the roots: a line over the length limit is an error line, the rest runs.
    write_input(root / "long.jsonl", [completion_line("a"), completion_line("long", prompt="x" * 3000),
                                      completion_line("c")])
    good = enqueue_raw(sync_redis, settings, options_map(root, root / "long.jsonl"))
    write_input(root / "many.jsonl", [completion_line(f"m{i}") for i in range(21)])
    too_many = enqueue_raw(sync_redis, settings, options_map(root, root / "many.jsonl",
                                                             output_path=str(root / "many.out.jsonl")))
    outside_before = sorted(p.name for p in outside.iterdir())

    worker = run_burst_worker(settings, "--input-root", str(root), "--max-line-bytes", "2000", "--max-lines", "20")
    assert worker.returncode == 0, worker.stderr.decode()[-3000:]

    for name, (job, field) in refused.items():
        reason = failure_reason(job)
        assert field in reason and str(root) in reason, (name, reason)
    assert (outside / "victim.txt").read_text() == "precious\n"
    assert sorted(p.name for p in outside.iterdir()) == outside_before
    keys = BatchKeys(settings.key_prefix)
    for job, _ in refused.values():  # refused before anything was read or recorded
        assert not sync_redis.exists(keys.results(job.id), keys.errors(job.id), keys.lease(job.id))

    reason = failure_reason(too_many)
    assert "max_lines" in reason and "20" in reason, reason
    assert not (root / "many.out.jsonl").exists()

    good.refresh()
    assert good.get_status() == JobStatus.FINISHED, failure_reason(good)
    results = [json.loads(line) for line in (root / "out.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["a", "c"]
    errors = [json.loads(line) for line in (root / "out.errors.jsonl").read_text().splitlines()]
    assert [(e["line"], e["error"]["code"]) for e in errors] == [(2, "line_too_long")]
    assert "line 2" in errors[0]["error"]["message"] and "2000 bytes" in errors[0]["error"]["message"]


def test_worker_refuses_bad_configuration(tmp_path: Path, settings: Settings) -> None:
    for flags, field in ((["--input-root", str(tmp_path / "missing")], "input_root"),
                         (["--max-lines", "0"], "max_lines"), (["--max-line-bytes", "-1"], "max_line_bytes")):
        worker = subprocess.run([sys.executable, "-m", "blockq.frontdoors.batch", "worker", "--burst", *flags],
                                cwd=tmp_path, env={**os.environ, "BLOCKQ_REDIS_URL": settings.redis_url or ""},
                                capture_output=True, text=True, timeout=60)
        assert worker.returncode == 2 and field in worker.stderr, (flags, worker.stderr[-2000:])


# --- the submitting side checks the same, so that a user learns at once --------------------------------


def test_submit_checks_paths_against_the_roots(files: dict[str, Path], settings: Settings) -> None:
    root, outside = files["root"], files["outside"]
    env = {"BLOCKQ_REDIS_URL": settings.redis_url or "", "BLOCKQ_BATCH_INPUT_ROOT": str(root)}
    for args, field in (([str(outside / "secret.jsonl"), "--out", str(root / "o.jsonl")], "input"),
                        ([str(root / "in.jsonl"), "--out", str(outside / "o.jsonl")], "out")):
        result = run_blockq("batch", "submit", *args, "--json", env=env)
        assert result.returncode == 2, result.stdout + result.stderr
        assert field in result.stderr and str(root) in result.stderr, result.stderr
    accepted = run_blockq("batch", "submit", "in.jsonl", "--out", "o.jsonl", "--json", env=env, cwd=root)
    assert accepted.returncode == 0, accepted.stderr
    assert json.loads(accepted.stdout)["input"] == str(root / "in.jsonl")


def test_submit_checks_templates_and_line_count(files: dict[str, Path], sync_redis: redis.Redis,
                                                settings: Settings) -> None:
    from blockq.frontdoors.batch.files import BatchFilesConfig
    from blockq.frontdoors.batch.lines import LineLimits

    root, outside = files["root"], files["outside"]
    config = BatchFilesConfig(input_root=root, output_root=root, limits=LineLimits(max_lines=1))
    for template in (str(outside / "t.jinja"), str(root / "broken.jinja")):
        options = BatchOptions.from_map(options_map(root, root / "in.jsonl", chat_template=template))
        with pytest.raises(ConfigError, match="chat_template"):
            submit_batch(sync_redis, settings, options, config)
    with pytest.raises(ConfigError, match="max_lines"):
        submit_batch(sync_redis, settings, BatchOptions.from_map(options_map(root, root / "in.jsonl")), config)
    assert sync_redis.llen(f"rq:queue:{BatchKeys(settings.key_prefix).queue_name}") == 0


# --- the pure parts: configuration, paths, templates ------------------------------------------------------


def test_files_config_is_validated(tmp_path: Path) -> None:
    from blockq.frontdoors.batch.files import BatchFilesConfig
    from blockq.frontdoors.batch.lines import LineLimits

    (tmp_path / "a-file").write_text("")
    for kwargs, field in (({"input_root": tmp_path / "missing"}, "input_root"),
                          ({"output_root": tmp_path / "a-file"}, "output_root"),
                          ({"input_root": Path("relative")}, "input_root")):
        with pytest.raises(ConfigError, match=field):
            BatchFilesConfig(**{"input_root": tmp_path, "output_root": tmp_path, **kwargs})
    for kwargs, field in (({"max_lines": 0}, "max_lines"), ({"max_line_bytes": 0}, "max_line_bytes")):
        with pytest.raises(ConfigError, match=field):
            LineLimits(**kwargs)
    config = BatchFilesConfig.from_env({"BLOCKQ_BATCH_MAX_LINES": "7"}, cwd=tmp_path)
    assert (config.input_root, config.output_root, config.limits.max_lines) == (tmp_path, tmp_path, 7)
    assert BatchFilesConfig.from_env(config.to_env(), cwd=Path("/")) == config
    with pytest.raises(ConfigError, match="BLOCKQ_BATCH_MAX_LINE_BYTES"):
        BatchFilesConfig.from_env({"BLOCKQ_BATCH_MAX_LINE_BYTES": "lots"}, cwd=tmp_path)
    with pytest.raises(ConfigError, match="input_root"):  # a daemon's cwd of / would confine nothing
        BatchFilesConfig.from_env({}, cwd=Path("/"))


def test_chat_template_that_escapes_the_sandbox_is_a_line_error(files: dict[str, Path]) -> None:
    from blockq.frontdoors.batch.files import check_chat_template

    root = files["root"]
    (root / "escape.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    render = check_chat_template(str(root / "escape.jinja"), root)
    write_input(root / "chat.jsonl", [CHAT, completion_line("b")])
    from blockq.frontdoors.batch.lines import LineLimits

    items = list(read_batch_input(root / "chat.jsonl", render, RequestDefaults(), Settings(), LineLimits()))
    assert isinstance(items[0], LineError) and items[0].param == "body.messages", items[0]
    assert "chat_template" in items[0].message and isinstance(items[1], BatchLine)


# --- the input is read line by line, within limits -----------------------------------------------------


def test_long_line_is_an_error_line_and_the_rest_goes_on(tmp_path: Path) -> None:
    from blockq.frontdoors.batch.lines import LineLimits

    exact = json.dumps(completion_line("exact"))
    exact = exact.replace('"hello"', '"' + "h" * (300 - len(exact) + len("hello")) + '"')
    assert len(exact.encode()) == 300
    path = write_input(tmp_path / "in.jsonl", [completion_line("a"), completion_line("b", prompt="é" * 200),
                                               exact, "\xff not utf-8 once encoded", completion_line("c")])
    path.write_bytes(path.read_bytes().replace("\xff".encode(), b"\xff"))
    items = list(read_batch_input(path, render_chatml, RequestDefaults(), Settings(),
                                  LineLimits(max_line_bytes=300, max_lines=5)))
    kinds = [(i.line_number, i.code if isinstance(i, LineError) else "ok") for i in items]
    assert kinds == [(1, "ok"), (2, "line_too_long"), (3, "ok"), (4, "invalid_json"), (5, "ok")]
    assert "line 2" in items[1].message and "300 bytes" in items[1].message  # type: ignore[union-attr]


def test_input_over_the_line_limit_is_refused(tmp_path: Path) -> None:
    from blockq.frontdoors.batch.lines import InputTooLarge, LineLimits, count_lines

    path = write_input(tmp_path / "in.jsonl", [completion_line(f"r{i}") for i in range(10)])
    assert count_lines(path, LineLimits(max_lines=10)) == 10
    assert len(list(read_batch_input(path, render_chatml, RequestDefaults(), Settings(), LineLimits(max_lines=10)))) == 10
    with pytest.raises(InputTooLarge, match="max_lines.*9"):
        count_lines(path, LineLimits(max_lines=9))
    with pytest.raises(InputTooLarge, match="max_lines.*9"):
        list(read_batch_input(path, render_chatml, RequestDefaults(), Settings(), LineLimits(max_lines=9)))


def test_reading_never_holds_the_file(tmp_path: Path) -> None:
    from blockq.frontdoors.batch.lines import LineLimits

    path = tmp_path / "big.jsonl"
    with path.open("w") as file:
        file.write('{"custom_id": "huge", "body": "' + "x" * (48 << 20) + '"}\n')  # one 48 MiB line
        for i in range(2000):  # and 40 MB of ordinary lines
            file.write(json.dumps(completion_line(f"r{i}", prompt="y" * 20_000)) + "\n")
    limits = LineLimits(max_line_bytes=64 << 10, max_lines=5000)
    tracemalloc.start()
    try:
        num_ok = sum(isinstance(item, BatchLine)
                     for item in read_batch_input(path, render_chatml, RequestDefaults(), Settings(), limits))
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert num_ok == 2000
    assert peak_bytes < 4 << 20, peak_bytes  # a few lines at a time, never the file or the long line


def test_job_over_the_line_limit_fails_before_anything_runs(tmp_path: Path, settings: Settings,
                                                           sync_redis: redis.Redis) -> None:
    from blockq.frontdoors.batch.files import BatchFilesConfig
    from blockq.frontdoors.batch.lines import InputTooLarge, LineLimits
    from blockq.frontdoors.batch.runner import BatchRun

    path = write_input(tmp_path / "in.jsonl", [completion_line(f"r{i}") for i in range(5)] + ["{bad"])
    options = BatchOptions(input_path=str(path), output_path=str(tmp_path / "out.jsonl"),
                           errors_path=str(tmp_path / "errors.jsonl"))
    config = BatchFilesConfig(input_root=tmp_path, output_root=tmp_path, limits=LineLimits(max_lines=5))
    saved: list[dict[str, Any]] = []
    with pytest.raises(InputTooLarge, match="max_lines"):
        BatchRun("job1", options, settings, sync_redis, saved.append, files=config).run()
    assert sync_redis.xlen(settings.keys.requests) == 0 and not saved
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "errors.jsonl").exists()


def test_job_run_never_holds_the_file(tmp_path: Path, settings: Settings, sync_redis: redis.Redis) -> None:
    from blockq.frontdoors.batch.files import BatchFilesConfig
    from blockq.frontdoors.batch.runner import BatchRun

    path = write_input(tmp_path / "in.jsonl", [completion_line(f"r{i}", prompt="y" * 40_000) for i in range(500)])
    options = BatchOptions(input_path=str(path), output_path=str(tmp_path / "out.jsonl"),
                           errors_path=str(tmp_path / "errors.jsonl"), concurrency=8)
    config = BatchFilesConfig(input_root=tmp_path, output_root=tmp_path)
    stop, seen = threading.Event(), []
    fake = threading.Thread(target=answer_requests, args=(settings, stop, seen))
    fake.start()
    tracemalloc.start()
    try:
        summary = BatchRun("job1", options, settings, sync_redis, lambda _: None, files=config).run()
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        stop.set()
        fake.join()
    assert summary["done"] == 500 and path.stat().st_size > 19 << 20
    assert peak_bytes < 8 << 20, peak_bytes  # the lines in flight, not the file (21 MiB before: 2.4 after)
