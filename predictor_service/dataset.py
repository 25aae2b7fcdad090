"""Training examples from a ShareGPT file: pairs -> token counts -> train/val split.

One :class:`LengthExample` per distinct prompt: the human turn (with, for later turns,
the earlier turns before it, as an engine would see them), its length and the length
of the gpt answer that followed, both in tokens of the project tokenizer. Examples are
split by a stable hash of the conversation id, so every turn of a conversation lands
on the same side and the split never changes between runs or machines.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import structlog

from blockq.text.sharegpt_reader import iter_conversations, iter_pairs, render_turn_prompt
from blockq.text.tokenizer import TokenCounter
from predictor_service.models.base import PredictionInput

logger = structlog.get_logger(__name__)

DEFAULT_VAL_FRACTION = 0.1
_TOKEN_COUNT_BATCH = 512


class _Conversational(Protocol):
    @property
    def conversation_id(self) -> str: ...


_Example = TypeVar("_Example", bound=_Conversational)


@dataclass(frozen=True)
class LengthExample:
    """One training example: a prompt and the true output length (tokens, >= 1)."""

    conversation_id: str
    prompt: str
    prompt_tokens: int
    output_tokens: int
    num_turns: int = 1

    def to_input(self, max_tokens: int | None = None) -> PredictionInput:
        """The prediction input for this example (``max_tokens`` default: unbounded)."""
        return PredictionInput(
            prompt=self.prompt,
            prompt_tokens=self.prompt_tokens,
            max_tokens=max_tokens or 1_000_000_000,
            num_turns=self.num_turns,
            true_output_tokens=self.output_tokens,
        )


@dataclass(frozen=True)
class DatasetSplit:
    """Examples split into train and validation, with the source file's sha256."""

    train: tuple[LengthExample, ...]
    val: tuple[LengthExample, ...]
    data_sha256: str


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes (as stored, i.e. of the .gz for compressed data)."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_validation_conversation(conversation_id: str, val_fraction: float) -> bool:
    """True when the conversation belongs to the validation split.

    Stable: the first 8 bytes of sha256(conversation_id) as a fraction of 2**64,
    compared with ``val_fraction``.
    """
    digest = hashlib.sha256(conversation_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < val_fraction


def iter_distinct_pairs(
    data_path: str | os.PathLike[str],
    *,
    first_turn_only: bool = True,
    max_examples: int | None = None,
) -> Iterator[tuple[str, str, str, int]]:
    """(conversation id, prompt, answer, human turns so far) of a ShareGPT file's pairs,
    as every model reads them: blank prompts or answers skipped, prompts deduplicated on
    their exact text (first occurrence kept); a later turn's prompt is the conversation so
    far as a chat client sends it (:func:`blockq.text.sharegpt_reader.render_turn_prompt`, the
    gateway's ``plain`` template). ``max_examples`` stops early."""
    path = Path(data_path)
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT data file not found: {path}")
    seen_prompts: set[str] = set()
    for pair in iter_pairs(path, first_turn_only=first_turn_only):
        if not pair.prompt.strip() or not pair.answer.strip():
            continue
        prompt = render_turn_prompt(pair) if pair.history else pair.prompt
        if prompt in seen_prompts:
            continue
        seen_prompts.add(prompt)
        yield pair.conversation_id, prompt, pair.answer, pair.turn_index + 1
        if max_examples is not None and len(seen_prompts) >= max_examples:
            return


def load_examples(
    data_path: str | os.PathLike[str],
    token_counter: TokenCounter,
    *,
    first_turn_only: bool = True,
    max_examples: int | None = None,
) -> list[LengthExample]:
    """Read ShareGPT pairs and turn them into examples, in file order.

    Pairs whose prompt or answer is blank are skipped; prompts are deduplicated on
    their exact text (first occurrence kept). For later turns (``first_turn_only=False``)
    the prompt is the conversation so far (:func:`iter_distinct_pairs`), and
    ``num_turns`` counts the human turns so far. ``max_examples`` stops early.
    """
    path = Path(data_path)
    pending = list(iter_distinct_pairs(path, first_turn_only=first_turn_only, max_examples=max_examples))
    examples: list[LengthExample] = []
    for start in range(0, len(pending), _TOKEN_COUNT_BATCH):
        batch = pending[start : start + _TOKEN_COUNT_BATCH]
        prompt_counts = token_counter.count([item[1] for item in batch])
        answer_counts = token_counter.count([item[2] for item in batch])
        for (conversation_id, prompt, _, num_turns), num_prompt, num_answer in zip(
            batch, prompt_counts, answer_counts, strict=True
        ):
            examples.append(
                LengthExample(
                    conversation_id=conversation_id,
                    prompt=prompt,
                    prompt_tokens=num_prompt,
                    output_tokens=max(1, num_answer),
                    num_turns=num_turns,
                )
            )
    logger.info("examples_loaded", path=str(path), num_examples=len(examples))
    return examples


def _check_val_fraction(val_fraction: float) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction: must be in [0, 1) (got {val_fraction})")


def split_examples(
    examples: Sequence[_Example], val_fraction: float = DEFAULT_VAL_FRACTION
) -> tuple[tuple[_Example, ...], tuple[_Example, ...]]:
    """Split into (train, val) by :func:`is_validation_conversation` (any examples with a
    ``conversation_id``)."""
    _check_val_fraction(val_fraction)
    train: list[_Example] = []
    val: list[_Example] = []
    for example in examples:
        target = val if is_validation_conversation(example.conversation_id, val_fraction) else train
        target.append(example)
    return tuple(train), tuple(val)


def load_split(
    data_path: str | os.PathLike[str],
    token_counter: TokenCounter,
    *,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    first_turn_only: bool = True,
    max_examples: int | None = None,
) -> DatasetSplit:
    """:func:`load_examples` then :func:`split_examples`, with the file's sha256."""
    examples = load_examples(
        data_path, token_counter, first_turn_only=first_turn_only, max_examples=max_examples
    )
    train, val = split_examples(examples, val_fraction)
    return DatasetSplit(train=train, val=val, data_sha256=file_sha256(data_path))


def output_tokens_array(examples: Sequence[LengthExample]) -> npt.NDArray[np.float64]:
    """The true output lengths (tokens) of ``examples`` as a float array."""
    return np.array([example.output_tokens for example in examples], dtype=np.float64)


def _check_side(side: str) -> None:
    if side not in ("train", "val"):
        raise ValueError(f"side: must be 'train' or 'val' (got {side!r})")


def select_conversations(
    records: Iterable[dict[str, Any]],
    side: Literal["train", "val"],
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> Iterator[dict[str, Any]]:
    """The records of one side of the train/val split, in order (arguments unchecked).

    The conversation id is the one training uses (``id``, else ``record-<index>``, as in
    :func:`blockq.text.sharegpt_reader.pairs_of_conversation`); a record without ``id`` gets that id
    written in, so its id, hence its side, stays the same when the output is read again.
    """
    for index, record in enumerate(records):
        conversation_id = str(record.get("id", f"record-{index}"))
        if is_validation_conversation(conversation_id, val_fraction) == (side == "val"):
            yield record if "id" in record else {"id": conversation_id, **record}


def write_split(
    data_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    side: Literal["train", "val"],
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> int:
    """Write one side of the training split of a ShareGPT file; return the count written.

    For benchmarks on prompts the model did not train on: with the ``val_fraction`` of
    ``train`` (default the same), ``side="val"`` writes exactly the held-out conversations.
    Records are read with the training's reader and written unchanged, as a ShareGPT JSON
    array (gzip when ``out_path`` ends in ``.gz``). Caveat: training deduplicates prompts
    across the whole file, so a held-out conversation whose prompt text repeats an earlier
    training conversation's (ShareGPT has such copies) is written here although the model
    trained on that text.
    """
    _check_side(side)
    _check_val_fraction(val_fraction)
    if not Path(data_path).is_file():
        raise FileNotFoundError(f"ShareGPT data file not found: {data_path}")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    opener = gzip.open if out.suffix == ".gz" else open
    count = 0
    with opener(partial, "wt", encoding="utf-8") as stream:
        stream.write("[")
        for record in select_conversations(iter_conversations(data_path), side, val_fraction):
            stream.write(",\n" if count else "\n")
            stream.write(json.dumps(record, ensure_ascii=False))
            count += 1
        stream.write("\n]\n")
    partial.replace(out)
    logger.info("split_written", path=str(out), side=side, num_conversations=count)
    return count
