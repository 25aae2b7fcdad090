"""The ``roberta`` backend: a transformer regressor of ln(output tokens) (torch).

Model: ``AutoModelForSequenceClassification(num_labels=1, problem_type="regression")``
from a local checkpoint directory (``roberta-base`` when the user has it; any
compatible encoder works). Nothing is downloaded (``local_files_only=True``).

Target transform: z = (ln(output_tokens) - mean) / std, with mean and std of the
training targets stored in the manifest; the prediction is exp(mean + std * z).
Input: the prompt text, truncated to ``max_length`` (512) tokens of the model's own
tokenizer. Spread: p10/p90 = exp(ln p50 + q), with q the 10th/90th percentiles of the
validation residuals ln(true) - ln(p50), stored in the manifest. Runs on CUDA when
available, else CPU.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from predictor_service.manifest import read_manifest
from predictor_service.models.base import LengthPrediction, PredictionInput, clip_predictions

logger = structlog.get_logger(__name__)

DEFAULT_MAX_LENGTH = 512


@dataclass(frozen=True)
class RobertaTrainConfig:
    """Fine-tuning settings. ``max_steps`` (optimizer steps) cuts training short."""

    epochs: int = 3
    batch_size: int = 16
    learning_rate: float = 2e-5
    weight_decay: float = 0.01
    warmup_fraction: float = 0.06
    max_length: int = DEFAULT_MAX_LENGTH
    eval_batch_size: int = 64
    max_steps: int | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError("epochs and batch_size: must be >= 1")
        if not 8 <= self.max_length <= DEFAULT_MAX_LENGTH:
            raise ValueError(f"max_length: must be in [8, 512] (got {self.max_length})")


def pick_device(device: str | None = None) -> str:
    """``device`` if given, else ``"cuda"`` when available, else ``"cpu"``."""
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _require_checkpoint(path: str | os.PathLike[str]) -> Path:
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"roberta checkpoint not found: {directory} (expected a local directory with "
            "config.json, weights and tokenizer files, e.g. a saved roberta-base; nothing "
            "is downloaded at run time)"
        )
    return directory


def _state_version(model: Any) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode("utf-8"))
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(dtype=_uint8()).numpy())
    return "roberta-" + digest.hexdigest()[:8]


def _uint8() -> Any:
    import torch

    return torch.uint8


class RobertaLengthModel:
    """A fitted transformer regressor (implements ``LengthPredictor``)."""

    backend = "roberta"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        target_mean: float,
        target_std: float,
        residual_log_p10: float,
        residual_log_p90: float,
        training_max_tokens: int,
        max_length: int = DEFAULT_MAX_LENGTH,
        eval_batch_size: int = 64,
        device: str | None = None,
    ) -> None:
        self.device = pick_device(device)
        self.model = model.to(self.device)
        self.model.eval()
        self.tokenizer = tokenizer
        self.target_mean = float(target_mean)
        self.target_std = float(target_std)
        self.residual_log_p10 = float(residual_log_p10)
        self.residual_log_p90 = float(residual_log_p90)
        self.training_max_tokens = int(training_max_tokens)
        self.max_length = max_length
        self.eval_batch_size = eval_batch_size
        self.version = _state_version(self.model)

    def _encode(self, texts: Sequence[str]) -> dict[str, Any]:
        encoded = self.tokenizer(
            [text or " " for text in texts],
            truncation=True,
            max_length=self.max_length,
            padding=True,
            return_tensors="pt",
        )
        encoded.pop("token_type_ids", None)
        return {key: value.to(self.device) for key, value in encoded.items()}

    def predict_log_tokens(self, prompts: Sequence[str]) -> npt.NDArray[np.float64]:
        """ln(p50 tokens) per prompt; batches are formed from prompts of similar length."""
        import torch

        result = np.empty(len(prompts), dtype=np.float64)
        order = sorted(range(len(prompts)), key=lambda index: len(prompts[index]))
        with torch.inference_mode():
            for start in range(0, len(order), self.eval_batch_size):
                batch = order[start : start + self.eval_batch_size]
                logits = self.model(**self._encode([prompts[i] for i in batch])).logits
                standardized = logits.float().view(-1).cpu().numpy()
                result[batch] = self.target_mean + self.target_std * standardized
        return result

    def predict(self, inputs: Sequence[PredictionInput]) -> list[LengthPrediction]:
        """Batched prediction; clipped to [1, min(training max, max_tokens)]."""
        if not inputs:
            return []
        log_p50 = self.predict_log_tokens([one.prompt for one in inputs])
        return clip_predictions(
            inputs,
            np.exp(log_p50 + self.residual_log_p10),
            np.exp(log_p50),
            np.exp(log_p50 + self.residual_log_p90),
            training_max_tokens=self.training_max_tokens,
        )

    def manifest_extra(self) -> dict[str, Any]:
        """Backend settings stored in the manifest's ``extra``."""
        return {
            "target_transform": "z = (ln(output_tokens) - target_mean) / target_std",
            "target_mean": self.target_mean,
            "target_std": self.target_std,
            "residual_log_p10": self.residual_log_p10,
            "residual_log_p90": self.residual_log_p90,
            "max_length": self.max_length,
        }

    def save(self, model_dir: str | os.PathLike[str]) -> None:
        """Write weights, config and tokenizer into ``model_dir`` (not the manifest)."""
        directory = Path(model_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(directory))
        self.tokenizer.save_pretrained(str(directory))

    @classmethod
    def load(
        cls, model_dir: str | os.PathLike[str], device: str | None = None
    ) -> RobertaLengthModel:
        """Load a directory written by training; errors name the missing path."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        directory = _require_checkpoint(model_dir)
        manifest = read_manifest(directory)
        extra = manifest.extra
        model = AutoModelForSequenceClassification.from_pretrained(
            str(directory), local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        return cls(
            model,
            tokenizer,
            target_mean=extra["target_mean"],
            target_std=extra["target_std"],
            residual_log_p10=extra["residual_log_p10"],
            residual_log_p90=extra["residual_log_p90"],
            training_max_tokens=manifest.training_max_tokens,
            max_length=int(extra.get("max_length", DEFAULT_MAX_LENGTH)),
            device=device,
        )


def load_base_model(base_model_dir: str | os.PathLike[str]) -> tuple[Any, Any]:
    """(model, tokenizer) from a local checkpoint, with a fresh 1-output regression head."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    directory = _require_checkpoint(base_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(
        str(directory),
        num_labels=1,
        problem_type="regression",
        ignore_mismatched_sizes=True,
        local_files_only=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return model, tokenizer


def build_word_tokenizer(texts: Sequence[str], vocab_size: int = 5000) -> Any:
    """A small word-level Hugging Face tokenizer fitted on ``texts``.

    For fresh models in tests and smoke runs (a pretrained checkpoint brings its own
    tokenizer). Lower-cased words and punctuation; special tokens ``<s> <pad> </s>
    <unk> <mask>`` in RoBERTa's order, so ``<pad>`` has id 1 as in RoBERTa.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special_tokens = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    word_tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    word_tokenizer.normalizer = normalizers.Lowercase()
    word_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    word_tokenizer.train_from_iterator(
        texts, trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=special_tokens)
    )
    word_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=word_tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        cls_token="<s>",
        sep_token="</s>",
    )


def create_fresh_roberta(
    out_dir: str | os.PathLike[str], tokenizer: Any, **config_overrides: Any
) -> Path:
    """Write a randomly initialised RoBERTa regressor checkpoint into ``out_dir``.

    ``tokenizer`` is any Hugging Face tokenizer (its vocabulary size and pad id are
    used). ``config_overrides`` go to ``RobertaConfig`` (defaults: roberta-base sizes),
    e.g. ``hidden_size=32, num_hidden_layers=2`` for tests. For tests and speed
    measurements where no pretrained weights exist.
    """
    import torch
    from transformers import RobertaConfig, RobertaForSequenceClassification

    settings: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 1,
        "max_position_embeddings": DEFAULT_MAX_LENGTH + 2,
        "num_labels": 1,
        "problem_type": "regression",
    }
    settings.update(config_overrides)
    torch.manual_seed(int(settings.pop("seed", 0)))
    model = RobertaForSequenceClassification(RobertaConfig(**settings))
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def train_roberta(
    train_prompts: Sequence[str],
    train_output_tokens: Sequence[int],
    val_prompts: Sequence[str],
    val_output_tokens: Sequence[int],
    base_model_dir: str | os.PathLike[str],
    config: RobertaTrainConfig | None = None,
    *,
    seed: int = 0,
) -> tuple[RobertaLengthModel, list[float]]:
    """Fine-tune ``base_model_dir`` on the examples; return the model and per-step losses.

    AdamW with linear warm-up then decay, gradient norm clipped at 1.0, MSE on the
    standardised ln target, examples shuffled per epoch by ``seed``. Residual quantiles
    come from the validation examples (the training ones when there are none).
    """
    import torch
    from transformers import get_linear_schedule_with_warmup

    settings = config or RobertaTrainConfig()
    device = pick_device(settings.device)
    torch.manual_seed(seed)
    model, tokenizer = load_base_model(base_model_dir)
    model.to(device)
    log_targets = np.log(np.asarray(train_output_tokens, dtype=np.float64))
    target_mean = float(log_targets.mean())
    target_std = float(log_targets.std()) or 1.0
    standardized = (log_targets - target_mean) / target_std
    steps_per_epoch = math.ceil(len(train_prompts) / settings.batch_size)
    total_steps = steps_per_epoch * settings.epochs
    if settings.max_steps is not None:
        total_steps = min(total_steps, settings.max_steps)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay
    )
    scheduler = get_linear_schedule_with_warmup(
        optimizer, int(settings.warmup_fraction * total_steps), max(total_steps, 1)
    )
    rng = np.random.default_rng(seed)
    losses: list[float] = []
    model.train()
    while len(losses) < total_steps:
        order = rng.permutation(len(train_prompts))
        for start in range(0, len(order), settings.batch_size):
            if len(losses) >= total_steps:
                break
            indices = order[start : start + settings.batch_size]
            encoded = tokenizer(
                [train_prompts[i] or " " for i in indices],
                truncation=True,
                max_length=settings.max_length,
                padding=True,
                return_tensors="pt",
            )
            encoded.pop("token_type_ids", None)
            inputs = {key: value.to(device) for key, value in encoded.items()}
            labels = torch.tensor(standardized[indices], dtype=torch.float32, device=device)
            loss = model(**inputs, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(float(loss.item()))
        logger.info("roberta_epoch_done", num_steps=len(losses), last_loss=losses[-1])
    fitted = RobertaLengthModel(
        model,
        tokenizer,
        target_mean=target_mean,
        target_std=target_std,
        residual_log_p10=0.0,
        residual_log_p90=0.0,
        training_max_tokens=int(max(train_output_tokens)),
        max_length=settings.max_length,
        eval_batch_size=settings.eval_batch_size,
        device=device,
    )
    residual_prompts = val_prompts if len(val_prompts) else train_prompts
    residual_tokens = val_output_tokens if len(val_prompts) else train_output_tokens
    residuals = np.log(np.asarray(residual_tokens, dtype=np.float64)) - fitted.predict_log_tokens(
        residual_prompts
    )
    fitted.residual_log_p10 = float(np.quantile(residuals, 0.1))
    fitted.residual_log_p90 = float(np.quantile(residuals, 0.9))
    return fitted, losses
