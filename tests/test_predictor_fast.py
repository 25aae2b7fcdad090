"""The `fast` backend on a synthetic dataset whose lengths follow the prompt text."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from blockq.prediction_accuracy import compute_metrics
from blockq.text.tokenizer import get_token_counter
from predictor_service.dataset import load_split, output_tokens_array
from predictor_service.manifest import Manifest
from predictor_service.models import FeedbackSample, PredictionInput, load_predictor
from predictor_service.models.fast import FastConfig, FastLengthModel
from predictor_service.models.fast_fit import refit_fast, save_fast_model, train_fast
from predictor_service.text_score import TextScoreConfig, fit_text_score
from tests.predictor_synthetic import make_synthetic_sharegpt

SMALL_CONFIG = FastConfig(num_rounds=80, learning_rate=0.1, min_data_in_leaf=5, num_threads=1)


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path = make_synthetic_sharegpt(tmp_path_factory.mktemp("data") / "synthetic.json.gz", 500)
    return load_split(path, get_token_counter(), val_fraction=0.2)


@pytest.fixture(scope="module")
def model(split) -> FastLengthModel:  # type: ignore[no-untyped-def]
    train = split.train
    return train_fast(
        [e.prompt for e in train],
        [e.prompt_tokens for e in train],
        [e.num_turns for e in train],
        [e.output_tokens for e in train],
        SMALL_CONFIG,
    )


def test_fast_beats_the_constant_median(split, model: FastLengthModel) -> None:  # type: ignore[no-untyped-def]
    predictions = model.predict([example.to_input() for example in split.val])
    truth = output_tokens_array(split.val)
    predicted = [p.predicted_output_tokens for p in predictions]
    baseline = np.full(len(truth), np.median(output_tokens_array(split.train)))
    model_metrics = compute_metrics(predicted, truth)
    baseline_metrics = compute_metrics(baseline, truth)
    assert model_metrics["mae"] < 0.5 * baseline_metrics["mae"]
    assert model_metrics["kendall_tau"] > 0.6
    assert all(p.p10_tokens <= p.predicted_output_tokens <= p.p90_tokens for p in predictions)


def test_explicit_length_requests_move_the_prediction(model: FastLengthModel) -> None:
    def p50(prompt: str) -> int:
        one = PredictionInput(prompt=prompt, prompt_tokens=15, max_tokens=10_000)
        return model.predict([one])[0].predicted_output_tokens

    assert p50("Explain coffee in one sentence.") < p50(
        "Write a short text about coffee in 250 words."
    )
    assert p50("List 3 ideas related to chess.") < p50("List 20 ideas related to chess.")


def test_predictions_are_clipped_to_max_tokens(model: FastLengthModel) -> None:
    prompt = "Write a detailed essay about the moon, covering its history and future."
    (prediction,) = model.predict([PredictionInput(prompt=prompt, prompt_tokens=16, max_tokens=7)])
    assert prediction.predicted_output_tokens <= 7 and prediction.p90_tokens <= 7
    assert prediction.p10_tokens >= 1


def test_save_and_load_round_trip(tmp_path: Path, split, model: FastLengthModel) -> None:  # type: ignore[no-untyped-def]
    manifest = Manifest(
        backend="fast", version="", tokenizer_name="test", data_sha256="0" * 64,
        training_max_tokens=0, baseline_median_tokens=100.0, num_train_examples=1,
        num_val_examples=0, seed=0, created_at_s=0.0,
    )  # fmt: skip
    written = save_fast_model(model, tmp_path, manifest)
    assert written.version == model.version and written.version.startswith("fast-")
    loaded = load_predictor("fast", str(tmp_path))
    assert loaded.version == model.version
    inputs = [example.to_input() for example in split.val[:20]]
    assert loaded.predict(inputs) == model.predict(inputs)


def test_refit_makes_a_new_version_and_keeps_the_old(split, model: FastLengthModel) -> None:  # type: ignore[no-untyped-def]
    before = model.predict([split.val[0].to_input()])
    feedback = [
        FeedbackSample(example.to_input(), example.output_tokens * 3) for example in split.val
    ]
    refitted = refit_fast(model, feedback)
    assert refitted.version != model.version and refitted.parent_version == model.version
    assert model.predict([split.val[0].to_input()]) == before  # old model unchanged
    old_p50 = np.mean(
        [p.predicted_output_tokens for p in model.predict([f.input for f in feedback])]
    )
    new_p50 = np.mean(
        [p.predicted_output_tokens for p in refitted.predict([f.input for f in feedback])]
    )
    assert new_p50 > 1.5 * old_p50  # moved towards the (tripled) feedback lengths
    with pytest.raises(ValueError, match="feedback_samples"):
        refit_fast(model, [])


def test_text_score_matches_scikit_learn_pipeline() -> None:
    from sklearn.feature_extraction.text import TfidfVectorizer

    prompts = [f"write {n} words about topic {n % 7}" for n in range(60)]
    targets = np.log(np.arange(60) + 10.0)
    text_model, out_of_fold = fit_text_score(prompts, targets, TextScoreConfig(min_df=1))
    assert out_of_fold.shape == (60,)
    vectorizer = TfidfVectorizer(
        ngram_range=(1, 2), token_pattern=r"(?u)\b\w\w+\b|[?!#`*|]", sublinear_tf=True
    )
    vectorizer.fit(prompts)
    vectorizer.vocabulary_ = {term: i for i, term in enumerate(text_model.terms)}
    vectorizer.idf_ = text_model.idf
    expected = vectorizer.transform(prompts) @ text_model.coef + text_model.intercept
    assert np.allclose(text_model.score(prompts), expected)
