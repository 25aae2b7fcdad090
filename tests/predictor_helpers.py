"""Stand-ins the predictor tests build instead of a service's stage or pretrained weights.

:class:`StaticSlot` serves one fixed predictor to the HTTP API; :func:`build_word_tokenizer`
and :func:`create_fresh_encoder` make a tiny randomly initialised encoder for the
``transformer`` backend (torch, transformers and tokenizers are imported only when called).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from predictor_service.models import LengthPredictor


@dataclass
class StaticSlot:
    """A :class:`~predictor_service.online.PredictorSlot` holding one fixed predictor."""

    predictor: LengthPredictor


def build_word_tokenizer(texts: Sequence[str], vocab_size: int = 5000) -> Any:
    """A small word-level Hugging Face tokenizer fitted on ``texts``: lower-cased words
    and punctuation, RoBERTa's special tokens in its order."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special_tokens = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    word_tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    word_tokenizer.normalizer = normalizers.Lowercase()
    word_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    word_tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(vocab_size=vocab_size,
                                                                         special_tokens=special_tokens))
    word_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=word_tokenizer, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>", mask_token="<mask>",
                                   cls_token="<s>", sep_token="</s>")


def create_fresh_encoder(out_dir: str | os.PathLike[str], tokenizer: Any, **config_overrides: Any) -> Path:
    """Write a randomly initialised RoBERTa encoder checkpoint (and ``tokenizer``) into
    ``out_dir``; returns it. ``config_overrides`` go to ``RobertaConfig``, e.g.
    ``hidden_size=32, num_hidden_layers=2``; ``seed`` (default 0) seeds torch."""
    import torch
    from transformers import RobertaConfig, RobertaModel

    settings: dict[str, Any] = {"vocab_size": len(tokenizer), "max_position_embeddings": 514,
                                "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 1}
    settings.update(config_overrides)
    torch.manual_seed(int(settings.pop("seed", 0)))
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    RobertaModel(RobertaConfig(**settings), add_pooling_layer=False).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory
