"""``python -m dispatcher`` / ``blockq dispatcher``: the placement service."""

from __future__ import annotations

import argparse
import asyncio

from blockq.service import add_common_arguments, run_service, settings_from_args
from blockq.streams import connect_async, default_consumer_name
from dispatcher.forecast import DEFAULT_OBJECTIVE, OBJECTIVES
from dispatcher.policies import POLICIES
from dispatcher.service import DispatcherOptions, create_dispatcher, prepare_for_decisions


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
    parser.add_argument("--dead-after-s", type=float, default=5.0,
                        help="seconds without a heartbeat before an instance is dead and its queue re-placed")


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)

    async def main(stop: asyncio.Event) -> None:
        client = connect_async(settings.redis_url)
        dispatcher = create_dispatcher(
            client, settings, args.policy, seed=args.seed, objective=args.objective,
            dispatcher_id=args.consumer_name or default_consumer_name("dispatch"),
            options=DispatcherOptions(batch_size=args.batch_size, dead_after_s=args.dead_after_s))
        prepare_for_decisions(dispatcher.core)
        try:
            await dispatcher.run(stop)
        finally:
            await client.aclose()

    return run_service(settings, "dispatcher", main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dispatcher", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
