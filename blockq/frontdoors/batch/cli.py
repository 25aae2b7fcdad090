"""``blockq batch submit|worker|status|cancel`` (also ``python -m blockq.frontdoors.batch ...``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from blockq.config import Settings
from blockq.frontdoors.batch.keys import use_rq_key_prefix
from blockq.runtime.service_runner import add_common_arguments, settings_from_args

if TYPE_CHECKING:
    from blockq.frontdoors.batch.files import BatchFilesConfig


def _print(data: dict[str, Any], as_json: bool, text: str) -> None:
    sys.stdout.write((json.dumps(data, indent=2, sort_keys=True) if as_json else text) + "\n")


def _add_files_arguments(p: argparse.ArgumentParser, whose: str) -> None:
    p.add_argument("--input-root", type=Path, default=None,
                   help=f"{whose} inputs and chat templates must lie under this directory "
                        "(BLOCKQ_BATCH_INPUT_ROOT; default: the current directory)")
    p.add_argument("--output-root", type=Path, default=None,
                   help=f"{whose} results and errors files must lie under this directory "
                        "(BLOCKQ_BATCH_OUTPUT_ROOT; default: the input root)")
    p.add_argument("--max-line-bytes", type=int, default=None,
                   help="longest input line, bytes; a longer one is an error line "
                        "(BLOCKQ_BATCH_MAX_LINE_BYTES; default 4 MiB)")
    p.add_argument("--max-lines", type=int, default=None,
                   help="most lines in an input file; a longer file fails (BLOCKQ_BATCH_MAX_LINES; default 50000)")


def _files_config(args: argparse.Namespace) -> BatchFilesConfig:
    """The roots and limits from the flags over ``BLOCKQ_BATCH_*``; ConfigError naming the field."""
    from blockq.frontdoors.batch.files import BatchFilesConfig

    return BatchFilesConfig.from_env(input_root=args.input_root, output_root=args.output_root,
                                     max_line_bytes=args.max_line_bytes, max_lines=args.max_lines)


def _add_submit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="enqueue a batch job (OpenAI batch input format, one request a line)")
    add_common_arguments(p)
    p.add_argument("input", type=Path, help="JSONL file: custom_id, method, url, body per line")
    p.add_argument("--out", type=Path, required=True, help="results file (JSONL, input order), written atomically")
    p.add_argument("--errors", type=Path, default=None, help="errors file (default RESULTS.errors.jsonl)")
    p.add_argument("--priority", default="batch", choices=["interactive", "batch"])
    p.add_argument("--max-rate", type=float, default=None, help="at most this many requests per second")
    p.add_argument("--concurrency", type=int, default=256, help="requests in flight at most (default 256)")
    p.add_argument("--tenant", default="default")
    p.add_argument("--request-timeout-s", type=float, default=3600.0, help="per-line timeout, seconds")
    p.add_argument("--chat-template", default="chatml", help="'chatml', 'plain' or a Jinja2 file")
    p.add_argument("--json", action="store_true", help="print job_id, status, total and the paths as JSON")
    _add_files_arguments(p, "(as the workers are configured) ")
    p.set_defaults(handler=cmd_submit)


def _settings(args: argparse.Namespace) -> Settings:
    """The command's settings; rq's key namespace chosen for them before rq is imported."""
    settings = settings_from_args(args)
    use_rq_key_prefix(settings)
    return settings


def cmd_submit(args: argparse.Namespace) -> int:
    settings = _settings(args)
    from blockq.frontdoors.batch.jobs import default_errors_path, rq_connection, submit_batch
    from blockq.frontdoors.batch.runner import BatchOptions
    from blockq.frontdoors.gateway.chat_template import BUILTIN_TEMPLATES

    files = _files_config(args)
    output_path = args.out.resolve()
    # A template file is read by the worker, in its own directory: hand it an absolute path.
    chat_template = args.chat_template if args.chat_template in BUILTIN_TEMPLATES else str(
        Path(args.chat_template).resolve())
    options = BatchOptions(
        input_path=str(args.input.resolve()), output_path=str(output_path),
        errors_path=str((args.errors or default_errors_path(output_path)).resolve()), priority=args.priority,
        tenant=args.tenant, max_rate_per_s=args.max_rate, concurrency=args.concurrency,
        request_timeout_s=args.request_timeout_s, chat_template=chat_template)
    connection = rq_connection(settings)
    try:
        job = submit_batch(connection, settings, options, files)
        report = {"job_id": job.id, "status": str(job.get_status(refresh=False).value), "total": job.meta["total"],
                  "input": options.input_path, "output": options.output_path, "errors": options.errors_path}
    finally:
        connection.close()
    _print(report, args.json, f"submitted batch job {job.id} ({report['total']} lines)")
    return 0


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="a batch job's status and progress (done / failed / total)")
    add_common_arguments(p)
    p.add_argument("job_id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_status)


def _with_job(args: argparse.Namespace, action: Any) -> int:
    settings = _settings(args)
    from blockq.frontdoors.batch.jobs import BatchJobNotFound, rq_connection

    connection = rq_connection(settings)
    try:
        report = action(connection, settings)
    except BatchJobNotFound as exc:
        sys.stderr.write(f"blockq batch: {exc}\n")
        return 1
    finally:
        connection.close()
    text = (f"{report['job_id']}: {report['status']}{' (canceled)' if report['canceled'] else ''}, "
            f"{report['done']} done, {report['failed']} failed of {report['total']}")
    _print(report, args.json, text)
    return 0


def _jobs() -> ModuleType:
    """:mod:`blockq.frontdoors.batch.jobs`, imported (and rq with it) once rq's key namespace is set."""
    from blockq.frontdoors.batch import jobs

    return jobs


def cmd_status(args: argparse.Namespace) -> int:
    return _with_job(args, lambda connection, settings: _jobs().batch_status(connection, settings, args.job_id))


def _add_cancel(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cancel", help="cancel a batch job (a running one writes what it finished)")
    add_common_arguments(p)
    p.add_argument("job_id")
    p.add_argument("--wait-s", type=float, default=30.0, help="wait this long for a running job to stop")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_cancel)


def cmd_cancel(args: argparse.Namespace) -> int:
    return _with_job(args, lambda connection, settings: _jobs().cancel_batch(connection, settings, args.job_id,
                                                                             args.wait_s))


def _add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run a batch worker (rq) on this cluster's batch queue")
    add_common_arguments(p)
    p.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    p.add_argument("--name", default=None, help="worker name (default: rq's random one)")
    _add_files_arguments(p, "")
    p.set_defaults(handler=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    settings = _settings(args)
    files = _files_config(args)  # validated before the worker takes any job
    from blockq.frontdoors.batch.worker import run_worker
    from blockq.runtime.logs import configure_logging

    configure_logging(settings.log_level, "batch-worker")
    return run_worker(settings, files, burst=args.burst, name=args.name)


def _add_commands(sub: argparse._SubParsersAction) -> None:
    _add_submit(sub)
    _add_worker(sub)
    _add_status(sub)
    _add_cancel(sub)


def add_batch_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``batch`` with its subcommands to the ``blockq`` parser."""
    batch = sub.add_parser("batch", help="offline batch jobs (OpenAI batch file format, run by rq workers)")
    _add_commands(batch.add_subparsers(dest="batch_command", required=True))


def main(argv: list[str] | None = None) -> int:
    from blockq.config import ConfigError

    parser = argparse.ArgumentParser(prog="python -m blockq.frontdoors.batch", description="blockq batch jobs")
    _add_commands(parser.add_subparsers(dest="batch_command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except ConfigError as exc:
        sys.stderr.write(f"blockq batch: configuration error: {exc}\n")
        return 2
