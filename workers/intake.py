"""What a worker takes from its queue and how it hands a request to its engine: the
intake's options, how many entries it may read now, and the engine's view of a request.
The live worker (:mod:`workers.worker`) and the simulation's instances call the same
functions."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from blockq.config import DEFAULT_REFINE_EVERY_TOKENS, Settings
from blockq.wire.keys import PAYLOAD_FIELD
from blockq.wire.protocol import Request, ValidationError, decode_request
from blockq.wire.streams import StreamEntry
from workers.engines.base import Engine, EngineRequestSpec


@dataclass(frozen=True)
class WorkerOptions:
    """``refine_url``: the predictor's HTTP API to ask for remaining-length refinements
    (``POST /refine``, every ``refine_every_tokens`` generated tokens); None: beats carry
    first guesses only."""

    bundle_size: int = 16
    stream_interval_ms: float = 50.0
    idle_poll_ms: int = 50
    refine_url: str | None = None
    refine_every_tokens: int = DEFAULT_REFINE_EVERY_TOKENS
    # the predictor's bearer token (env BLOCKQ_PREDICTOR_HTTP_TOKEN), sent with each /refine call
    refine_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.bundle_size < 1:
            raise ValueError(f"bundle_size: must be >= 1 (got {self.bundle_size})")
        if self.stream_interval_ms < 0:
            raise ValueError(f"stream_interval_ms: must be >= 0 (got {self.stream_interval_ms})")
        if self.refine_every_tokens < 1:
            raise ValueError(f"refine_every_tokens: must be >= 1 (got {self.refine_every_tokens})")
        if self.refine_url is not None and not self.refine_url.startswith(("http://", "https://")):
            raise ValueError(f"refine_url: must be an http:// or https:// URL (got {self.refine_url!r})")


def bundle_room(options: WorkerOptions, engine: Engine, max_in_flight: int, num_in_flight: int) -> int:
    """How many queue entries the intake may read now: at most a bundle, only what the
    engine can admit soon, and never more in flight than one engine's worth (<= 0: none)."""
    return min(options.bundle_size, engine.num_admittable(), max_in_flight - num_in_flight)


@dataclass
class Bundle:
    """A bundle read from the queue, sorted: ``fresh`` requests to admit, ``invalid``
    entries to dead-letter (with the reason), ``duplicates`` to ACK without running."""

    fresh: list[tuple[StreamEntry, Request]] = field(default_factory=list)
    invalid: list[tuple[StreamEntry, str]] = field(default_factory=list)
    duplicates: list[StreamEntry] = field(default_factory=list)


def sort_bundle(entries: list[StreamEntry], running_entry_ids: Mapping[str, str], settings: Settings) -> Bundle:
    """Sort ``entries`` (``running_entry_ids``: request id -> the queue entry it runs
    from here). The very entry running here, re-read (own pending), is in no list: it is
    never ACKed while it runs. A second entry for a request already here (placed again
    after this instance looked dead), or twice in the bundle, is a duplicate: the running
    copy answers."""
    bundle = Bundle()
    seen_ids: set[str] = set()
    for entry in entries:
        try:
            if entry.payload is None:
                raise ValidationError("message", f"entry has no '{PAYLOAD_FIELD}' field")
            request = decode_request(entry.payload, settings.limits, keys=settings.keys)
        except Exception as exc:  # ValidationError, or anything else decoding raised
            bundle.invalid.append((entry, str(exc) if isinstance(exc, ValidationError) else repr(exc)))
            continue
        running_entry_id = running_entry_ids.get(request.id)
        if running_entry_id == entry.entry_id:
            continue
        if running_entry_id is not None or request.id in seen_ids:
            bundle.duplicates.append(entry)
            continue
        seen_ids.add(request.id)
        bundle.fresh.append((entry, request))
    return bundle


def engine_spec(request: Request) -> EngineRequestSpec:
    """``request`` as the engine is handed it.

    A request with ``true_output_tokens`` (a trace replay: the trace gives its output
    length) is handed over with ``ignore_eos``, so that an engine reproduces the trace's
    length: ``ignore_eos`` keeps a real engine from stopping at its own EOS first, and the
    engine ends the request at ``min(true_output_tokens, max_tokens)`` (replays leave
    ``max_tokens`` at the room the model allows, so that it tells the predictor nothing).
    The emulated engine ends such a request there either way. The prompt's block hashes
    go along for the engine's prefix cache (:mod:`blockq.text.block_hashes`)."""
    prediction = request.prediction
    return EngineRequestSpec(
        request_id=request.id, prompt=request.prompt, prompt_tokens=request.num_prompt_tokens,
        max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
        stop=request.stop, ignore_eos=request.ignore_eos or request.true_output_tokens is not None,
        min_tokens=request.min_tokens, true_output_tokens=request.true_output_tokens,
        predicted_output_tokens=prediction.predicted_output_tokens if prediction else None,
        p90_tokens=prediction.p90_tokens if prediction else None, prefix_block_hashes=request.prompt_block_hashes,
        output_text=request.trace_output_text, model=request.model)
