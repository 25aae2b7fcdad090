"""The ``blockq`` command line: one entry point for every component.

Service commands load their packages lazily, so ``blockq`` imports none of them until
asked (the shared core never imports the services at module level).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from blockq.config import ConfigError
from blockq.local.state import ClusterState
from blockq.local.teardown import add_down
from blockq.local.up import add_up, print_json
from blockq.runtime.service_runner import add_common_arguments, settings_from_args

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
        print_json(record)
    elif not args.stream:
        sys.stdout.write(final.text.strip() + "\n")
    return 0 if final.status == "ok" else 1


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="instances, queue depths, pending entries, dead letters")
    add_common_arguments(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    from blockq.local.status import add_cluster_urls, collect_status
    from blockq.wire.streams import connect

    settings = settings_from_args(args)
    client = connect(settings.redis_url)
    try:
        status = collect_status(client, settings)
    finally:
        client.close()
    add_cluster_urls(status, ClusterState.read(settings.state_dir))
    if args.json:
        print_json(status)
        return 0
    out = [f"redis {status['redis_url']}  dispatcher {status['dispatcher_leader']}  dead letters {status['dead_letters']}"]
    out.append(f"{'instance':<16}{'state':<10}{'beat ms':>9}{'run':>6}{'wait':>6}{'queue':>7}{'kv used':>10}{'lag p99':>9}")
    for i in status["instances"]:
        out.append(f"{i['id']:<16}{i['state']:<10}{i['last_heartbeat_age_ms']:>9.0f}{i['running']:>6}{i['waiting']:>6}"
                   f"{i['queue']:>7}{i['kv_used_blocks']:>5}/{i['kv_total_blocks'] or 0:<4}{i['lag_p99_ms']:>9.1f}")
    out.append("streams: " + "  ".join(f"{k}={v}" for k, v in status["streams"].items()))
    out.append("pending: " + "  ".join(f"{k}={v}" for k, v in status["pending"].items()))
    if status["metrics_urls"]:
        out.append("metrics: " + "  ".join(f"{k}={v}" for k, v in status["metrics_urls"].items()))
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def _add_top(sub: argparse._SubParsersAction) -> None:
    from blockq.local import top

    p = sub.add_parser("top", help="live view: instances, KV, queues, recent TTFT, predictor, dispatcher")
    add_common_arguments(p)
    top.add_arguments(p)
    p.set_defaults(handler=top.run)


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
    from predictor_service.serve import add_serve_arguments, run_serve

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

    p = sub.add_parser("bench", help="compare policies on fresh clusters, emulated or vLLM (table, JSON, plots)")
    loadgen_cli.add_bench_arguments(p)
    loadgen_cli.add_engine_arguments(p)
    p.set_defaults(handler=loadgen_cli.run_bench_command)
    from loadgen.simulation import cli as simulation_cli

    p = sub.add_parser("simulate", help="bench in virtual time: the same dispatcher and engine code, "
                                        "deterministic (run | capacity)")
    simulation_cli.add_simulate_arguments(p)
    p.set_defaults(handler=simulation_cli.run_simulate_command)
    from loadgen import demo

    p = sub.add_parser("demo", help="a short live replay, then a simulated comparison at the paper's scale")
    demo.add_demo_arguments(p)
    p.set_defaults(handler=demo.run_demo_command)


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
    from loadgen.benches.emulated_engine import SustainOptions, sustained_instances
    from loadgen.benches.engine_model import bench_engine_model, bench_packed

    model = bench_engine_model()
    sustain = sustained_instances(SustainOptions(
        instance_counts=tuple(int(x) for x in args.instances.split(",")), rate_per_instance=args.rate,
        duration_s=args.duration_s, lag_bound_ms=args.lag_bound_ms, cpu=None if args.cpu < 0 else args.cpu))
    report = {**model, **sustain, **bench_packed()}
    if args.json:
        print_json(report)
        return 0
    sys.stdout.write(f"engine model: step {model['step_us_p50']:.1f} us p50, {model['step_us_p99']:.1f} us p99 "
                     f"(48 running + 20 waiting)\n")
    for run in sustain["runs"]:
        sys.stdout.write(f"{run['instances']:>4} instances at {args.rate}/s each: lag p99 {run['lag_p99_ms']} ms, "
                         f"max {run['lag_max_ms']} ms -> {'ok' if run['sustained'] else 'behind'}\n")
    sys.stdout.write(f"instances sustained on one core: {sustain['instances_sustained']}\n")
    return 0


def _add_gateway_and_batch(sub: argparse._SubParsersAction) -> None:
    from blockq.frontdoors.batch.cli import add_batch_commands
    from blockq.frontdoors.gateway import cli as gateway_cli

    p = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway (python -m blockq.frontdoors.gateway)")
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
    p.add_argument("--simulated-candidates", type=int, default=None,
                   help="block/oracle: candidates simulated per decision at most, the shortlist (0: every "
                        "instance; default: the dispatcher's)")
    p.add_argument("--redis", dest="redis_url", default=None,
                   help="measure placements/s through a real dispatcher on this Redis ('embedded' starts one)")
    p.add_argument("--slo-ttft-ms", type=int, default=0,
                   help="--redis: the cluster's TTFT objective, ms (default 0: none, so a pre-filled backlog "
                        "is placed rather than refused for its wait)")
    p.add_argument("--undecided-wait", type=float, default=5.0,
                   help="--redis: end once no request has been decided for this long, s (those left are held)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="--redis: end after this long, s, whatever is left (default: no limit)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_dispatch_bench)


def cmd_dispatch_bench(args: argparse.Namespace) -> int:
    from loadgen.benches.dispatch import bench_decisions
    from loadgen.benches.dispatch_redis import run_placements

    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    results = []
    if args.redis_url:
        results = _placements_on_redis(args, policies, run_placements)
    else:
        for policy in policies:
            results.append(bench_decisions(policy=policy, instances=args.instances, running=args.running,
                                           waiting=args.waiting, requests=args.requests, rate_per_s=args.rate,
                                           seed=args.seed, objective=args.objective,
                                           **_shortlist(args)))
    if args.json:
        print_json(results[0] if len(results) == 1 else results)
        return 0
    for result in results:
        if "placements_per_s" in result:
            sys.stdout.write(f"{result['policy']:<16} {result['placements_per_s']:>10.0f} placements/s "
                             f"({result['requests']} requests: {result['placed']} placed, {result['refused']} "
                             f"refused, {result['rejected']} rejected, {result['held']} held, {result['unread']} "
                             f"unread; {result['instances']} instances, {result['beats_per_s']:.0f} beats/s; "
                             f"ended: {result['ended_by']})\n")
        else:
            sys.stdout.write(f"{result['policy']:<16} p50 {result['p50_ms']:.3f} ms  p99 {result['p99_ms']:.3f} ms  "
                             f"max {result['max_ms']:.3f} ms  {result['decisions_per_s']:.0f} decisions/s\n")
    return 0


def _shortlist(args: argparse.Namespace) -> dict[str, int]:
    """``--simulated-candidates`` as the benches' keyword, when given (else their default)."""
    return {} if args.simulated_candidates is None else {"simulated_candidates": args.simulated_candidates}


def _placements_on_redis(args: argparse.Namespace, policies: list[str], run_placements: Any) -> list[dict[str, Any]]:
    import tempfile

    from blockq.local.embedded_redis import start_embedded_redis

    def run_all(redis_url: str) -> list[dict[str, Any]]:
        return [run_placements(redis_url, policy=p, instances=args.instances, running=args.running,
                               waiting=args.waiting, requests=args.requests, seed=args.seed,
                               slo_ttft_ms=args.slo_ttft_ms, undecided_wait_s=args.undecided_wait,
                               max_seconds=args.max_seconds, **_shortlist(args))
                for p in policies]

    if args.redis_url != "embedded":
        return run_all(args.redis_url)
    with tempfile.TemporaryDirectory(prefix="blockq-dispatch-bench-") as tmp:
        server = start_embedded_redis(Path(tmp))
        try:
            return run_all(server.url)
        finally:
            server.stop()


def _add_engine_checks(sub: argparse._SubParsersAction) -> None:
    from loadgen.fidelity import cli as fidelity_cli
    from loadgen.fidelity import profile

    p = sub.add_parser("profile", help="measure one real engine's step latency and fit the engine model's "
                                       "latency model (--out PROFILE.json)")
    profile.add_profile_arguments(p)
    p.set_defaults(handler=profile.run_profile_command)
    p = sub.add_parser("fidelity", help="replay a trace on one real engine and through the engine model; "
                                        "score every forecast")
    fidelity_cli.add_fidelity_arguments(p)
    p.set_defaults(handler=fidelity_cli.run_fidelity_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockq", description="predictive dispatcher for LLM engine fleets")
    sub = parser.add_subparsers(dest="command", required=True)
    add_up(sub)
    add_down(sub)
    _add_submit(sub)
    _add_status(sub)
    _add_top(sub)
    _add_services(sub)
    _add_bench(sub)
    _add_bench_engine(sub)
    _add_dispatch_bench(sub)
    _add_gateway_and_batch(sub)
    _add_engine_checks(sub)
    from blockq.local import tiny_model

    tiny_model.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from blockq.runtime.logs import configure_logging

    # Logs go to stderr as JSON lines, so that --json output on stdout stays parseable.
    configure_logging(os.environ.get("BLOCKQ_LOG_LEVEL", "warning").lower())
    try:
        return int(args.handler(args) or 0)
    except ConfigError as exc:
        sys.stderr.write(f"blockq: configuration error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
