"""A bag-of-words length score: TF-IDF of word 1-2-grams -> ridge on ln(output tokens).

The ``fast`` model feeds this score to its gradient-boosted trees as one feature (a
stacked model): trees handle the hand-made features well but cannot read vocabulary,
and a linear model over 50,000 n-grams can. Training rows get out-of-fold scores so
the trees never see a score fitted on their own label.

Stored as plain data (no pickle): ``text_score.json`` (settings and the terms in
column order) and ``text_score.npz`` (idf weights and ridge coefficients).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from sklearn.feature_extraction.text import CountVectorizer, TfidfVectorizer
from sklearn.linear_model import Ridge
from sklearn.model_selection import KFold

TEXT_SCORE_JSON = "text_score.json"
TEXT_SCORE_NPZ = "text_score.npz"
_EDGE_CHARS = 500
_TOKEN_PATTERN = r"(?u)\b\w\w+\b|[?!#`*|]"


def edge_text(prompt: str) -> str:
    """The first and last ``_EDGE_CHARS`` characters (where instructions sit)."""
    if len(prompt) <= 2 * _EDGE_CHARS:
        return prompt
    return prompt[:_EDGE_CHARS] + "\n" + prompt[-_EDGE_CHARS:]


@dataclass(frozen=True)
class TextScoreConfig:
    """Settings of the text score (``max_terms`` n-grams seen in >= ``min_df`` prompts)."""

    max_terms: int = 50_000
    min_df: int = 3
    ridge_alpha: float = 3.0
    num_folds: int = 5


class TextScoreModel:
    """Maps prompts to a predicted ln(output tokens) from their word n-grams.

    score = intercept + coef . l2_normalise((1 + ln tf) * idf), the same as a
    scikit-learn ``TfidfVectorizer(sublinear_tf=True)`` followed by ``Ridge``.
    """

    def __init__(
        self,
        terms: Sequence[str],
        idf: npt.NDArray[np.float64],
        coef: npt.NDArray[np.float64],
        intercept: float,
    ) -> None:
        if not len(terms) == len(idf) == len(coef):
            raise ValueError("terms, idf and coef must have equal length")
        self.terms = tuple(terms)
        self.idf = np.asarray(idf, dtype=np.float64)
        self.coef = np.asarray(coef, dtype=np.float64)
        self.intercept = float(intercept)
        self._counter = CountVectorizer(
            vocabulary={term: index for index, term in enumerate(self.terms)},
            ngram_range=(1, 2),
            token_pattern=_TOKEN_PATTERN,
            lowercase=True,
        )

    def score(self, prompts: Sequence[str]) -> npt.NDArray[np.float64]:
        """Predicted ln(output tokens) per prompt (the intercept for an empty prompt)."""
        if not prompts:
            return np.zeros(0, dtype=np.float64)
        counts = self._counter.transform([edge_text(prompt) for prompt in prompts]).tocsr()
        counts = counts.astype(np.float64)
        counts.data = (1.0 + np.log(counts.data)) * self.idf[counts.indices]
        squared = counts.multiply(counts).sum(axis=1).A1
        norms = np.sqrt(np.maximum(squared, 1e-12))
        raw = counts @ self.coef
        return self.intercept + np.where(squared > 0, raw / norms, 0.0)

    def save(self, model_dir: str | os.PathLike[str]) -> list[Path]:
        """Write the two files into ``model_dir``; returns their paths."""
        directory = Path(model_dir)
        json_path = directory / TEXT_SCORE_JSON
        npz_path = directory / TEXT_SCORE_NPZ
        json_path.write_text(json.dumps({"intercept": self.intercept, "terms": self.terms}))
        with open(npz_path, "wb") as stream:
            np.savez(stream, idf=self.idf, coef=self.coef)
        return [json_path, npz_path]

    @classmethod
    def load(cls, model_dir: str | os.PathLike[str]) -> TextScoreModel:
        """Read a model written by :meth:`save`; errors name the missing file."""
        directory = Path(model_dir)
        for name in (TEXT_SCORE_JSON, TEXT_SCORE_NPZ):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"text score file not found: {directory / name}")
        data = json.loads((directory / TEXT_SCORE_JSON).read_text())
        with np.load(directory / TEXT_SCORE_NPZ) as arrays:
            return cls(data["terms"], arrays["idf"], arrays["coef"], data["intercept"])


def fit_tfidf_ridge(
    texts: Sequence[str], log_targets: npt.NDArray[np.float64], config: TextScoreConfig
) -> TextScoreModel:
    """TF-IDF of word 1-2-grams of ``texts`` (sublinear tf) -> a ridge on ``log_targets``,
    in one fit (no folds): the prompt score's and the refinement tail score's one recipe."""
    min_df = config.min_df if len(texts) >= 10 * config.min_df else 1
    vectorizer = TfidfVectorizer(
        ngram_range=(1, 2),
        token_pattern=_TOKEN_PATTERN,
        lowercase=True,
        min_df=min_df,
        max_features=config.max_terms,
        sublinear_tf=True,
    )
    matrix = vectorizer.fit_transform(texts)
    ridge = Ridge(alpha=config.ridge_alpha).fit(matrix, log_targets)
    terms = [""] * len(vectorizer.vocabulary_)
    for term, index in vectorizer.vocabulary_.items():
        terms[index] = term
    return TextScoreModel(terms, vectorizer.idf_, ridge.coef_, float(ridge.intercept_))


def fit_text_score(
    prompts: Sequence[str],
    log_targets: npt.ArrayLike,
    config: TextScoreConfig | None = None,
    *,
    seed: int = 0,
) -> tuple[TextScoreModel, npt.NDArray[np.float64]]:
    """Fit on all prompts; also return out-of-fold scores for the same prompts.

    ``log_targets`` are ln(output tokens). The out-of-fold score of a prompt comes
    from a model fitted on the other folds (``config.num_folds``, shuffled by
    ``seed``); with fewer than 2 prompts per fold the in-sample score is returned.
    """
    settings = config or TextScoreConfig()
    targets = np.asarray(log_targets, dtype=np.float64)
    texts = [edge_text(prompt) for prompt in prompts]
    full_model = fit_tfidf_ridge(texts, targets, settings)
    if len(texts) < 2 * settings.num_folds:
        return full_model, full_model.score(prompts)
    out_of_fold = np.empty(len(texts), dtype=np.float64)
    folds = KFold(settings.num_folds, shuffle=True, random_state=seed)
    for train_index, test_index in folds.split(texts):
        fold_model = fit_tfidf_ridge([texts[i] for i in train_index], targets[train_index], settings)
        out_of_fold[test_index] = fold_model.score([prompts[i] for i in test_index])
    return full_model, out_of_fold
