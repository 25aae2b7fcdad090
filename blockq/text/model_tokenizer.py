"""The served model's own tokenizer, for the keys of its prefix cache.

vLLM caches KV blocks of the token ids *its* tokenizer gives a prompt: the served model's,
loaded from the model directory with ``transformers``, special tokens added (a Llama
prompt starts with BOS), as vLLM tokenizes a text prompt. Block hashes that are to match
what an engine caches must be made from the same ids, so the predictor (which hashes
requests' prompts) and every engine worker load the tokenizer from the same directory.

A tokenizer is named by a fingerprint of its files (:func:`tokenizer_fingerprint`): the
workers publish theirs in the engine config (``prefix_tokenizer``) and the dispatcher
predicts hits only on instances whose fingerprint and block size are the ones requests
were hashed with. The project's own tokenizer (no model directory) is
:data:`PROJECT_TOKENIZER`.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PROJECT_TOKENIZER = "project"
UNKNOWN_TOKENIZER = "unknown"
# The files that decide how a text becomes token ids (those present are fingerprinted).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


class TokenizerUnavailable(RuntimeError):
    """The model directory holds no tokenizer, or ``transformers`` cannot load it."""


def tokenizer_fingerprint(model_dir: str | Path) -> str:
    """``sha256:`` and 16 hex digits over the tokenizer files of ``model_dir``: equal for
    two directories holding the same tokenizer, wherever they are.

    Raises:
        TokenizerUnavailable: when the directory holds none of the tokenizer files.
    """
    directory = Path(model_dir)
    digest = hashlib.sha256()
    found = False
    for name in _TOKENIZER_FILES:
        path = directory / name
        if path.is_file():
            found = True
            digest.update(name.encode() + b"\0" + path.read_bytes())
    if not found:
        raise TokenizerUnavailable(f"{directory}: no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
    return "sha256:" + digest.hexdigest()[:16]


def served_tokenizer_id(model_dir: str | None) -> str:
    """What an engine serving ``model_dir`` publishes as its ``prefix_tokenizer``: the
    fingerprint, or :data:`UNKNOWN_TOKENIZER` (no hit is predicted there)."""
    try:
        return tokenizer_fingerprint(model_dir) if model_dir else UNKNOWN_TOKENIZER
    except (TokenizerUnavailable, OSError):
        return UNKNOWN_TOKENIZER


@functools.cache
def _load(model_dir: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise TokenizerUnavailable("the 'transformers' package is not installed") from exc
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, ... for a bad directory
        raise TokenizerUnavailable(f"{model_dir}: {type(exc).__name__}: {exc}") from exc


def encode_as_engine(model_dir: str | Path, texts: Sequence[str]) -> list[list[int]]:
    """The token ids vLLM gives each text prompt when serving ``model_dir``: its tokenizer,
    special tokens added. Loaded once per process.

    Raises:
        TokenizerUnavailable: as :func:`tokenizer_fingerprint`, or when it cannot be loaded.
    """
    if not texts:
        return []
    tokenizer = _load(str(model_dir))
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=True)["input_ids"]]
