"""vLLM's KV cache events, named by the hashes of the dispatcher's prefix index.

With ``kv_events_config`` on, vLLM publishes every block its prefix cache stores and
evicts (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, vllm/distributed/kv_events.py)
on a ZeroMQ PUB socket: multipart messages of topic, sequence number and a msgpack
``KVEventBatch`` (``[ts, [event, ...], dp_rank]``, each event a map tagged ``type``). vLLM's
own block hashes are salted per process unless ``PYTHONHASHSEED`` is set, so they cannot be
computed outside the engine; but a stored event carries the blocks' token ids and the
parent block's hash, so :class:`KvEventMirror` hashes the same token ids the project's way
(:func:`blockq.text.block_hashes.block_hashes`, chained from the parent's project hash) and
keeps vLLM's hash → the project's for the removals. A request's prompt hashed with the
served model's tokenizer (``Settings.prefix_scheme``) then meets exactly the blocks vLLM
holds for it.

Blocks are skipped, not guessed, where the mapping cannot be exact: a block whose parent
was never seen (events missed before the subscription took), blocks keyed by more than
their tokens (a LoRA adapter, multimodal inputs, a cache salt: ``extra_keys`` /
``lora_name``), partial blocks, and tiers other than the engine's own KV cache. Both the
embedded engine (which publishes on a private socket) and an existing vLLM server started
with ``--kv-events-config`` (``blockq worker --engine vllm-http --kv-events-url``) are read
through :class:`KvEventFeed`.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import structlog

from blockq.text.block_hashes import ROOT_PARENT_HASH, block_hashes

log = structlog.get_logger(__name__)

# vLLM's mapping is bounded like the engine's cache (its blocks are removed as evicted);
# this caps it should removals be lost (dropped messages).
MAX_MAPPED_BLOCKS = 1 << 20
# The tiers that are the engine's own KV cache (None: a publisher that names none).
ENGINE_MEDIA = (None, "GPU")
# Messages read per drain at most: a flooding publisher cannot hold the worker's loop.
MAX_MESSAGES_PER_DRAIN = 1024


@dataclass
class KvEventMirror:
    """vLLM's cached blocks as project block hashes; :meth:`apply` turns one event batch
    into the blocks cached and evicted."""

    block_size: int
    _ours: dict[Any, int] = field(default_factory=dict)  # vLLM hash -> project hash, oldest first
    num_skipped_blocks: int = 0

    def apply(self, events: Iterable[Any], into: dict[int, bool]) -> None:
        """Note in ``into`` each block ``events`` (decoded maps) cache (True) or evict
        (False), its latest event last; a malformed event is skipped, never raised."""
        for event in events:
            if not isinstance(event, Mapping):
                continue
            kind = event.get("type")
            if kind == "BlockStored":
                note_block_events(into, self._stored(event), True)
            elif kind == "BlockRemoved" and event.get("medium") in ENGINE_MEDIA:
                note_block_events(into, [ours for vllm_hash in _hash_list(event.get("block_hashes"))
                                         if (ours := self._ours.pop(vllm_hash, None)) is not None], False)
            elif kind == "AllBlocksCleared":
                note_block_events(into, list(self._ours.values()), False)
                self._ours.clear()

    def _stored(self, event: Mapping[str, Any]) -> list[int]:
        vllm_hashes = _hash_list(event.get("block_hashes"))
        token_ids = event.get("token_ids")
        parent = event.get("parent_block_hash")
        parent_ours = ROOT_PARENT_HASH if parent is None else self._ours.get(parent)
        if (parent_ours is None or event.get("block_size") != self.block_size
                or event.get("medium") not in ENGINE_MEDIA or event.get("lora_name") or event.get("lora_id")
                or any(event.get("extra_keys") or ()) or not isinstance(token_ids, list)
                or len(token_ids) != len(vllm_hashes) * self.block_size
                or not all(isinstance(t, int) and 0 <= t < 2**63 for t in token_ids)):
            self.num_skipped_blocks += len(vllm_hashes)
            return []
        ours = block_hashes(token_ids, self.block_size, parent_ours)
        for vllm_hash, our_hash in zip(vllm_hashes, ours, strict=True):
            self._ours.pop(vllm_hash, None)
            self._ours[vllm_hash] = our_hash
        while len(self._ours) > MAX_MAPPED_BLOCKS:
            del self._ours[next(iter(self._ours))]
        return list(ours)


def note_block_events(into: dict[int, bool], block_hashes: Iterable[int], cached: bool,
                      max_blocks: int | None = None) -> None:
    """Note in ``into`` (block hash -> cached, oldest event first) that ``block_hashes``
    were cached (True) or evicted (False): each block's latest event only, at most the
    newest ``max_blocks`` (None: all)."""
    for block_hash in block_hashes:
        into.pop(block_hash, None)
        into[block_hash] = cached
    while max_blocks is not None and len(into) > max_blocks:
        del into[next(iter(into))]


def _hash_list(value: Any) -> list[Any]:
    """vLLM's block hashes: ints (its default) or bytes; anything else is dropped."""
    if not isinstance(value, list):
        return []
    return [h for h in value if isinstance(h, int | bytes) and not isinstance(h, bool)]


class KvEventFeed:
    """A subscription to a vLLM KV event publisher; :meth:`drain` returns what arrived.

    ``endpoint``: where the publisher is (``tcp://host:5557``); None makes a private one
    for an engine this process starts (:attr:`publish_endpoint`, handed to vLLM).
    ``block_size``: the engine's KV block size; 0 until it is known (set
    ``mirror.block_size`` once the engine has started: until then every block is skipped)."""

    def __init__(self, block_size: int = 0, endpoint: str | None = None) -> None:
        import zmq

        self.mirror = KvEventMirror(block_size)
        self.publish_endpoint = endpoint or f"ipc://@blockq-vllm-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.num_bad_messages = 0
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(self.publish_endpoint)

    def drain(self) -> tuple[list[int], list[int]]:
        """(cached, evicted) project hashes of the batches that arrived, without waiting;
        a block is in one of them at most (its latest event)."""
        import zmq

        latest: dict[int, bool] = {}
        with contextlib.suppress(zmq.Again):
            for _ in range(MAX_MESSAGES_PER_DRAIN):
                self.mirror.apply(self._events(self._socket.recv_multipart(zmq.NOBLOCK)), latest)
        return [h for h, cached in latest.items() if cached], [h for h, cached in latest.items() if not cached]

    def _events(self, frames: list[bytes]) -> list[Any]:
        """The events of one message; a malformed one is counted and logged once."""
        try:
            batch = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
            events = batch[1] if isinstance(batch, list) and len(batch) >= 2 else None
        except Exception:  # msgpack raises several types for bad bytes
            events = None
        if not isinstance(events, list):
            self.num_bad_messages += 1
            if self.num_bad_messages == 1:
                log.warning("kv_event_message_unreadable", frames=len(frames))
            return []
        return events

    def close(self) -> None:
        self._socket.close()


def kv_events_config(publish_endpoint: str) -> dict[str, Any]:
    """vLLM's ``kv_events_config`` for an engine publishing on ``publish_endpoint``."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": publish_endpoint}
