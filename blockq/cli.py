"""The ``blockq`` command line: one entry point for every component.

Service commands load their packages lazily, so ``blockq`` imports none of them until
asked (the shared core never imports the services at module level).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from blockq.cluster_config import ClusterConfig
from blockq.config import ConfigError
from blockq.service import add_common_arguments, settings_from_args
from blockq.state import ClusterState


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


# --- up / down ------------------------------------------------------------------------------


# `blockq up`'s vLLM options: each sets the cluster config's field vllm_<name>.
VLLM_UP_OPTIONS = (
    ("--block-size", int, "vLLM KV block size in tokens (CPU: a multiple of 32)"),
    ("--kv-cache-bytes", int, "vLLM KV cache size per instance, in bytes"),
    ("--gpu-memory-utilization", float, "fraction of GPU (CPU: node) memory each vLLM instance may use"),
    ("--max-model-len", int, "vLLM max_model_len"),
    ("--max-num-seqs", int, "vLLM max_num_seqs"),
)


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a local cluster (embedded Redis unless --redis)")
    add_common_arguments(p)
    p.add_argument("--config", type=Path, default=None, help="cluster TOML file ([cluster] table)")
    p.add_argument("--instances", type=int, default=None, help="number of engine instances (default 2)")
    p.add_argument("--instances-per-process", type=int, default=None, help="instances per worker process (default 6)")
    p.add_argument("--policy", default=None, help="placement policy (default round_robin)")
    p.add_argument("--objective", default=None, help="objective of the block policy: e2e | ttft | max_latency")
    p.add_argument("--preset", default=None, help="engine preset (default llama2-7b-a30)")
    p.add_argument("--time-scale", type=float, default=None, help="wall seconds per model second (default 1)")
    p.add_argument("--engine", choices=["emulated", "vllm"], default=None,
                   help="engine of every instance (default emulated)")
    p.add_argument("--model", default=None, help="model path or name (required with --engine vllm)")
    for option, kind, text in VLLM_UP_OPTIONS:
        p.add_argument(option, dest="vllm_" + option[2:].replace("-", "_"), type=kind, default=None, help=text)
    p.add_argument("--enforce-eager", dest="vllm_enforce_eager", action="store_true", default=None,
                   help="vLLM without graph capture or compilation (a fast start-up)")
    p.add_argument("--predictor", dest="predictor_backend", default=None, help="predictor backend (default heuristic)")
    p.add_argument("--predictor-model", default=None, help="trained predictor directory")
    p.add_argument("--gateway", action="store_true", default=None, help="also start the HTTP gateway")
    p.add_argument("--gateway-port", type=int, default=None)
    p.add_argument("--batch-worker", action="store_true", default=None, help="also start the batch (rq) worker")
    p.add_argument("--redis-maxmemory", default=None,
                   help="memory limit of the embedded Redis, e.g. 1gb (default), 512mb; writes fail when full")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--detach", action="store_true", help="return once the cluster is ready")
    p.add_argument("--ready-timeout-s", type=float, default=120.0)
    p.add_argument("--json", action="store_true", help="print the ready report as JSON")
    p.set_defaults(handler=cmd_up)


def _cluster_config(args: argparse.Namespace) -> ClusterConfig:
    base = ClusterConfig.from_toml(args.config) if args.config else ClusterConfig()
    return base.with_overrides(
        instances=args.instances, instances_per_process=args.instances_per_process, policy=args.policy,
        objective=args.objective, preset=args.preset, time_scale=args.time_scale,
        predictor_backend=args.predictor_backend, predictor_model=args.predictor_model,
        gateway=args.gateway, gateway_port=args.gateway_port, batch_worker=args.batch_worker, seed=args.seed,
        redis_maxmemory=args.redis_maxmemory, engine=args.engine, model=args.model,
        **{name: value for name, value in vars(args).items() if name.startswith("vllm_")})


def cmd_up(args: argparse.Namespace) -> int:
    from blockq.supervisor import ChildSpec, Supervisor

    settings = settings_from_args(args, require_redis=False)
    config = _cluster_config(args)
    state = ClusterState.read(settings.state_dir)
    if state is not None and state.supervisor_is_alive():
        raise ConfigError(f"state_dir: a cluster is already running from {settings.state_dir} "
                          f"(supervisor pid {state.supervisor_pid}); run `blockq down` first")
    if args.detach:
        return _up_detached(args, settings.state_dir, config, settings.redis_url)
    from blockq.logs import configure_logging

    configure_logging(settings.log_level, "supervisor")
    specs = [ChildSpec(name, argv) for name, argv in config.child_argvs()]
    gateway_url = f"http://{config.gateway_host}:{config.gateway_port}" if config.gateway else None
    return Supervisor(settings.state_dir, specs, redis_url=settings.redis_url, num_instances=config.instances,
                      gateway_url=gateway_url, redis_maxmemory=config.redis_maxmemory).run()


def _argv_without_secrets(argv: list[str]) -> list[str]:
    """``argv`` less --detach, --json and --redis URL (a URL may hold a password, and any
    user can read a process's argv: the URL travels in the environment instead)."""
    out: list[str] = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg == "--redis":
            skip_next = True
        elif arg not in ("--detach", "--json") and not arg.startswith("--redis="):
            out.append(arg)
    return out


def _up_detached(args: argparse.Namespace, state_dir: Path, config: ClusterConfig,
                 redis_url: str | None) -> int:
    """Start the supervisor in the background and wait for every instance to be live."""
    started_s = time.monotonic()
    argv = _argv_without_secrets(sys.argv[1:])
    env = dict(os.environ, BLOCKQ_REDIS_URL=redis_url) if redis_url else dict(os.environ)
    os.umask(0o077)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    (state_dir / "logs").mkdir(exist_ok=True)
    with open(state_dir / "logs" / "supervisor.log", "ab") as log_file:
        subprocess.Popen([sys.executable, "-m", "blockq.cli", *argv], stdout=log_file, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    report = wait_until_ready(args, state_dir, config.instances, args.ready_timeout_s)
    report["ready_s"] = round(time.monotonic() - started_s, 3)
    if args.json:
        _print_json(report)
    else:
        sys.stdout.write(f"blockq is up: {report['num_live_instances']} instances live, redis {report['redis_url']}, "
                         f"ready in {report['ready_s']:.1f} s (state in {state_dir})\n")
    return 0


def wait_until_ready(args: argparse.Namespace, state_dir: Path, num_instances: int, timeout_s: float) -> dict[str, Any]:
    from blockq.status import collect_status
    from blockq.streams import connect

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = ClusterState.read(state_dir)
        if state is not None:
            settings = settings_from_args(args)
            client = connect(state.redis_url)
            try:
                status = collect_status(client, settings)
            finally:
                client.close()
            if status["num_live_instances"] >= num_instances and status["dispatcher_leader"]:
                status["gateway_url"] = state.gateway_url
                return status
        time.sleep(0.1)
    raise SystemExit(f"blockq up: cluster not ready within {timeout_s:.0f} s; see {state_dir / 'logs'}")


def _add_down(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("down", help="stop the local cluster started by `blockq up`")
    add_common_arguments(p)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.set_defaults(handler=cmd_down)


def cmd_down(args: argparse.Namespace) -> int:
    from blockq.supervisor import stop_cluster

    settings = settings_from_args(args, require_redis=False)
    if ClusterState.read(settings.state_dir) is None:
        sys.stdout.write(f"no cluster running from {settings.state_dir}\n")
        return 0
    report = stop_cluster(settings.state_dir, args.timeout_s)
    notes = []
    if report.num_killed:
        notes.append(f"killed {report.num_killed} stuck processes")
    if report.num_unidentified:
        notes.append(f"left {report.num_unidentified} recorded pids alone: they are other processes now")
    sys.stdout.write("blockq is down" + (f" ({'; '.join(notes)})" if notes else "") + "\n")
    return 0


# --- submit / status ------------------------------------------------------------------------


def _add_submit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="submit one request and wait for its result")
    add_common_arguments(p)
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--priority", default="interactive", choices=["interactive", "batch"])
    p.add_argument("--tenant", default="default")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--stream", action="store_true", help="print chunks as they arrive")
    p.add_argument("--json", action="store_true", help="print the final record as JSON")
    p.set_defaults(handler=cmd_submit)


def cmd_submit(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from blockq.client import Client

    settings = settings_from_args(args)
    with Client(settings=settings) as client:
        handle = client.submit(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                               priority=args.priority, tenant=args.tenant)
        if args.stream:
            for chunk in handle.stream(args.timeout_s):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
        final = handle.result(args.timeout_s)
    record = asdict(final)
    record["id"] = record.pop("request_id")
    if args.json:
        _print_json(record)
    elif not args.stream:
        sys.stdout.write(final.text.strip() + "\n")
    return 0 if final.status == "ok" else 1


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="instances, queue depths, pending entries, dead letters")
    add_common_arguments(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    from blockq.status import collect_status
    from blockq.streams import connect

    settings = settings_from_args(args)
    client = connect(settings.redis_url)
    try:
        status = collect_status(client, settings)
    finally:
        client.close()
    state = ClusterState.read(settings.state_dir)
    status["gateway_url"] = state.gateway_url if state else None
    if args.json:
        _print_json(status)
        return 0
    out = [f"redis {status['redis_url']}  dispatcher {status['dispatcher_leader']}  dead letters {status['dead_letters']}"]
    out.append(f"{'instance':<16}{'state':<10}{'beat ms':>9}{'run':>6}{'wait':>6}{'queue':>7}{'kv used':>10}{'lag p99':>9}")
    for i in status["instances"]:
        out.append(f"{i['id']:<16}{i['state']:<10}{i['last_heartbeat_age_ms']:>9.0f}{i['running']:>6}{i['waiting']:>6}"
                   f"{i['queue']:>7}{i['kv_used_blocks']:>5}/{i['kv_total_blocks'] or 0:<4}{i['lag_p99_ms']:>9.1f}")
    out.append("streams: " + "  ".join(f"{k}={v}" for k, v in status["streams"].items()))
    out.append("pending: " + "  ".join(f"{k}={v}" for k, v in status["pending"].items()))
    sys.stdout.write("\n".join(out) + "\n")
    return 0


# --- services -------------------------------------------------------------------------------


def _add_services(sub: argparse._SubParsersAction) -> None:
    from dispatcher import cli as dispatcher_cli
    from workers import cli as workers_cli

    p = sub.add_parser("worker", help="run engine instance workers (python -m workers)")
    workers_cli.add_arguments(p)
    p.set_defaults(handler=workers_cli.run)
    p = sub.add_parser("dispatcher", help="run the dispatcher (python -m dispatcher)")
    dispatcher_cli.add_arguments(p)
    p.set_defaults(handler=dispatcher_cli.run)

    predictor = sub.add_parser("predictor", help="the output-length predictor: serve, train, eval")
    predictor_sub = predictor.add_subparsers(dest="predictor_command", required=True)
    from predictor_service.stage import add_serve_arguments, run_serve

    p = predictor_sub.add_parser("serve", help="the stream stage (python -m predictor_service)")
    add_serve_arguments(p)
    p.set_defaults(handler=run_serve)
    try:
        from predictor_service.cli import add_predictor_commands
    except ImportError:  # training extras missing: serving still works
        return
    add_predictor_commands(predictor_sub)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from loadgen import cli as loadgen_cli

    p = sub.add_parser("bench", help="compare policies on fresh emulated clusters (table, JSON, plots)")
    loadgen_cli.add_bench_arguments(p)
    p.set_defaults(handler=loadgen_cli.run_bench_command)
    from loadgen.simulation import cli as simulation_cli

    p = sub.add_parser("simulate", help="bench in virtual time: the same dispatcher and engine code, "
                                        "deterministic (run | capacity)")
    simulation_cli.add_simulate_arguments(p)
    p.set_defaults(handler=simulation_cli.run_simulate_command)
    p = sub.add_parser("demo", help="a short live replay, then a simulated comparison at the paper's scale")
    loadgen_cli.add_demo_arguments(p)
    p.set_defaults(handler=loadgen_cli.run_demo_command)


def _add_bench_engine(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-engine", help="engine model step cost and emulated instances sustained per core")
    p.add_argument("--instances", default="4,8,12,16", help="instance counts to try (comma-separated)")
    p.add_argument("--rate", type=float, default=2.7, help="requests/s per instance")
    p.add_argument("--duration-s", type=float, default=30.0, help="seconds of load per instance count")
    p.add_argument("--lag-bound-ms", type=float, default=5.0)
    p.add_argument("--cpu", type=int, default=0, help="core to pin the worker to (-1: no pinning)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_bench_engine)


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from blockq.engine_model.bench import bench_engine_model, bench_packed
    from workers.bench import SustainOptions, sustained_instances

    model = bench_engine_model()
    sustain = sustained_instances(SustainOptions(
        instance_counts=tuple(int(x) for x in args.instances.split(",")), rate_per_instance=args.rate,
        duration_s=args.duration_s, lag_bound_ms=args.lag_bound_ms, cpu=None if args.cpu < 0 else args.cpu))
    report = {**model, **sustain, **bench_packed()}
    if args.json:
        _print_json(report)
        return 0
    sys.stdout.write(f"engine model: step {model['step_us_p50']:.1f} us p50, {model['step_us_p99']:.1f} us p99 "
                     f"(48 running + 20 waiting)\n")
    for run in sustain["runs"]:
        sys.stdout.write(f"{run['instances']:>4} instances at {args.rate}/s each: lag p99 {run['lag_p99_ms']} ms, "
                         f"max {run['lag_max_ms']} ms -> {'ok' if run['sustained'] else 'behind'}\n")
    sys.stdout.write(f"instances sustained on one core: {sustain['instances_sustained']}\n")
    return 0


def _add_gateway_and_batch(sub: argparse._SubParsersAction) -> None:
    from blockq.batch.cli import add_batch_commands
    from blockq.gateway import cli as gateway_cli

    p = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway (python -m blockq.gateway)")
    gateway_cli.add_arguments(p)
    p.set_defaults(handler=gateway_cli.run)
    add_batch_commands(sub)


def _add_dispatch_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dispatch-bench", help="placement decision latency (pure) or placements/s (--redis)")
    p.add_argument("--instances", type=int, default=16)
    p.add_argument("--running", type=int, default=48, help="running requests per instance at the start")
    p.add_argument("--waiting", type=int, default=20, help="waiting requests per instance at the start")
    p.add_argument("--requests", type=int, default=10_000, help="decisions to time")
    p.add_argument("--rate", type=float, default=32.0, help="requests/s on the virtual clock (beats every 100 ms)")
    p.add_argument("--policy", default="block", help="a policy name, or a comma-separated list")
    p.add_argument("--objective", default=None, help="block objective (default: the dispatcher's, ttft)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--redis", dest="redis_url", default=None,
                   help="measure placements/s through a real dispatcher on this Redis ('embedded' starts one)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_dispatch_bench)


def cmd_dispatch_bench(args: argparse.Namespace) -> int:
    from dispatcher.bench import bench_decisions, run_placements

    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    results = []
    if args.redis_url:
        results = _placements_on_redis(args, policies, run_placements)
    else:
        for policy in policies:
            results.append(bench_decisions(policy=policy, instances=args.instances, running=args.running,
                                           waiting=args.waiting, requests=args.requests, rate_per_s=args.rate,
                                           seed=args.seed, objective=args.objective))
    if args.json:
        _print_json(results[0] if len(results) == 1 else results)
        return 0
    for result in results:
        if "placements_per_s" in result:
            sys.stdout.write(f"{result['policy']:<16} {result['placements_per_s']:>10.0f} placements/s "
                             f"({result['requests']} requests, {result['instances']} instances)\n")
        else:
            sys.stdout.write(f"{result['policy']:<16} p50 {result['p50_ms']:.3f} ms  p99 {result['p99_ms']:.3f} ms  "
                             f"max {result['max_ms']:.3f} ms  {result['decisions_per_s']:.0f} decisions/s\n")
    return 0


def _placements_on_redis(args: argparse.Namespace, policies: list[str], run_placements: Any) -> list[dict[str, Any]]:
    import tempfile

    from blockq.embedded_redis import start_embedded_redis

    if args.redis_url != "embedded":
        return [run_placements(args.redis_url, policy=p, instances=args.instances, running=args.running,
                               waiting=args.waiting, requests=args.requests, seed=args.seed) for p in policies]
    with tempfile.TemporaryDirectory(prefix="blockq-dispatch-bench-") as tmp:
        server = start_embedded_redis(Path(tmp))
        try:
            return [run_placements(server.url, policy=p, instances=args.instances, running=args.running,
                                   waiting=args.waiting, requests=args.requests, seed=args.seed) for p in policies]
        finally:
            server.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockq", description="predictive dispatcher for LLM engine fleets")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_up(sub)
    _add_down(sub)
    _add_submit(sub)
    _add_status(sub)
    _add_services(sub)
    _add_bench(sub)
    _add_bench_engine(sub)
    _add_dispatch_bench(sub)
    _add_gateway_and_batch(sub)
    from blockq import tiny_model

    tiny_model.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from blockq.logs import configure_logging

    # Logs go to stderr as JSON lines, so that --json output on stdout stays parseable.
    configure_logging(os.environ.get("BLOCKQ_LOG_LEVEL", "warning").lower())
    try:
        return int(args.handler(args) or 0)
    except ConfigError as exc:
        sys.stderr.write(f"blockq: configuration error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
