"""Prompt block hashes: the keys of an engine's prefix cache, computed once per request.

An engine with prefix caching (vLLM's ``enable_prefix_caching``) keeps the KV blocks of
the prompts it served and reuses them for a later prompt that starts with the same
tokens. It finds them by hashing the prompt block by block, each hash covering the
previous one (the *parent*) and the block's token ids, as vLLM does: equal hashes mean
equal prefixes up to and including that block, so a cache lookup walks the hashes from
the first and stops at the first miss. Only full blocks are hashed; the prompt's partial
last block is never shared. The engine goes on hashing as it generates: once an output
token fills a block, that block (prompt tail and output) is cached too, so a conversation's
next turn, whose prompt repeats this one and its answer, finds the answer's blocks.

The hash is blake2b truncated to 63 bits (a non-negative int64 in msgpack and numpy), not
Python's ``hash``, which is salted per process: the predictor that computes the hashes,
the dispatcher that indexes them and the engines that look them up must all agree.

Which token ids and which block size is the fleet's :class:`PrefixScheme` (``Settings.prefix_scheme``):
by default the project tokenizer and 16-token blocks (the emulated engine's); for vLLM
engines, the served model's tokenizer (:mod:`blockq.text.model_tokenizer`) and the engines'
KV block size, so that a request's hashes are those of the blocks vLLM caches for it. A
vLLM worker names the blocks its engine caches and evicts by the same hashes, made from the
token ids vLLM's KV events carry (:mod:`workers.engines.kv_events`).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from blockq.text.model_tokenizer import PROJECT_TOKENIZER, encode_as_engine, tokenizer_fingerprint
from blockq.text.tokenizer import AnswerTokenizer

log = structlog.get_logger(__name__)

PREFIX_BLOCK_TOKENS = 16
# The parent of a prompt's first block: a fixed value, so the chain is reproducible.
ROOT_PARENT_HASH = 0
_HASH_BITS = 63


@dataclass(frozen=True)
class PrefixScheme:
    """How prompts become block hashes: blocks of ``block_tokens`` token ids, from the
    tokenizer of the model in ``tokenizer_dir`` (None: the project tokenizer)."""

    block_tokens: int = PREFIX_BLOCK_TOKENS
    tokenizer_dir: str | None = None

    @functools.cached_property
    def tokenizer_id(self) -> str:
        """What engines name the tokenizer by (``engine_config["prefix_tokenizer"]``)."""
        return tokenizer_fingerprint(self.tokenizer_dir) if self.tokenizer_dir else PROJECT_TOKENIZER

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of text prompts, as the engines get them."""
        if self.tokenizer_dir:
            return encode_as_engine(self.tokenizer_dir, texts)
        return _tokenizer().encode(list(texts))


PROJECT_SCHEME = PrefixScheme()


def block_hashes(token_ids: Sequence[int], block_size: int = PREFIX_BLOCK_TOKENS,
                 parent_hash: int = ROOT_PARENT_HASH) -> tuple[int, ...]:
    """The chained hashes of the full ``block_size``-token blocks of ``token_ids``, in
    order (``len(token_ids) // block_size`` of them; the partial last block has none),
    the first one chained to ``parent_hash`` (that of the block before, for blocks that
    continue a sequence).

    Each is a non-negative int below 2**63, the same in every process and on every host.

    Raises:
        ValueError: if ``block_size`` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1 (got {block_size})")
    packer = _block_packer(block_size)
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(packer.pack(parent_hash, *token_ids[start:start + block_size]),
                                 digest_size=8).digest()
        parent_hash = int.from_bytes(digest, "little") >> (64 - _HASH_BITS)
        hashes.append(parent_hash)
    return tuple(hashes)


@functools.cache
def _block_packer(block_size: int) -> struct.Struct:
    """Little-endian parent hash and token ids: the same bytes on every platform."""
    return struct.Struct(f"<Q{block_size}q")


def prompt_token_ids(prompt: str | Sequence[int]) -> list[int]:
    """The token ids of a request prompt: a token-id prompt as it is, a text prompt
    through the project tokenizer (:class:`~blockq.text.tokenizer.AnswerTokenizer`, without
    BOS/EOS; loaded once per process).

    Raises:
        RuntimeError: for a text prompt, when the tokenizer's packages are missing.
    """
    if isinstance(prompt, str):
        return _tokenizer().encode([prompt])[0]
    return list(prompt)


def prompt_block_hashes(prompts: Sequence[str | Sequence[int]],
                        scheme: PrefixScheme = PROJECT_SCHEME) -> list[tuple[int, ...]]:
    """:func:`block_hashes` of each prompt's token ids under ``scheme`` (text prompts
    tokenized in one call; token-id prompts as they are). Without the tokenizer (its
    packages or its files missing), text prompts get no hashes (logged once): prefix
    caching then cannot be predicted for them, and nothing fails."""
    texts = [prompt for prompt in prompts if isinstance(prompt, str)]
    text_ids = iter(_encode_texts(texts, scheme))
    return [block_hashes(next(text_ids) if isinstance(prompt, str) else prompt, scheme.block_tokens)
            for prompt in prompts]


@functools.lru_cache(maxsize=4096)  # a simulated sample of a few thousand requests
def answer_block_hashes(prompt: str | tuple[int, ...], answer: str) -> tuple[int, ...]:
    """:func:`block_hashes` of the prompt's token ids followed by the answer's (the project
    tokenizer's): the blocks an engine caches while it generates a known answer (a trace's
    recorded one). The first ``len(token_ids) // block size`` of them are the prompt's own
    :func:`prompt_block_hashes`. Cached per (prompt, answer): a simulation replays the same
    requests run after run.

    Raises:
        RuntimeError: when the tokenizer's packages are missing.
    """
    tokenizer = _tokenizer()
    if isinstance(prompt, str):
        prompt_ids, answer_ids = tokenizer.encode([prompt, answer])
    else:
        prompt_ids, answer_ids = list(prompt), tokenizer.encode([answer])[0]
    return block_hashes(prompt_ids + answer_ids)


def num_filled_blocks(prompt_tokens: int, num_output_tokens: int, block_size: int = PREFIX_BLOCK_TOKENS) -> int:
    """The full blocks a request's computed tokens fill once it has produced
    ``num_output_tokens``: the last sampled token's KV is never computed."""
    return (prompt_tokens + num_output_tokens - 1) // block_size


def continued_block_hashes(prompt: str | tuple[int, ...], prompt_hashes: tuple[int, ...],
                           answer: str | None) -> tuple[int, ...]:
    """``prompt_hashes`` continued over ``answer`` (:func:`answer_block_hashes`) where that
    can be done: an answer is given, the tokenizer loads, and it gives the prompt the same
    hashes (hashes made with another tokenizer stay as they are)."""
    if not prompt_hashes or not answer:
        return prompt_hashes
    try:
        full = answer_block_hashes(prompt, answer)
    except RuntimeError:
        return prompt_hashes
    return full if full[:len(prompt_hashes)] == prompt_hashes else prompt_hashes


def _encode_texts(texts: list[str], scheme: PrefixScheme) -> list[list[int]]:
    if not texts:
        return []
    try:
        return scheme.encode(texts)
    except RuntimeError as exc:  # TokenizerUnavailable is one
        _warn_no_tokenizer(str(exc))
        return [[] for _ in texts]


@functools.cache
def _warn_no_tokenizer(reason: str) -> None:
    log.warning("prefix_hashes_unavailable_for_text_prompts", reason=reason)


@functools.cache
def _tokenizer() -> AnswerTokenizer:
    return AnswerTokenizer()
