"""Faults injected into a real local cluster under load, and what the readers saw.

Each scenario starts its own cluster (``blockq up --detach`` in a private state
directory: embedded Redis, predictor, dispatcher, one worker process per instance),
submits requests through :class:`blockq.AsyncClient` on a seeded Poisson schedule, and
injects one fault (kill -9 of a process, SIGSTOP, a Redis crash, a flood of malformed
entries, load past capacity). Every request is read as a client reads it, streamed chunks
and final record, through the client library (which retries its reads across a Redis
restart until the request's timeout).

What is counted, per scenario:

* ``accepted``: submits that returned a handle; ``refused``: ``Overloaded``;
  ``failed_submits``: submits that failed otherwise (e.g. Redis down);
* ``answered``: accepted requests whose final record arrived; ``lost``: the others;
* ``duplicates``: requests whose reader saw a streamed text different from the final
  text, or whose reply stream holds more than one final record;
* ``recovery_s``: from the fault (for Redis: from Redis answering again) until the
  completion rate over a 2 s window is back to half the rate before the fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from blockq.client import AsyncClient, AsyncHandle, Overloaded, SubmitSpec
from blockq.config import Settings
from blockq.runtime.logs import configure_logging
from blockq.wire.keys import PAYLOAD_FIELD, Keys
from blockq.wire.protocol import FinalRecord, decode_reply_entry
from loadgen.chaos_faults import (
    SCENARIOS,
    ChaosCluster,
    ChaosOptions,
    Scenario,
    kill_redis,
    kill_redis_losing_last_second,
    no_fault,
)

RECOVERY_WINDOW_S = 2.0


@dataclass
class Outcome:
    """What one request's submitter and reader saw."""

    request_id: str | None = None
    submit_error: str | None = None
    status: str | None = None
    streamed_text: str = ""
    final_text: str | None = None
    finished_at_s: float | None = None
    num_finals: int = 0
    num_resubmits: int = 0  # times its client submitted it again (Redis lost it)


@dataclass
class ScenarioResult:
    scenario: str
    accepted: int
    refused: int
    failed_submits: int
    answered: int
    lost: int
    duplicates: int
    recovery_s: float | None
    wall_s: float
    notes: dict[str, Any] = field(default_factory=dict)


# --- load and reading --------------------------------------------------------------------

def request_specs(options: ChaosOptions) -> list[tuple[float, SubmitSpec]]:
    """The seeded schedule: Poisson arrivals, token-id prompts and recorded output lengths
    (so that every run of a request, and a re-run, has the same length)."""
    rng = random.Random(options.seed)
    at_s, schedule = 0.0, []
    for _ in range(options.requests):
        prompt = [rng.randint(5, 30_000) for _ in range(rng.randint(20, 400))]
        output_tokens = max(1, min(options.max_output_tokens, int(rng.lognormvariate(4.2, 0.6))))
        schedule.append((at_s, SubmitSpec(prompt=prompt, max_tokens=options.max_output_tokens,
                                          true_output_tokens=output_tokens)))
        at_s += rng.expovariate(options.rate_per_s)
    return schedule


async def _retrying(call: Callable[[], Awaitable[Any]], deadline_s: float) -> Any:
    """``call()`` again after connection errors (Redis restarting), until the deadline."""
    while True:
        try:
            return await call()
        except (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError):
            if time.monotonic() > deadline_s:
                raise
            await asyncio.sleep(0.2)


async def _read(handle: AsyncHandle, outcome: Outcome, started_s: float, deadline_s: float) -> None:
    """Read as a client reads: the library's own stream, which rides out Redis restarts."""
    try:
        async for chunk in handle.stream(timeout_s=max(0.1, deadline_s - time.monotonic())):
            outcome.streamed_text += chunk.text
    except TimeoutError:
        return
    finally:
        outcome.num_resubmits = handle.num_resubmits
    final = await handle.result(timeout_s=1.0)  # read already: no wait
    outcome.status, outcome.final_text = final.status, final.text
    outcome.finished_at_s = time.monotonic() - started_s


async def _submit_and_read(client: AsyncClient, at_s: float, spec: SubmitSpec, started_s: float,
                           options: ChaosOptions) -> Outcome:
    outcome = Outcome()
    await asyncio.sleep(max(0.0, started_s + at_s - time.monotonic()))
    try:
        handle = (await client.submit_many([spec]))[0]
    except Overloaded:
        outcome.submit_error = "overloaded"
        return outcome
    except (redis.RedisError, ConnectionError, OSError) as exc:
        outcome.submit_error = type(exc).__name__
        return outcome
    outcome.request_id = handle.id
    await _read(handle, outcome, started_s, time.monotonic() + options.answer_timeout_s)
    return outcome


async def _count_finals(redis_url: str, outcomes: list[Outcome]) -> None:
    client = aioredis.Redis.from_url(redis_url)
    keys = Keys()
    try:
        for outcome in outcomes:
            if outcome.request_id is None:
                continue
            entries = await client.xrange(keys.reply(outcome.request_id))
            outcome.num_finals = sum(isinstance(decode_reply_entry(fields[PAYLOAD_FIELD.encode()]), FinalRecord)
                                     for _, fields in entries)
    finally:
        await client.aclose()


async def _sample_backlog(redis_url: str, stop: asyncio.Event, samples: list[tuple[int, int]]) -> None:
    """(entries waiting in the pipeline's streams, Redis used memory) every 0.5 s."""
    client = aioredis.Redis.from_url(redis_url)
    keys = Keys()
    try:
        while not stop.is_set():
            with contextlib.suppress(redis.RedisError, OSError):
                queues = [key async for key in client.scan_iter(match=keys.instance_queue_pattern())]
                lengths = [await client.xlen(key) for key in [keys.requests, keys.ready, *queues]]
                memory = (await client.info("memory"))["used_memory"]
                samples.append((sum(lengths), int(memory)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
    finally:
        await client.aclose()


async def _drive(cluster: ChaosCluster, scenario: Scenario, options: ChaosOptions) -> tuple[list[Outcome], dict]:
    state = cluster.state()
    fault_client = redis.Redis.from_url(state.redis_url)
    backlog: list[tuple[int, int]] = []
    stop_sampling = asyncio.Event()
    sampler = asyncio.create_task(_sample_backlog(state.redis_url, stop_sampling, backlog))
    notes: dict[str, Any] = {}
    # The backlog limit is checked by the admission script with the submitter's setting.
    limit = {} if options.max_backlog is None else {"max_ingress_backlog": options.max_backlog}
    async with AsyncClient(settings=Settings(redis_url=state.redis_url, **limit)) as client:
        started_s = time.monotonic()

        async def fault() -> None:
            await asyncio.sleep(options.fault_at_s)
            notes["fault_at_s"] = round(time.monotonic() - started_s, 2)
            notes.update(await scenario.fault(cluster, fault_client))
            notes["fault_done_at_s"] = round(time.monotonic() - started_s, 2)

        fault_task = asyncio.create_task(fault())
        outcomes = await asyncio.gather(*(_submit_and_read(client, at_s, spec, started_s, options)
                                          for at_s, spec in request_specs(options)))
        await fault_task
    stop_sampling.set()
    await sampler
    fault_client.close()
    await _retrying(lambda: _count_finals(state.redis_url, outcomes), time.monotonic() + 30)
    if backlog:
        notes["max_backlog_entries"] = max(b for b, _ in backlog)
        notes["max_redis_memory_mib"] = round(max(m for _, m in backlog) / 2**20, 1)
    return outcomes, notes


def recovery_s(finished_at_s: list[float], fault_s: float, pre_window_s: float = 5.0) -> float | None:
    """Seconds from ``fault_s`` until completions over a window are back to half the rate
    of the ``pre_window_s`` before the fault; None when there was no rate to return to."""
    before = [t for t in finished_at_s if fault_s - pre_window_s <= t < fault_s]
    if not before:
        return None
    needed = 0.5 * len(before) / pre_window_s * RECOVERY_WINDOW_S
    times = sorted(t for t in finished_at_s if t >= fault_s)
    for index, start_s in enumerate([fault_s, *times]):
        in_window = sum(1 for t in times[index:] if start_s <= t < start_s + RECOVERY_WINDOW_S)
        if in_window >= needed:
            return round(max(0.0, start_s - fault_s), 2)
    return None


def run_scenario(scenario: Scenario, base: ChaosOptions | None = None, logs_dir: Path | None = None) -> ScenarioResult:
    options = ChaosOptions(**{**asdict(base or ChaosOptions()), **scenario.options})
    wall_started_s = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="blockq-chaos-") as tmp:
        cluster = ChaosCluster(Path(tmp), options)
        cluster.up()
        try:
            if scenario.standby_dispatcher:
                cluster.start_standby_dispatcher()
            outcomes, notes = asyncio.run(_drive(cluster, scenario, options))
        finally:
            cluster.down(None if logs_dir is None else logs_dir / scenario.name)
    accepted = [o for o in outcomes if o.request_id is not None]
    answered = [o for o in accepted if o.final_text is not None]
    duplicates = [o for o in answered if o.streamed_text != o.final_text or o.num_finals > 1]
    restarts_redis = scenario.fault in (kill_redis, kill_redis_losing_last_second)
    fault_s = notes.get("fault_done_at_s" if restarts_redis else "fault_at_s", options.fault_at_s)
    statuses: dict[str, int] = {}
    for outcome in answered:
        statuses[outcome.status or "?"] = statuses.get(outcome.status or "?", 0) + 1
    notes["statuses"] = statuses
    notes["resubmitted"] = sum(o.num_resubmits for o in accepted)
    return ScenarioResult(
        scenario=scenario.name, accepted=len(accepted),
        refused=sum(o.submit_error == "overloaded" for o in outcomes),
        failed_submits=sum(o.submit_error not in (None, "overloaded") for o in outcomes),
        answered=len(answered), lost=len(accepted) - len(answered), duplicates=len(duplicates),
        recovery_s=recovery_s([o.finished_at_s for o in answered if o.finished_at_s is not None], fault_s)
        if scenario.fault is not no_fault else None,
        wall_s=round(time.monotonic() - wall_started_s, 1), notes=notes)


def markdown_table(results: list[ScenarioResult]) -> str:
    lines = ["| scenario | accepted | refused | failed submits | answered | lost | duplicates | recovery s | notes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        recovery = "—" if r.recovery_s is None else f"{r.recovery_s:.1f}"
        lines.append(f"| {r.scenario} | {r.accepted} | {r.refused} | {r.failed_submits} | {r.answered} | {r.lost} "
                     f"| {r.duplicates} | {recovery} | {json.dumps(r.notes, sort_keys=True)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m loadgen.chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated names")
    parser.add_argument("--requests", type=int, default=ChaosOptions.requests)
    parser.add_argument("--rate", type=float, default=ChaosOptions.rate_per_s)
    parser.add_argument("--seed", type=int, default=ChaosOptions.seed)
    parser.add_argument("--logs-dir", type=Path, default=None, help="keep each scenario's service logs here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    # Log lines (a client resubmitting, say) on stderr: stdout is the table or the JSON.
    configure_logging("warning", "chaos")
    unknown = [name for name in args.scenarios.split(",") if name not in SCENARIOS]
    if unknown:
        parser.error(f"--scenarios: unknown {', '.join(unknown)} (known: {', '.join(SCENARIOS)})")
    base = ChaosOptions(requests=args.requests, rate_per_s=args.rate, seed=args.seed)
    results = []
    for name in args.scenarios.split(","):
        results.append(run_scenario(SCENARIOS[name], base, args.logs_dir))
        print(f"{name}: done in {results[-1].wall_s} s", file=sys.stderr)
    print(json.dumps([asdict(r) for r in results], indent=2) if args.json else markdown_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
