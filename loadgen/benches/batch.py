"""Batch throughput: write an N-line input (alternating completions and chat, short
outputs), submit it, wait for it and report lines per second from the job's start to its
end (rq's ``started_at`` / ``ended_at``). Needs a running batch worker.

    python -m loadgen.benches.batch --lines 1000 --max-tokens 4 [--concurrency 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from blockq.frontdoors.batch.jobs import (
    batch_status,
    default_errors_path,
    fetch_batch_job,
    rq_connection,
    submit_batch,
)
from blockq.frontdoors.batch.runner import BatchOptions
from blockq.runtime.service_runner import add_common_arguments, settings_from_args


def write_bench_input(path: Path, num_lines: int, max_tokens: int) -> None:
    with path.open("w") as file:
        for i in range(num_lines):
            if i % 2:
                url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"question {i}"}]}
            else:
                url, body = "/v1/completions", {"prompt": f"prompt number {i}"}
            body.update(model="blockq", max_tokens=max_tokens)
            file.write(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": url, "body": body}) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadgen.benches.batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--dir", type=Path, default=Path("."),
                        help="where the input and results files are written: under the batch worker's input "
                             "and output roots (default: the current directory, the worker's default root)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    settings = settings_from_args(args)
    connection = rq_connection(settings)
    with tempfile.TemporaryDirectory(prefix="blockq-batch-bench-", dir=args.dir.resolve()) as tmp:
        input_path, output_path = Path(tmp) / "input.jsonl", Path(tmp) / "results.jsonl"
        write_bench_input(input_path, args.lines, args.max_tokens)
        options = BatchOptions(input_path=str(input_path), output_path=str(output_path),
                               errors_path=str(default_errors_path(output_path)), concurrency=args.concurrency)
        submitted_s = time.monotonic()
        job = submit_batch(connection, settings, options)
        deadline_s = submitted_s + args.timeout_s
        while (status := batch_status(connection, settings, job.id))["status"] not in ("finished", "failed"):
            if time.monotonic() > deadline_s:
                raise SystemExit(f"batch job {job.id} not finished within {args.timeout_s:.0f} s: {status}")
            time.sleep(0.05)
        wall_s = time.monotonic() - submitted_s
        job = fetch_batch_job(connection, settings, job.id)
        run_s = (job.ended_at - job.started_at).total_seconds() if job.ended_at and job.started_at else wall_s
        num_results = sum(1 for _ in output_path.open()) if output_path.exists() else 0
    report = {"job_id": job.id, "status": status["status"], "lines": args.lines, "results": num_results,
              "failed": status["failed"], "run_s": round(run_s, 3), "submit_to_done_s": round(wall_s, 3),
              "lines_per_s": round(args.lines / run_s, 1)}
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(f"{report['results']} results of {args.lines} lines in {report['run_s']} s "
                         f"({report['lines_per_s']} lines/s; {report['submit_to_done_s']} s from submit)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
