"""The wire format: msgpack maps with a schema version, and their validation.

Every message is a frozen dataclass with ``to_map()`` / ``from_map()``; ``encode()`` and
``decode_*()`` add the msgpack layer. Decoding is bounded (message size, string and list
lengths) and validation errors name the field and the limit, so that a consumer can put
the reason on the dead-letter stream and carry on.

A request travels the whole pipeline as one envelope: the predictor adds a
:class:`Prediction`, the dispatcher an :class:`Assignment` (``dataclasses.replace``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

import msgpack

from blockq.text.block_hashes import PREFIX_BLOCK_TOKENS
from blockq.wire.keys import Keys

SCHEMA_VERSION = 1
PRIORITIES = ("interactive", "batch")
# A final record's status when the dispatcher refused the request before it ran.
STATUS_INFEASIBLE = "infeasible"
MAX_SLO_TTFT_MS = 3_600_000.0  # one hour: a longer "objective" is a typo
MAX_EPOCH_MS = 2**53  # a timestamp in ms that a float still holds exactly


class ValidationError(ValueError):
    """A message field is missing, of the wrong type or outside its limit."""

    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name
        self.problem = problem


@dataclass(frozen=True)
class ProtocolLimits:
    """Bounds applied when decoding and validating requests (env ``BLOCKQ_MAX_*``)."""

    max_message_bytes: int = 4 * 1024 * 1024
    max_prompt_chars: int = 1_000_000
    max_prompt_token_ids: int = 131_072
    min_max_tokens: int = 1
    max_max_tokens: int = 32_768
    max_stop_sequences: int = 16
    max_stop_chars: int = 256
    max_id_chars: int = 128
    max_tenant_chars: int = 128
    max_model_chars: int = 256

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{f.name}: must be >= 1 (got {getattr(self, f.name)})")
        if self.min_max_tokens > self.max_max_tokens:
            raise ValueError("min_max_tokens: must not exceed max_max_tokens")


DEFAULT_LIMITS = ProtocolLimits()


# --- field checks -----------------------------------------------------------------------


def field_of(data: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], *, required: bool = True) -> Any:
    """``data[name]`` checked to be of ``kinds``; ValidationError naming the field otherwise."""
    if name not in data or data[name] is None:
        if required:
            raise ValidationError(name, "is required")
        return None
    value = data[name]
    # bool is an int subclass: never accept it where a number is meant.
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ValidationError(name, f"must be {_kind_names(kinds)} (got bool)")
    if not isinstance(value, kinds):
        raise ValidationError(name, f"must be {_kind_names(kinds)} (got {type(value).__name__})")
    return value


def _kind_names(kinds: type | tuple[type, ...]) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(k.__name__ for k in kinds)


def float_field(data: Mapping[str, Any], name: str, *, required: bool = True) -> float | None:
    """A finite number field as a float (:func:`field_of`)."""
    value = field_of(data, name, (int, float), required=required)
    if value is None:
        return None
    if not math.isfinite(value):
        raise ValidationError(name, "must be a finite number")
    return float(value)


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValidationError(name, f"must be between {low} and {high} (got {value})")


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    """``min_tokens`` may not ask for more than ``max_tokens`` allows."""
    if min_tokens > max_tokens:
        raise ValidationError("min_tokens", f"must be at most max_tokens ({max_tokens}) (got {min_tokens})")


def _check_text(name: str, value: str, max_chars: int) -> None:
    if len(value) > max_chars:
        raise ValidationError(name, f"must be at most {max_chars} characters (got {len(value)})")


def _optional_int(data: Mapping[str, Any], name: str, low: int = 0, high: int = 2**31) -> int | None:
    value = field_of(data, name, int, required=False)
    if value is not None:
        _check_range(name, value, low, high)
    return value


def _optional_text(data: Mapping[str, Any], name: str, max_chars: int) -> str | None:
    value = field_of(data, name, str, required=False)
    if value is not None:
        _check_text(name, value, max_chars)
    return value


# --- request envelope -------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """What the predictor adds: token counts and the output-length distribution."""

    prompt_tokens: int
    predicted_output_tokens: int
    p10_tokens: int
    p90_tokens: int
    predictor_version: str

    def to_map(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_map(cls, data: Mapping[str, Any]) -> Prediction:
        return cls(
            prompt_tokens=field_of(data, "prompt_tokens", int),
            predicted_output_tokens=field_of(data, "predicted_output_tokens", int),
            p10_tokens=field_of(data, "p10_tokens", int),
            p90_tokens=field_of(data, "p90_tokens", int),
            predictor_version=field_of(data, "predictor_version", str),
        )


@dataclass(frozen=True)
class Assignment:
    """What the dispatcher adds: where the request goes and what it expects there."""

    instance_id: str
    policy: str
    decided_at_s: float
    decision_ms: float
    predicted_ttft_ms: float | None = None
    predicted_e2e_ms: float | None = None
    # Prompt tokens the dispatcher's prefix index expects the instance to find cached
    # (None: it keeps no index for the instance).
    predicted_cached_tokens: int | None = None

    def to_map(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_map(cls, data: Mapping[str, Any]) -> Assignment:
        return cls(
            instance_id=field_of(data, "instance_id", str),
            policy=field_of(data, "policy", str),
            decided_at_s=float_field(data, "decided_at_s"),
            decision_ms=float_field(data, "decision_ms"),
            predicted_ttft_ms=float_field(data, "predicted_ttft_ms", required=False),
            predicted_e2e_ms=float_field(data, "predicted_e2e_ms", required=False),
            predicted_cached_tokens=_optional_int(data, "predicted_cached_tokens"),
        )


@dataclass(frozen=True)
class Request:
    """One generation request, as it travels from the client to a worker.

    ``prompt`` is text or a tuple of token ids. ``deadline_s`` and ``submitted_at_s`` are
    wall-clock epoch seconds. ``slo_ttft_ms`` is this request's time-to-first-token
    objective (None: the cluster's, ``BLOCKQ_SLO_TTFT_MS``); a request that no instance is
    predicted to start within it, or to finish by ``deadline_s``, is answered
    ``infeasible`` at once unless ``best_effort`` (then it is placed anyway). ``true_output_tokens`` is carried only by trace replays (the
    emulated engine ends the request there); ``trace_predicted_output_tokens`` is a
    prediction shipped with a trace; ``trace_output_text`` the recorded answer of a trace
    with text (the emulated engine streams its tokens, so the partial output is real). ``ignore_eos`` and ``min_tokens`` are vLLM's sampling
    extensions: generate past EOS (to ``max_tokens``), and not stop (on EOS or a stop
    sequence) before ``min_tokens`` output tokens (at most ``max_tokens``).
    ``prompt_block_hashes``: the chained hashes of the prompt's full
    :data:`~blockq.text.block_hashes.PREFIX_BLOCK_TOKENS`-token blocks (:mod:`blockq.text.block_hashes`), added
    with the prediction; what prefix-cache lookups are keyed by (empty: none computed).
    ``admitted_at_ms``: when Redis admitted the request, ms since the epoch on Redis' clock
    (its entry id in ``req``), stamped by the predictor over whatever the client sent; the
    dispatcher measures the time a request waited from it, against its estimate of Redis'
    now, so no client's clock skews admission (None: a message from before it, measured
    from ``submitted_at_s``).
    ``model``: the model the request asks for, a base model's name or a LoRA adapter's, as
    instances publish them in their beats (:func:`blockq.wire.beats.served_names`); the
    dispatcher places it only on an instance serving that name, and answers an error at once
    when no live instance does. None: any instance, with its base model (as before models
    were named).
    """

    id: str
    prompt: str | tuple[int, ...]
    max_tokens: int
    reply_stream: str
    submitted_at_s: float
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    priority: str = "interactive"
    deadline_s: float | None = None
    slo_ttft_ms: float | None = None
    best_effort: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    tenant: str = "default"
    num_turns: int = 1
    true_output_tokens: int | None = None
    trace_predicted_output_tokens: int | None = None
    trace_output_text: str | None = None
    prompt_block_hashes: tuple[int, ...] = ()
    admitted_at_ms: int | None = None
    model: str | None = None
    prediction: Prediction | None = None
    assignment: Assignment | None = None
    schema_version: int = field(default=SCHEMA_VERSION)

    @property
    def num_prompt_tokens(self) -> int:
        """The predictor's count where it ran; else the token ids, or for text a rough
        count (about 4 characters a token) so that a request no predictor saw still has a
        size to place and admit by."""
        if self.prediction is not None:
            return self.prediction.prompt_tokens
        if isinstance(self.prompt, str):
            return max(1, len(self.prompt) // 4)
        return len(self.prompt)

    def with_prediction(self, prediction: Prediction) -> Request:
        return replace(self, prediction=prediction)

    def with_assignment(self, assignment: Assignment) -> Request:
        return replace(self, assignment=assignment)

    def with_admission(self, admitted_at_ms: int) -> Request:
        return replace(self, admitted_at_ms=admitted_at_ms)

    def to_map(self) -> dict[str, Any]:
        data: dict[str, Any] = {"v": self.schema_version, "kind": "request"}
        for f in fields(self):
            if f.name == "schema_version":
                continue
            value = getattr(self, f.name)
            if isinstance(value, Prediction | Assignment):
                value = value.to_map()
            elif isinstance(value, tuple):
                value = list(value)
            if value is not None:
                data[f.name] = value
        return data

    @classmethod
    def from_map(cls, data: Mapping[str, Any], limits: ProtocolLimits = DEFAULT_LIMITS, *,
                 keys: Keys | None = None) -> Request:
        """Validate ``data``; with ``keys``, the reply stream must also be exactly
        ``keys.reply(id)`` (a stage reading client input passes them: any other key would
        let a client write into another request's output, or into a key of another type)."""
        check_envelope(data, "request")
        request_id = field_of(data, "id", str)
        if not request_id:
            raise ValidationError("id", "must not be empty")
        _check_text("id", request_id, limits.max_id_chars)
        max_tokens = field_of(data, "max_tokens", int)
        _check_range("max_tokens", max_tokens, limits.min_max_tokens, limits.max_max_tokens)
        temperature = float_field(data, "temperature", required=False)
        top_p = float_field(data, "top_p", required=False)
        priority = field_of(data, "priority", str, required=False) or "interactive"
        if priority not in PRIORITIES:
            raise ValidationError("priority", f"must be one of {', '.join(PRIORITIES)} (got {priority!r})")
        tenant = field_of(data, "tenant", str, required=False) or "default"
        _check_text("tenant", tenant, limits.max_tenant_chars)
        prediction = field_of(data, "prediction", dict, required=False)
        assignment = field_of(data, "assignment", dict, required=False)
        request = cls(
            id=request_id,
            prompt=_decode_prompt(data, limits),
            max_tokens=max_tokens,
            reply_stream=field_of(data, "reply_stream", str),
            submitted_at_s=float_field(data, "submitted_at_s"),
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            stop=_decode_stop(data, limits),
            priority=priority,
            deadline_s=float_field(data, "deadline_s", required=False),
            slo_ttft_ms=float_field(data, "slo_ttft_ms", required=False),
            best_effort=bool(field_of(data, "best_effort", bool, required=False)),
            ignore_eos=bool(field_of(data, "ignore_eos", bool, required=False)),
            min_tokens=_optional_int(data, "min_tokens", 0) or 0,
            tenant=tenant,
            num_turns=_optional_int(data, "num_turns", 1, 10_000) or 1,
            true_output_tokens=_optional_int(data, "true_output_tokens", 1),
            trace_predicted_output_tokens=_optional_int(data, "trace_predicted_output_tokens", 0),
            trace_output_text=_optional_text(data, "trace_output_text", limits.max_prompt_chars),
            prompt_block_hashes=_decode_block_hashes(data, limits),
            admitted_at_ms=_optional_int(data, "admitted_at_ms", 0, MAX_EPOCH_MS),
            model=_optional_text(data, "model", limits.max_model_chars) or None,
            prediction=Prediction.from_map(prediction) if prediction is not None else None,
            assignment=Assignment.from_map(assignment) if assignment is not None else None,
        )
        _check_range("temperature", request.temperature, 0.0, 2.0)
        check_min_tokens(request.min_tokens, max_tokens)
        if request.slo_ttft_ms is not None:
            _check_range("slo_ttft_ms", request.slo_ttft_ms, 1.0, MAX_SLO_TTFT_MS)
        if not 0.0 < request.top_p <= 1.0:
            raise ValidationError("top_p", f"must be in (0, 1] (got {request.top_p})")
        if keys is not None and request.reply_stream != keys.reply(request_id):
            raise ValidationError("reply_stream", f"must be {keys.reply(request_id)!r}, this request's own "
                                  f"reply stream (got {request.reply_stream[:100]!r})")
        return request


def check_envelope(data: Mapping[str, Any], kind: str) -> None:
    """The schema version and ``kind`` of a decoded message; ValidationError otherwise."""
    version = field_of(data, "v", int)
    if version != SCHEMA_VERSION:
        raise ValidationError("v", f"unsupported schema version {version} (supported: {SCHEMA_VERSION})")
    got = field_of(data, "kind", str)
    if got != kind:
        raise ValidationError("kind", f"expected {kind!r} (got {got!r})")


def _decode_prompt(data: Mapping[str, Any], limits: ProtocolLimits) -> str | tuple[int, ...]:
    prompt = field_of(data, "prompt", (str, list, tuple))
    if isinstance(prompt, str):
        if not prompt:
            raise ValidationError("prompt", "must not be empty")
        _check_text("prompt", prompt, limits.max_prompt_chars)
        return prompt
    if not prompt:
        raise ValidationError("prompt", "token id list must not be empty")
    if len(prompt) > limits.max_prompt_token_ids:
        raise ValidationError(
            "prompt", f"must have at most {limits.max_prompt_token_ids} token ids (got {len(prompt)})"
        )
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in prompt):
        raise ValidationError("prompt", "token ids must be integers in [0, 2**31)")
    return tuple(prompt)


def _decode_block_hashes(data: Mapping[str, Any], limits: ProtocolLimits) -> tuple[int, ...]:
    # One hash per full block, so never more than the longest token-id prompt has blocks.
    return block_hash_list(data, "prompt_block_hashes", limits.max_prompt_token_ids // PREFIX_BLOCK_TOKENS + 1)


def block_hash_list(data: Mapping[str, Any], name: str, max_hashes: int) -> tuple[int, ...]:
    """A list field of prefix block hashes, at most ``max_hashes`` of them."""
    hashes = field_of(data, name, (list, tuple), required=False)
    if not hashes:
        return ()
    if len(hashes) > max_hashes:
        raise ValidationError(name, f"must have at most {max_hashes} entries (got {len(hashes)})")
    if not all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**63 for h in hashes):
        raise ValidationError(name, "entries must be integers in [0, 2**63)")
    return tuple(hashes)


def _decode_stop(data: Mapping[str, Any], limits: ProtocolLimits) -> tuple[str, ...]:
    stop = field_of(data, "stop", (list, tuple, str), required=False)
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if len(stop) > limits.max_stop_sequences:
        raise ValidationError("stop", f"must have at most {limits.max_stop_sequences} entries (got {len(stop)})")
    for item in stop:
        if not isinstance(item, str) or not item:
            raise ValidationError("stop", "entries must be non-empty strings")
        _check_text("stop", item, limits.max_stop_chars)
    return tuple(stop)


# --- messages on reply, done, heartbeat and dead-letter streams ---------------------------


def _reply_map(message: Any, kind: str) -> dict[str, Any]:
    """A reply-stream message's fields as a map, ``request_id`` sent as ``id``."""
    data = {f.name: getattr(message, f.name) for f in fields(message)}
    data["id"] = data.pop("request_id")
    return {"v": SCHEMA_VERSION, "kind": kind, **data}


@dataclass(frozen=True)
class Placement:
    """Where the dispatcher placed a request and what it forecasts there, written on the
    request's reply stream when it is queued (before its first chunk; again if it is
    placed again). Forecasts are milliseconds from ``decided_at_s`` (None: the policy
    makes none)."""

    request_id: str
    instance: str
    policy: str
    decided_at_s: float
    predicted_ttft_ms: float | None = None
    predicted_e2e_ms: float | None = None

    def to_map(self) -> dict[str, Any]:
        return _reply_map(self, "placement")

    @classmethod
    def of(cls, request: Request) -> Placement:
        """The placement of a request the dispatcher has assigned."""
        if request.assignment is None:
            raise ValueError(f"{request.id}: no assignment")
        a = request.assignment
        return cls(request.id, a.instance_id, a.policy, a.decided_at_s, a.predicted_ttft_ms, a.predicted_e2e_ms)


@dataclass(frozen=True)
class Chunk:
    """A piece of a request's output on its reply stream. ``index`` counts from 0.

    ``offset_tokens`` is the number of output tokens before this chunk's first one: the
    key readers de-duplicate by, since chunk boundaries differ between executions of a
    request. ``None`` on chunks from writers older than the field (readers then fall back
    to the index)."""

    request_id: str
    index: int
    text: str
    num_tokens: int
    offset_tokens: int | None = None

    def to_map(self) -> dict[str, Any]:
        data = {"v": SCHEMA_VERSION, "kind": "chunk", "id": self.request_id, "index": self.index,
                "text": self.text, "num_tokens": self.num_tokens}
        if self.offset_tokens is not None:
            data["offset_tokens"] = self.offset_tokens
        return data


@dataclass(frozen=True)
class FinalRecord:
    """The last entry on a reply stream. Times in milliseconds; ``None`` when unknown.

    ``status`` is ``ok``, ``cancelled``, ``error`` or ``infeasible`` (the dispatcher
    predicted the request's SLO or deadline could not be met: nothing ran, ``error`` says
    why and ``predicted_ttft_ms`` / ``predicted_e2e_ms`` are the best figures it found); ``index`` is one past the last chunk's
    index, so a reader knows how many chunks precede it.
    """

    request_id: str
    index: int
    status: str
    text: str
    output_tokens: int
    prompt_tokens: int
    instance: str
    finish_reason: str
    queue_wait_ms: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    num_preemptions: int = 0
    predicted_output_tokens: int | None = None
    predicted_ttft_ms: float | None = None
    predicted_e2e_ms: float | None = None
    error: str | None = None
    # Prompt tokens the engine found in its prefix cache, and those the dispatcher predicted
    # it would (None: not known).
    cached_tokens: int | None = None
    predicted_cached_tokens: int | None = None

    def to_map(self) -> dict[str, Any]:
        return _reply_map(self, "final")

    @classmethod
    def from_map(cls, data: Mapping[str, Any]) -> FinalRecord:
        check_envelope(data, "final")
        values = {f.name: data.get(f.name) for f in fields(cls) if f.name != "request_id"}
        return cls(request_id=field_of(data, "id", str), **values)


@dataclass(frozen=True)
class DoneRecord:
    """One entry of the ``done`` stream: the truth about a finished request."""

    request_id: str
    instance: str
    status: str
    prompt_tokens: int
    output_tokens: int
    predicted_output_tokens: int | None
    predictor_version: str | None
    policy: str | None
    submitted_at_s: float
    finished_at_s: float
    queue_wait_ms: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    predicted_ttft_ms: float | None
    predicted_e2e_ms: float | None
    num_preemptions: int
    tenant: str = "default"
    priority: str = "interactive"

    def to_map(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "kind": "done", **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_map(cls, data: Mapping[str, Any]) -> DoneRecord:
        """Every field checked for its type (numbers finite); ValidationError names the first
        that is wrong. Absent optional fields read as None, absent tenant / priority as their
        defaults."""
        check_envelope(data, "done")
        if not field_of(data, "request_id", str):
            raise ValidationError("request_id", "is required")
        values = {f.name: data.get(f.name, f.default) if f.default is not MISSING else data.get(f.name)
                  for f in fields(cls)}
        for name in _DONE_INT_FIELDS:
            field_of(data, name, int, required=name in _DONE_REQUIRED_FIELDS)
        for name in _DONE_FLOAT_FIELDS:
            float_field(data, name, required=False)
        for name in _DONE_STR_FIELDS:
            field_of(data, name, str, required=False)
        return cls(**values)


_DONE_REQUIRED_FIELDS = ("prompt_tokens", "output_tokens")
_DONE_INT_FIELDS = ("prompt_tokens", "output_tokens", "predicted_output_tokens", "num_preemptions")
_DONE_FLOAT_FIELDS = ("submitted_at_s", "finished_at_s", "queue_wait_ms", "ttft_ms", "tpot_ms", "e2e_ms",
                      "predicted_ttft_ms", "predicted_e2e_ms")
_DONE_STR_FIELDS = ("instance", "status", "predictor_version", "policy", "tenant", "priority")


def decode_done_record(raw: bytes) -> DoneRecord:
    """Decode one ``done`` entry; ``ValidationError`` names what is wrong."""
    return DoneRecord.from_map(unpack_map(raw))


def decode_reply_entry(raw: bytes) -> Chunk | FinalRecord | Placement:
    """Decode one entry of a reply stream."""
    data = unpack_map(raw)
    kind = data.get("kind")
    if kind == "placement":
        check_envelope(data, "placement")
        return Placement(request_id=field_of(data, "id", str), instance=field_of(data, "instance", str),
                         policy=field_of(data, "policy", str), decided_at_s=float_field(data, "decided_at_s"),
                         predicted_ttft_ms=float_field(data, "predicted_ttft_ms", required=False),
                         predicted_e2e_ms=float_field(data, "predicted_e2e_ms", required=False))
    if kind == "chunk":
        check_envelope(data, "chunk")
        return Chunk(request_id=field_of(data, "id", str), index=field_of(data, "index", int),
                     text=field_of(data, "text", str), num_tokens=field_of(data, "num_tokens", int),
                     offset_tokens=field_of(data, "offset_tokens", int, required=False))
    return FinalRecord.from_map(data)


# --- msgpack layer ----------------------------------------------------------------------


def encode(message: Any) -> bytes:
    """msgpack bytes of a message (anything with ``to_map()``) or a plain map."""
    data = message.to_map() if hasattr(message, "to_map") else message
    return msgpack.packb(data, use_bin_type=True)


def unpack_map(raw: bytes, limits: ProtocolLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Decode msgpack bytes into a map, bounded by ``limits``; never raises anything but
    :class:`ValidationError`."""
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise ValidationError("message", f"must be bytes (got {type(raw).__name__})")
    if len(raw) > limits.max_message_bytes:
        raise ValidationError(
            "message", f"must be at most {limits.max_message_bytes} bytes (got {len(raw)})"
        )
    try:
        data = msgpack.unpackb(
            raw, raw=False, strict_map_key=True,
            max_str_len=limits.max_message_bytes, max_bin_len=limits.max_message_bytes,
            max_array_len=limits.max_prompt_token_ids, max_map_len=256,
        )
    except Exception as exc:  # msgpack raises many types on garbage; all mean "undecodable"
        raise ValidationError("message", f"not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise ValidationError("message", f"must be a map (got {type(data).__name__})")
    return data


def decode_request(raw: bytes, limits: ProtocolLimits = DEFAULT_LIMITS, *, keys: Keys | None = None) -> Request:
    """Decode and validate a request; raises :class:`ValidationError` naming the field.
    With ``keys``, a reply stream other than ``keys.reply(id)`` is rejected too."""
    return Request.from_map(unpack_map(raw, limits), limits, keys=keys)
