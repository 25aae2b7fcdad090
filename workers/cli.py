"""``python -m workers`` / ``blockq worker``: one process serving one or more instances.

When any instance's worker fails (one of its loops died), the others are stopped without
draining (their unfinished work stays pending, resumed by the restarted process) and the
process exits with status 1, so that its supervisor restarts it. When vLLM refuses to
start with the options given, the process exits with status 78
(:data:`blockq.local.cluster_config.WILL_NOT_START_EXIT_CODE`): the same options would fail
the same way, and ``blockq up`` stops and names the option rather than restart it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import structlog

from blockq.config import (
    DEFAULT_REFINE_EVERY_TOKENS,
    PREDICTOR_HTTP_TOKEN_ENV,
    VLLM_HTTP_API_KEY_ENV,
)
from blockq.engine_model.latency import StepLatencyModel
from blockq.engine_model.measured_profile import load_profile
from blockq.local.cluster_config import WILL_NOT_START_EXIT_CODE, WILL_NOT_START_MARKER
from blockq.runtime.metrics_server import (
    add_metrics_arguments,
    metrics_endpoint_from_args,
    serving_metrics,
)
from blockq.runtime.service_runner import add_common_arguments, run_service, settings_from_args
from blockq.wire.streams import connect_async
from workers.engines.vllm import EngineWillNotStart
from workers.engines.vllm_options import VllmEngineOptions, add_vllm_engine_arguments
from workers.metrics import WorkerMetrics
from workers.worker import InstanceWorker, WorkerFailed, WorkerOptions

log = structlog.get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--instance-id", default="inst", help="instance id (with --instances N: a prefix, ids ID-0..ID-N-1)")
    parser.add_argument("--instances", type=int, default=None,
                        help="serve N instances from this process (one asyncio task each), ids ID-i")
    parser.add_argument("--first-index", type=int, default=0, help="index of the first instance with --instances")
    parser.add_argument("--engine", choices=["emulated", "vllm", "vllm-http"], default="emulated",
                        help="vllm-http: drive the vLLM server at --url over its OpenAI API "
                             "(its API key, if any, in BLOCKQ_VLLM_HTTP_API_KEY)")
    parser.add_argument("--url", default=None, help="--engine vllm-http: the server, http://host:port")
    parser.add_argument("--kv-events-url", default=None,
                        help="--engine vllm-http: where the server publishes its KV cache events "
                             "(tcp://host:5557; with --model DIR, prefix hits are predicted there)")
    parser.add_argument("--preset", "--profile", dest="preset", default="llama2-7b-a30",
                        help="engine preset or measured PROFILE.json (blockq profile): the emulated "
                             "engine's; a vLLM engine publishes a profile's latency model in its beats")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="wall seconds per model second for the emulated engine (2 = half speed)")
    parser.add_argument("--noise", type=float, default=0.05, help="lognormal sigma of emulated step-time noise")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bundle-size", type=int, default=16, help="max queue entries per read")
    parser.add_argument("--stream-interval-ms", type=float, default=50.0, help="min ms between output chunks")
    parser.add_argument("--model", default=None, help="model path for --engine vllm")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="reuse the KV blocks of cached prompt prefixes (emulated: off by default; "
                             "vLLM: enable_prefix_caching=True, else vLLM's own default)")
    parser.add_argument("--refine-url", default=None,
                        help="the predictor's HTTP API (served with --refine-model): beats report running "
                             "requests' remaining lengths refined from their partial output")
    parser.add_argument("--refine-every-tokens", type=int, default=DEFAULT_REFINE_EVERY_TOKENS,
                        help="ask for a refinement every this many generated tokens")
    parser.add_argument("--nice", type=int, default=0,
                        help="lower this process's CPU priority (and its engine's processes') by N: on a node "
                             "shared with the dispatcher, Redis and clients, the engines yield to them")
    add_metrics_arguments(parser)  # one server for every instance of the process (label instance_id)
    add_vllm_engine_arguments(parser)


def instance_ids(args: argparse.Namespace) -> list[str]:
    if args.instances is None:
        return [args.instance_id]
    return [f"{args.instance_id}-{i}" for i in range(args.first_index, args.first_index + args.instances)]


def _profile_latency_model(args: argparse.Namespace) -> StepLatencyModel | None:
    """The latency model a vLLM instance publishes: a measured profile's (``--profile``)."""
    return load_profile(args.preset).latency_model if args.preset.endswith(".json") else None


def build_engine(args: argparse.Namespace, index: int):  # noqa: ANN201 - Engine protocol
    if args.engine == "vllm-http":
        from workers.engines.vllm_http import VllmHttpEngine, VllmHttpOptions

        if not args.url:
            raise SystemExit("--engine vllm-http needs --url http://host:port")
        options = VllmHttpOptions(args.url, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  api_key=os.environ.get(VLLM_HTTP_API_KEY_ENV) or None,
                                  kv_events_url=args.kv_events_url, model_dir=getattr(args, "model", None),
                                  max_loras=args.max_loras)
        return VllmHttpEngine(options, profile_latency_model=_profile_latency_model(args))
    if args.engine == "vllm":
        from workers.engines.vllm import VllmEngine
        from workers.engines.vllm_watchdog import kill_engine_processes_on_exit

        kill_engine_processes_on_exit()
        options = VllmEngineOptions.from_args(args, enable_prefix_caching=True if args.prefix_caching else None)
        return VllmEngine(options, profile_latency_model=_profile_latency_model(args))
    from workers.engines.emulated import EmulatedEngine, EmulatedEngineOptions

    overrides = (("enable_prefix_caching", True),) if args.prefix_caching else ()
    # The vLLM options that say what is served apply to the emulated engine too: its base
    # model's name and the adapters it serves by name (their paths are not read).
    adapters = tuple(name for name, _ in args.lora_modules)
    if adapters:
        overrides += (("max_loras", args.max_loras),)
    return EmulatedEngine(EmulatedEngineOptions(preset=args.preset, time_scale=args.time_scale,
                                                noise_sigma=args.noise, seed=args.seed + index,
                                                config_overrides=overrides, model_name=args.served_model_name,
                                                lora_adapters=adapters))


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if args.instances is not None and args.instances < 1:
        raise SystemExit("--instances: must be >= 1")
    ids = instance_ids(args)
    endpoint = metrics_endpoint_from_args(args)
    if args.nice:
        os.nice(args.nice)  # before the engine starts: vLLM's processes inherit it

    async def main(stop: asyncio.Event) -> None:
        client = connect_async(settings.redis_url, max_connections=64 * len(ids))
        options = WorkerOptions(bundle_size=args.bundle_size, stream_interval_ms=args.stream_interval_ms,
                                refine_url=args.refine_url,
                                refine_token=os.environ.get(PREDICTOR_HTTP_TOKEN_ENV) or None,
                                refine_every_tokens=args.refine_every_tokens)
        metrics = WorkerMetrics()
        workers = [InstanceWorker(client, settings, instance_id, build_engine(args, i), options, metrics)
                   for i, instance_id in enumerate(ids)]
        try:
            # A task group: one worker failing cancels the others instead of leaving them
            # serving in a process about to exit.
            async with serving_metrics(metrics.registry, endpoint, "worker"), asyncio.TaskGroup() as group:
                for worker in workers:
                    group.create_task(worker.run(stop), name=f"worker-{worker.instance_id}")
        finally:
            for worker in workers:
                worker.engine.shutdown()
            await client.aclose()

    try:
        return run_service(settings, "worker", main)
    except EngineWillNotStart as exc:
        log.error("engine_will_not_start", error=str(exc))
        # One plain line, last in the log, that `blockq up` reports (blockq/local/up.py).
        sys.stderr.write(f"workers: vLLM {WILL_NOT_START_MARKER} {exc} (the options that change it: "
                         f"--kv-cache-bytes, --max-model-len, --block-size, --gpu-memory-utilization)\n")
        return WILL_NOT_START_EXIT_CODE
    except BaseExceptionGroup as group:
        failures, others = group.split(WorkerFailed)
        if failures is None or others is not None:
            raise
        for failure in failures.exceptions:
            log.error("worker_failed", error=str(failure))
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
