"""The `roberta` backend with a tiny fresh RobertaConfig (no pretrained weights)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from blockq.tokenizer import get_token_counter  # noqa: E402
from predictor_service.dataset import load_split  # noqa: E402
from predictor_service.manifest import Manifest, write_manifest  # noqa: E402
from predictor_service.models import PredictionInput, load_predictor  # noqa: E402
from predictor_service.models.roberta import (  # noqa: E402
    RobertaTrainConfig,
    build_word_tokenizer,
    create_fresh_roberta,
    train_roberta,
)
from predictor_service.synthetic import make_synthetic_sharegpt  # noqa: E402

TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 130,
}


def test_tiny_roberta_trains_and_loss_falls(tmp_path: Path) -> None:
    import torch

    torch.set_num_threads(1)
    data = make_synthetic_sharegpt(tmp_path / "train.json", 300)
    split = load_split(data, get_token_counter(), val_fraction=0.2)
    prompts = [example.prompt for example in split.train]
    base_dir = create_fresh_roberta(tmp_path / "base", build_word_tokenizer(prompts), **TINY)
    config = RobertaTrainConfig(
        epochs=20, batch_size=16, learning_rate=3e-3, max_length=128, max_steps=80, device="cpu"
    )
    model, losses = train_roberta(
        prompts,
        [example.output_tokens for example in split.train],
        [example.prompt for example in split.val],
        [example.output_tokens for example in split.val],
        base_dir,
        config,
        seed=0,
    )
    assert len(losses) == 80
    assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:10])
    assert model.version.startswith("roberta-")
    assert model.residual_log_p10 < 0 < model.residual_log_p90

    short = PredictionInput("Explain coffee in one sentence.", 8, max_tokens=10_000)
    long = PredictionInput("Write a detailed essay about chess, covering its history.", 12, 10_000)
    capped = PredictionInput("Write a detailed essay about chess, covering its history.", 12, 9)
    p_short, p_long, p_capped = model.predict([short, long, capped])
    assert p_short.predicted_output_tokens < p_long.predicted_output_tokens
    assert p_capped.p90_tokens <= 9

    out_dir = tmp_path / "model"
    model.save(out_dir)
    write_manifest(
        out_dir,
        Manifest(
            backend="roberta",
            version=model.version,
            tokenizer_name="test",
            data_sha256="0" * 64,
            training_max_tokens=model.training_max_tokens,
            baseline_median_tokens=100.0,
            num_train_examples=len(prompts),
            num_val_examples=len(split.val),
            seed=0,
            created_at_s=0.0,
            extra=model.manifest_extra(),
        ),  # fmt: skip
    )
    loaded = load_predictor("roberta", str(out_dir))
    assert loaded.version == model.version
    assert loaded.predict([short, long]) == [p_short, p_long]


def test_train_and_evaluate_roberta_through_the_training_api(tmp_path: Path) -> None:
    import torch

    from predictor_service.training import evaluate, train

    torch.set_num_threads(1)
    data = make_synthetic_sharegpt(tmp_path / "train.json.gz", 120)
    prompts = [f"{kind} ideas words sentence essay" for kind in ("list", "write", "explain")]
    base_dir = create_fresh_roberta(tmp_path / "base", build_word_tokenizer(prompts), **TINY)
    manifest = train(
        data,
        "roberta",
        tmp_path / "model",
        base_model_dir=base_dir,
        roberta_config=RobertaTrainConfig(max_steps=4, batch_size=8, max_length=64, device="cpu"),
    )
    assert manifest.backend == "roberta" and manifest.extra["num_steps"] == 4
    assert manifest.extra["target_transform"].startswith("z = (ln(output_tokens)")
    result = evaluate(tmp_path / "model", data)
    assert result["split"] == "val" and result["count"] == manifest.num_val_examples
    assert result["version"] == manifest.version
