"""``python -m dispatcher`` / ``blockq dispatcher``: the placement service."""

from __future__ import annotations

import argparse
import asyncio

from blockq.config import LIVE_SCALERS, AutoscaleOptions, add_scaling_options
from blockq.engine_model.measured_profile import load_profile
from blockq.forecast_check import add_forecast_check_arguments, forecast_check_options_from_args
from blockq.runtime.metrics_server import (
    add_metrics_arguments,
    metrics_endpoint_from_args,
    serving_metrics,
)
from blockq.runtime.service_runner import add_common_arguments, run_service, settings_from_args
from blockq.wire.streams import connect_async, default_consumer_name
from dispatcher.policies import POLICIES
from dispatcher.policies.shortlist import DEFAULT_SIMULATED_CANDIDATES
from dispatcher.service import DispatcherOptions, create_dispatcher, prepare_for_decisions
from dispatcher.what_if import DEFAULT_OBJECTIVE, OBJECTIVES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--policy", default="round_robin", choices=sorted(POLICIES))
    parser.add_argument("--objective", default=DEFAULT_OBJECTIVE, choices=OBJECTIVES,
                        help="what block/power_of_two/oracle minimise (model-time seconds)")
    parser.add_argument("--seed", type=int, default=None, help="seed for randomised policies and tie breaks")
    parser.add_argument("--consumer-name", "--dispatcher-id", dest="consumer_name", default=None,
                        help="consumer name in the dispatch group; keep it across restarts so that a restarted "
                             "dispatcher resumes its predecessor's pending entries at once "
                             "(default: env BLOCKQ_CONSUMER_NAME, else dispatch-HOSTNAME)")
    parser.add_argument("--batch-size", type=int, default=128, help="max ready entries per read")
    parser.add_argument("--simulated-candidates", type=int, default=DEFAULT_SIMULATED_CANDIDATES,
                        help="block/oracle: candidates simulated per decision at most, the shortlist "
                             "(0: every live instance; default: 16 on fleets of up to 128 instances, 8 "
                             "on larger ones; docs/dispatcher.md)")
    parser.add_argument("--profile", default=None,
                        help="a measured engine profile (blockq profile --out): the latency model of "
                             "instances that publish none")
    parser.add_argument("--dead-after-s", type=float, default=5.0,
                        help="seconds without a heartbeat before an instance is dead and its queue re-placed")
    add_forecast_check_arguments(parser.add_argument_group("forecast check (docs/dispatcher.md)"))
    # One server for the dispatcher's metrics and, with --autoscale, the autoscaler's.
    add_metrics_arguments(parser)
    add_autoscale_arguments(parser)


def add_autoscale_arguments(parser: argparse.ArgumentParser) -> None:
    """The leader's autoscaling options (:class:`blockq.config.AutoscaleOptions`)."""
    group = parser.add_argument_group("autoscaling (off unless --autoscale)")
    defaults = AutoscaleOptions()
    group.add_argument("--autoscale", choices=LIVE_SCALERS, default=None,
                       help="size the fleet with this scaler; decisions go to Redis (autoscaler:desired, "
                            "autoscaler:drain, autoscaler:decisions) for the actuators")
    add_scaling_options(group)
    group.add_argument("--scale-command", default=None,
                       help="shell command run in the background when the target changes, {n} = the target "
                            "size, e.g. 'kubectl scale statefulset/blockq-worker --replicas={n}'")
    group.add_argument("--scale-command-timeout-s", type=float, default=defaults.scale_command_timeout_s,
                       help="seconds before a scale command is killed")


def autoscale_options(args: argparse.Namespace) -> AutoscaleOptions | None:
    """The validated options (ConfigError naming the field), None without --autoscale."""
    if args.autoscale is None:
        return None
    return AutoscaleOptions(
        scaler=args.autoscale, min_instances=args.min_instances, max_instances=args.max_instances,
        max_step_fraction=args.max_step_fraction, cooldown_s=args.cooldown_s, reversal_hold_s=args.reversal_hold_s,
        startup_s=args.startup_s, cycle_s=args.cycle_s, scale_command=args.scale_command,
        scale_command_timeout_s=args.scale_command_timeout_s)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    autoscale = autoscale_options(args)  # validated before anything starts
    prior = load_profile(args.profile).latency_model if args.profile else None
    forecast_check = forecast_check_options_from_args(args)  # validated before anything starts
    metrics = metrics_endpoint_from_args(args)

    async def main(stop: asyncio.Event) -> None:
        client = connect_async(settings.redis_url)
        dispatcher = create_dispatcher(
            client, settings, args.policy, seed=args.seed, objective=args.objective,
            dispatcher_id=args.consumer_name or default_consumer_name("dispatch"),
            options=DispatcherOptions(batch_size=args.batch_size, dead_after_s=args.dead_after_s,
                                      num_simulated_candidates=args.simulated_candidates),
            autoscale=autoscale, prior_latency_model=prior, forecast_check=forecast_check)
        prepare_for_decisions(dispatcher.core, autoscales=autoscale is not None)
        try:
            async with serving_metrics(dispatcher.metrics.registry, metrics, "dispatcher"):
                await dispatcher.run(stop)
        finally:
            await client.aclose()

    return run_service(settings, "dispatcher", main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dispatcher", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
