"""The `transformer` backend (a tiny fresh encoder: no pretrained weights needed) and the
`ensemble` that `train --backend auto` writes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from blockq.text.tokenizer import get_token_counter  # noqa: E402
from predictor_service.dataset import load_split  # noqa: E402
from predictor_service.manifest import read_manifest  # noqa: E402
from predictor_service.models import PredictionInput, load_predictor  # noqa: E402
from predictor_service.models.ensemble import choose_weight  # noqa: E402
from predictor_service.models.transformer import (  # noqa: E402
    HeadTailEncoder,
    TransformerTrainConfig,
    train_transformer,
)
from tests.predictor_helpers import build_word_tokenizer, create_fresh_encoder  # noqa: E402
from tests.predictor_synthetic import make_synthetic_sharegpt  # noqa: E402

TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}


def test_a_long_prompt_keeps_its_first_and_last_word_pieces() -> None:
    tokenizer = build_word_tokenizer(["a b c d e f g h i j"])
    encoder = HeadTailEncoder(tokenizer, head_tokens=2, tail_tokens=3)
    (ids,) = encoder.token_ids(["a b c d e f g h i j"])
    words = tokenizer.convert_ids_to_tokens(ids)
    assert words == ["<s>", "a", "b", "h", "i", "j", "</s>"]
    (short,) = encoder.token_ids(["a b"])
    assert tokenizer.convert_ids_to_tokens(short) == ["<s>", "a", "b", "</s>"]


def test_tiny_transformer_learns_quantiles_and_round_trips(tmp_path: Path) -> None:
    import torch

    from predictor_service.training import evaluate, train

    torch.set_num_threads(1)
    data = make_synthetic_sharegpt(tmp_path / "train.json", 300)
    split = load_split(data, get_token_counter(), val_fraction=0.2)
    prompts = [example.prompt for example in split.train]
    base_dir = create_fresh_encoder(tmp_path / "base", build_word_tokenizer(prompts), **TINY)
    config = TransformerTrainConfig(epochs=20, batch_size=16, learning_rate=3e-3, max_steps=80, device="cpu")
    model, losses = train_transformer(prompts, [e.output_tokens for e in split.train], base_dir, config)
    assert len(losses) == 80
    assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:10])
    short = PredictionInput("Explain coffee in one sentence.", 8, max_tokens=10_000)
    long = PredictionInput("Write a detailed essay about chess, covering its history.", 12, 10_000)
    capped = PredictionInput("Write a detailed essay about chess, covering its history.", 12, 9)
    p_short, p_long, p_capped = model.predict([short, long, capped])
    assert p_short.predicted_output_tokens < p_long.predicted_output_tokens
    assert p_long.p10_tokens < p_long.predicted_output_tokens < p_long.p90_tokens  # the heads spread
    assert p_capped.p90_tokens <= 9

    manifest = train(data, "transformer", tmp_path / "model", base_model=base_dir,
                     transformer_config=TransformerTrainConfig(max_steps=4, batch_size=8, device="cpu"))
    assert manifest.backend == "transformer" and manifest.extra["num_steps"] == 4
    loaded = load_predictor("transformer", str(tmp_path / "model"))
    assert loaded.version == manifest.version
    # The loaded model predicts what the trained one did: its validation MAE is the manifest's.
    assert evaluate(tmp_path / "model", data)["mae"] == pytest.approx(manifest.metrics["mae"])


def test_auto_trains_both_members_and_blends_them_with_the_best_validation_weight(tmp_path: Path) -> None:
    import torch

    from predictor_service.models.fast import FastConfig
    from predictor_service.training import evaluate, train

    torch.set_num_threads(1)
    data = make_synthetic_sharegpt(tmp_path / "train.json.gz", 200)
    words = [f"{kind} ideas words sentence essay" for kind in ("list", "write", "explain")]
    base_dir = create_fresh_encoder(tmp_path / "base", build_word_tokenizer(words), **TINY)
    manifest = train(data, "auto", tmp_path / "auto", base_model=base_dir,
                     fast_config=FastConfig(num_rounds=20, num_threads=1),
                     transformer_config=TransformerTrainConfig(max_steps=4, batch_size=8, device="cpu"))
    assert manifest.backend == "ensemble"
    weights = manifest.extra["members"]
    assert set(weights) == {"fast", "transformer"} and abs(sum(weights.values()) - 1) < 1e-9
    errors = manifest.extra["val_mae_by_transformer_weight"]
    assert errors[str(weights["transformer"])] == min(errors.values())
    for member in ("fast", "transformer"):
        assert read_manifest(tmp_path / "auto" / member).backend == member
    result = evaluate(tmp_path / "auto", data)
    assert result["backend"] == "ensemble" and result["count"] == manifest.num_val_examples
    assert result["mae"] == pytest.approx(manifest.metrics["mae"])
    assert result["predictions_per_s"] > 0


def test_choose_weight_picks_the_member_closer_to_the_truth() -> None:
    from predictor_service.models.base import LengthPrediction

    truth = np.array([100.0, 200.0, 400.0])
    good = [LengthPrediction(int(t), int(t) // 2, int(t) * 2) for t in truth]
    bad = [LengthPrediction(50, 25, 100)] * 3
    assert choose_weight(bad, good, truth)[0] == 1.0
    assert choose_weight(good, bad, truth)[0] == 0.0
