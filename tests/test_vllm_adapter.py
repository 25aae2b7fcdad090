"""The vLLM adapter's mapping, against a double that follows vLLM's documented
``generate()`` contract (cumulative RequestOutput objects; ``abort``). No GPU here."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from workers.engines.base import EngineRequestSpec
from workers.engines.vllm import VllmEngine
from workers.engines.vllm_options import VllmEngineOptions
from workers.engines.vllm_state import EngineSnapshot, snapshot_of


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool


@dataclass
class EngineDouble:
    """Emits one token per iteration, cumulative text, like vLLM's default output kind."""

    num_tokens: int = 4
    delay_s: float = 0.001
    aborted: list[str] = field(default_factory=list)
    seen_prompts: list[object] = field(default_factory=list)

    async def generate(self, prompt, params, request_id):  # noqa: ANN001, ANN201
        self.seen_prompts.append(prompt)
        words = []
        for i in range(self.num_tokens):
            await asyncio.sleep(self.delay_s)
            words.append(f" w{i}")
            done = i == self.num_tokens - 1
            yield RequestOutput(request_id, [CompletionOutput("".join(words), list(range(i + 1)),
                                                              "length" if done else None)], done)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def spec(request_id: str, prompt: object = "hi") -> EngineRequestSpec:
    return EngineRequestSpec(request_id=request_id, prompt=prompt, prompt_tokens=2, max_tokens=4,
                             predicted_output_tokens=4)


async def drain(engine: VllmEngine) -> list:
    events = []
    while engine.has_unfinished_requests():
        events.extend((await engine.step()).events)
    return events


async def test_tokens_map_to_events_with_deltas_and_finish() -> None:
    double = EngineDouble()
    engine = VllmEngine(VllmEngineOptions(model="m"), engine=double, params_factory=lambda s: None)
    engine.add_request(spec("a"))
    engine.add_request(spec("b", prompt=(1, 2, 3)))
    events = await drain(engine)
    for request_id in ("a", "b"):
        mine = [e for e in events if e.request_id == request_id]
        assert "".join(e.text for e in mine) == " w0 w1 w2 w3"
        assert sum(e.num_new_tokens for e in mine) == 4
        assert mine[0].is_first and not any(e.is_first for e in mine[1:])
        assert mine[-1].finished and mine[-1].finish_reason == "length"
    assert double.seen_prompts[1] == {"prompt_token_ids": [1, 2, 3]}


async def test_progress_lays_vllms_counts_over_arrival_order() -> None:
    """vLLM reports how many requests run, not which: the earliest arrivals are the ones
    running (FCFS), the rest wait with nothing computed."""
    engine = VllmEngine(VllmEngineOptions(model="m", max_num_seqs=3), engine=EngineDouble(num_tokens=50),
                        params_factory=lambda s: None)
    engine.add_request(spec("a"))
    engine.add_request(spec("b"))
    assert engine.num_admittable() == 1
    running, waiting, _ = engine.progress()
    assert not running and [w.request_id for w in waiting] == ["a", "b"]
    await engine.step()
    engine.stats.num_running = 1  # as vLLM's stat logger would report after b's preemption
    running, waiting, _ = engine.progress()
    assert [r.request_id for r in running] == ["a"] and [w.request_id for w in waiting] == ["b"]
    assert running[0].num_computed_tokens == 2 + running[0].num_generated_tokens - 1
    assert waiting[0].num_computed_tokens == 0 and waiting[0].num_generated_tokens >= 1
    assert engine.abort_request("a") and engine.abort_request("b")
    await asyncio.sleep(0.01)
    assert engine.engine.aborted == ["a", "b"]
    assert engine.progress() == ([], [], 0)
    assert not engine.abort_request("a")


async def test_an_engine_error_ends_the_request_with_its_message() -> None:
    class Failing(EngineDouble):
        async def generate(self, prompt, params, request_id):  # noqa: ANN001, ANN201
            raise ValueError("Token id 999999 is out of vocabulary")
            yield  # an async generator, as vLLM's

    engine = VllmEngine(VllmEngineOptions(model="m"), engine=Failing(), params_factory=lambda s: None)
    engine.add_request(spec("a"))
    events = await drain(engine)
    assert [(e.finished, e.finish_reason) for e in events] == [(True, "error")]
    assert "out of vocabulary" in events[0].error


def test_missing_model_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="model: --model PATH is required"):
        VllmEngineOptions(model=None)


def test_missing_vllm_package_is_a_clear_error() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="'vllm' package is not installed"):
            VllmEngine(VllmEngineOptions(model="/models/llama"))
    else:
        pytest.skip("vLLM is installed")


def test_what_a_killed_worker_started_dies_with_it(tmp_path) -> None:  # noqa: ANN001
    """The watchdog kills the processes a worker started (vLLM's engine processes) once
    the worker is gone, even by SIGKILL: a real process tree here, without vLLM."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from tests.conftest import REPO_ROOT, wait_until

    script = tmp_path / "worker.py"
    script.write_text("import subprocess, sys, time\n"
                      "from workers.engines.vllm_watchdog import kill_engine_processes_on_exit\n"
                      "kill_engine_processes_on_exit()\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
                      "print(child.pid, flush=True)\n"
                      "time.sleep(300)\n")
    worker = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        child = psutil.Process(int(worker.stdout.readline()))
        time.sleep(1.5)  # the watchdog notes descendants every 0.5 s (vLLM's start in ~30 s)
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
        wait_until(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, timeout_s=10.0,
                   interval_s=0.1)
    finally:
        worker.kill()


async def test_progress_follows_the_engine_cores_snapshot() -> None:
    """With the scheduler's snapshots the state is vLLM's own: its running order, each
    request's computed and generated tokens, preemptions by each request's count, the
    requests the core has not taken in waiting last, the ones it finished left out."""
    engine = VllmEngine(VllmEngineOptions(model="m", max_num_seqs=8), engine=EngineDouble(num_tokens=50),
                        params_factory=lambda s: None)
    for request_id in ("a", "b", "c-1", "d"):
        engine.add_request(spec(request_id))
    first = EngineSnapshot(at_s=engine._origin_s + 1.0, running=(("b-0f3a9c1e", 2, 5, 0), ("a-77aa00bb", 2, 3, 0)),
                           waiting=(("c-1-12345678", 0, 0, 0),), used_blocks=3, num_steps=7)
    assert engine.state.apply(first, engine._tracked) == []
    running, waiting, num_used_blocks = engine._progress_of(first)
    assert [(r.request_id, r.num_computed_tokens, r.num_generated_tokens) for r in running] == [
        ("b", 2, 5), ("a", 2, 3)]
    assert [w.request_id for w in waiting] == ["c-1", "d"] and num_used_blocks == 3  # d: not in the core yet
    # a is preempted (its count grows), b finished in the core and is no longer there
    later = EngineSnapshot(at_s=engine._origin_s + 2.0, running=(("c-1-12345678", 2, 1, 0),),
                           waiting=(("a-77aa00bb", 0, 3, 1), ("d-abcdef01", 0, 0, 0)), used_blocks=1, num_steps=9)
    assert engine.state.apply(first, engine._tracked) == []  # an older snapshot changes nothing
    assert engine.state.apply(later, engine._tracked) == ["a"]
    running, waiting, _ = engine._progress_of(later)
    assert [r.request_id for r in running] == ["c-1"]
    assert [(w.request_id, w.num_computed_tokens) for w in waiting] == [("a", 0), ("d", 0)]
    for request_id in ("a", "b", "c-1", "d"):
        engine.abort_request(request_id)
    assert engine._progress_of(later) == ([], [], 1)


def test_snapshots_encode_as_the_scheduler_sends_them() -> None:
    class Pool:
        num_gpu_blocks = 10

        def get_num_free_blocks(self) -> int:
            return 6

    @dataclass
    class Req:
        request_id: str
        num_computed_tokens: int
        num_output_tokens: int
        num_preemptions: int = 0

    class Scheduler:
        running = [Req("x-1", 40, 3)]
        waiting = [Req("y-2", 0, 0)]
        kv_holding_waiting = [Req("z-3", 16, 0, 1)]
        kv_cache_manager = type("Manager", (), {"block_pool": Pool()})()

    snapshot = EngineSnapshot.decode(snapshot_of(Scheduler(), num_steps=4))
    assert snapshot.running == (("x-1", 40, 3, 0),)
    assert snapshot.waiting == (("z-3", 16, 0, 1), ("y-2", 0, 0, 0))  # block holders are admitted first
    assert snapshot.used_blocks == 3 and snapshot.num_steps == 4  # 10 - 6 free - the null block


def test_lora_options_reach_vllm_and_the_beat_names_the_adapters() -> None:
    from dataclasses import replace
    from types import SimpleNamespace

    options = VllmEngineOptions(model="m", lora_modules=(("sql", "/a"), ("poems", "/b")), max_loras=1,
                                served_model_name="base")
    args = options.engine_args()
    assert (args["enable_lora"], args["max_loras"], args["max_cpu_loras"]) == (True, 1, 1)
    assert "enable_lora" not in VllmEngineOptions(model="m").engine_args()
    with pytest.raises(ValueError, match="lora_modules"):
        VllmEngineOptions(model="m", lora_modules=(("sql", "/a"), ("sql", "/b")))
    engine = VllmEngine(options, engine=EngineDouble(), params_factory=lambda s: None)
    assert engine.model == "base"
    assert "gpt-9" in (engine.validate(replace(spec("a"), model="gpt-9")) or "")
    assert engine.validate(replace(spec("a"), model="sql")) is None
    assert engine.validate(replace(spec("a"), model="base")) is None
    assert engine.engine_config()["lora_adapters"] == ["sql", "poems"] and engine.engine_config()["loaded_loras"] == []
    # One resident at a time (max_loras 1): the latest running. vLLM's dicts name every adapter
    # with a request it tracks, in both, with 0 where none is in that state.
    for running in ({"sql": 2, "poems": 0}, {"poems": 1, "sql": 0}):
        engine.stats.record(SimpleNamespace(
            num_running_reqs=2, num_waiting_reqs=1, num_skipped_waiting_reqs=0, kv_cache_usage=0.1,
            prefix_cache_stats=None, iteration_details=None, running_lora_adapters=running,
            waiting_lora_adapters={"sql": 1, "poems": 0}), None, 1000)
    assert engine.engine_config()["loaded_loras"] == ["poems"]
    stats = engine.engine_stats()
    assert stats["running_lora_adapters"] == ["poems"] and stats["waiting_lora_adapters"] == ["sql"]
