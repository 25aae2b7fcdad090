"""Heartbeats on the wire: what a worker reports of its engine every beat, and its
validation (the rest of the wire format is :mod:`blockq.wire.protocol`)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from itertools import chain
from operator import itemgetter
from typing import Any, NamedTuple

from blockq.engine_model.config import INTERCONNECTS, MAX_GPU_NAME_CHARS, EngineConfig
from blockq.engine_model.latency import check_latency_model_dict
from blockq.wire.health import REPORTED_STATES
from blockq.wire.protocol import (
    SCHEMA_VERSION,
    ValidationError,
    block_hash_list,
    check_envelope,
    field_of,
    float_field,
    unpack_map,
)
from blockq.wire.served_models import MAX_NAME_CHARS, check_adapter_lists

MAX_HEARTBEAT_REQUESTS = 256  # per list; longer lists are truncated and flagged
# Output blocks newly cached per beat: a beat every 100 ms rarely finishes more than a few
# requests; past this the oldest are dropped (the dispatcher then predicts fewer hits).
MAX_HEARTBEAT_CACHED_BLOCKS = 4096
MAX_REQUEST_ID_CHARS = 256
MAX_HARDWARE_NAME_CHARS = MAX_GPU_NAME_CHARS


class RequestProgress(NamedTuple):
    """One request as an engine reports it in a heartbeat (a named tuple: a worker builds
    one per request per beat, so it must be cheap to build).

    ``predicted_output_tokens`` / ``p90_tokens`` / ``p10_tokens`` are total output tokens:
    the request's first guess, or, when ``refined_at_tokens`` is set, the refinement made
    from its partial output after that many generated tokens (:mod:`workers.refinement`).
    ``lora_adapter``: the LoRA adapter the request runs with, by name (None: the base
    model), so that the dispatcher's replica runs the ``max_loras`` rule and the loads
    (docs/dispatcher.md, "Models and adapters"). Beats of older workers carry the first
    six or eight fields only; an entry carries the ninth only when it names an adapter."""

    request_id: str
    prompt_tokens: int
    num_computed_tokens: int
    num_generated_tokens: int
    predicted_output_tokens: int | None = None
    p90_tokens: int | None = None
    p10_tokens: int | None = None
    refined_at_tokens: int | None = None
    lora_adapter: str | None = None

    def to_list(self) -> list[Any]:
        if self.lora_adapter is None:
            if self.refined_at_tokens is None and self.p10_tokens is None:
                return list(self[:6])  # the common case stays as small as it was
            return list(self[:8])
        return list(self)

    @classmethod
    def from_list(cls, values: list[Any], list_name: str = "running") -> RequestProgress:
        """Decode one entry of ``list_name``: an id, then counts that are ints in [0, 2**31)
        (the last four may be None), then (9 elements) an adapter name of 1-256 characters
        or None; anything else is refused naming the list."""
        if not isinstance(values, list | tuple) or len(values) not in (6, 8, 9):
            raise ValidationError(list_name, "entries must be 6-, 8- or 9-element lists")
        request_id, *counts = values[:8]
        if len(values) == 9 and not _is_adapter_name(values[8]):
            raise ValidationError(list_name, f"entry {request_id!r}: the adapter must be None or a name of "
                                             f"1-{MAX_NAME_CHARS} characters")
        if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
            raise ValidationError(list_name, f"request ids must be strings of 1-{MAX_REQUEST_ID_CHARS} characters")
        for position, count in enumerate(counts):
            if count is None and position >= 3:
                continue
            if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count < 2**31:
                raise ValidationError(list_name, f"entry {request_id!r}: counts must be ints in [0, 2**31) "
                                                 f"(got {count!r})")
        return cls(*values)


@dataclass(frozen=True)
class Heartbeat:
    """What a worker publishes every heartbeat interval about one engine instance.

    ``sent_at_s`` is wall-clock time; ``engine_time_s`` the engine's own (model) clock.
    ``step_samples`` are recent steps as (prefill tokens, decode seqs, KV tokens attended,
    seconds, prefill attention pairs). ``finished_ids`` lists requests finished since the previous beat;
    ``finished_sizes`` the (prompt tokens, output tokens) of those answered ``ok`` (what the
    autoscaler sizes future arrivals with: realized lengths, not predicted ones). When a
    list had to be cut to :data:`MAX_HEARTBEAT_REQUESTS`, ``truncated`` is true and the
    ``num_*_total`` fields keep the real counts. ``lag_p99_ms`` / ``lag_mean_ms``: how late
    the engine's recent steps ended against their schedule (model ms; an emulated engine on
    a busy host; 0 for a real engine), the p99 and the mean. ``state_at_s``: the engine
    (model) time at which ``running`` and ``waiting`` hold, at a step boundary: an engine
    that reports the state a step under way will leave gives that step's end; None (older
    beats): ``engine_time_s``. ``cached_block_hashes``: with prefix caching, the block
    hashes (:mod:`blockq.text.block_hashes`) of the output blocks that requests finished since the
    previous beat left in the prefix cache (the engine caches a block once it is full, prompt
    or output), at most :data:`MAX_HEARTBEAT_CACHED_BLOCKS`: what the dispatcher's prefix
    index cannot know from the prompts it placed; an engine that names every block it
    caches and evicts (vLLM's KV events) lists them all there, and those evicted since the
    previous beat in ``evicted_block_hashes`` (a block is in one list or neither: the later
    of its events wins). ``delivery_p90_ms``: the p90 of the
    wall ms from a placement's decision (the assignment's ``decided_at_s``) to the
    worker handing the request to its engine, over the worker's recent requests (None
    before the first): how long after a decision a step must start to include the request.
    """

    instance_id: str
    state: str
    seq: int
    sent_at_s: float
    engine_time_s: float
    model: str
    preset: str
    engine_config: dict[str, Any]
    latency_model: dict[str, Any] | None
    num_used_blocks: int
    # Tuples when built; a decoded beat's are ProgressLists (equal to the tuples).
    running: Sequence[RequestProgress]
    waiting: Sequence[RequestProgress]
    num_running_total: int
    num_waiting_total: int
    finished_ids: tuple[str, ...] = ()
    finished_sizes: tuple[tuple[int, int], ...] = ()
    step_samples: tuple[tuple[int | float, ...], ...] = ()
    lag_p99_ms: float = 0.0
    lag_mean_ms: float = 0.0
    time_scale: float = 1.0
    truncated: bool = False
    # Counters the engine reports itself, as it names them (vLLM: num_running_reqs,
    # num_waiting_reqs, kv_cache_usage, num_preemptions_total, prefix_cache_*_total).
    engine_stats: dict[str, Any] | None = None
    state_at_s: float | None = None
    cached_block_hashes: tuple[int, ...] = ()
    delivery_p90_ms: float | None = None
    evicted_block_hashes: tuple[int, ...] = ()

    def to_map(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["running"] = [r.to_list() for r in self.running]
        data["waiting"] = [r.to_list() for r in self.waiting]
        data["finished_ids"] = list(self.finished_ids)
        data["finished_sizes"] = [list(s) for s in self.finished_sizes]
        data["step_samples"] = [list(s) for s in self.step_samples]
        data["cached_block_hashes"] = list(self.cached_block_hashes)
        data["evicted_block_hashes"] = list(self.evicted_block_hashes)
        return {"v": SCHEMA_VERSION, "kind": "heartbeat", **data}

    @classmethod
    def from_map(cls, data: Mapping[str, Any], *, engine_model_checked: bool = False) -> Heartbeat:
        """Decode and validate; ``engine_model_checked``: the caller knows this beat's
        ``engine_config`` and ``latency_model`` passed the check before
        (:class:`HeartbeatDecoder`), which is then skipped."""
        check_envelope(data, "heartbeat")
        state = field_of(data, "state", str)
        if state not in REPORTED_STATES:
            raise ValidationError("state", f"must be one of {', '.join(REPORTED_STATES)} (got {state!r})")
        values = {name: data.get(name) for name in _FIELD_NAMES}
        values["running"] = _progress_list(data, "running")
        values["waiting"] = _progress_list(data, "waiting")
        values["finished_ids"] = _finished_ids(data.get("finished_ids") or ())
        values["finished_sizes"] = _finished_sizes(data.get("finished_sizes") or ())
        for name in ("model", "preset"):
            field_of(data, name, str)
        values["truncated"] = bool(field_of(data, "truncated", bool, required=False))
        values["engine_stats"] = field_of(data, "engine_stats", dict, required=False)
        values["lag_mean_ms"] = float_field(data, "lag_mean_ms") if "lag_mean_ms" in data else 0.0
        values["state_at_s"] = float_field(data, "state_at_s", required=False)
        values["delivery_p90_ms"] = float_field(data, "delivery_p90_ms", required=False)
        values["cached_block_hashes"] = block_hash_list(data, "cached_block_hashes", MAX_HEARTBEAT_CACHED_BLOCKS)
        values["evicted_block_hashes"] = block_hash_list(data, "evicted_block_hashes", MAX_HEARTBEAT_CACHED_BLOCKS)
        field_of(data, "instance_id", str)
        field_of(data, "seq", int)
        float_field(data, "sent_at_s")
        values["engine_time_s"] = float_field(data, "engine_time_s")
        for name in ("num_used_blocks", "num_running_total", "num_waiting_total"):
            values[name] = _count(data, name)
        if "time_scale" in data:
            values["time_scale"] = float_field(data, "time_scale")
            if values["time_scale"] <= 0:
                raise ValidationError("time_scale", f"must be > 0 (got {values['time_scale']})")
        if "lag_p99_ms" in data:
            values["lag_p99_ms"] = float_field(data, "lag_p99_ms")
        values["step_samples"] = _step_samples(data.get("step_samples") or ())
        if not engine_model_checked:
            _check_engine_model(data)
        return cls(**values)


_FIELD_NAMES = tuple(f.name for f in fields(Heartbeat))  # fields() per beat was a tenth of decoding one


class HeartbeatDecoder:
    """:func:`decode_heartbeat` for a reader of every beat of a fleet: an instance's engine
    config and latency model are checked when they differ from those of its last beat
    that decoded, not at every beat (they change when the engine restarts or refits, and
    the check was a fifth of a beat's decoding). While they do not differ, the beat carries
    the previous beat's objects: a reader that compares them with its last beat's finds them
    identical at once, and frees none (comparing and freeing a fresh copy at every beat was
    a tenth of applying one at 1,024 instances: docs/results/decisions-at-scale.md)."""

    def __init__(self) -> None:
        self._checked: dict[str, tuple[Any, Any]] = {}  # instance id -> (engine_config, latency_model)

    def decode(self, raw: bytes) -> Heartbeat:
        data = unpack_map(raw)
        instance_id = data.get("instance_id")
        known = self._checked.get(instance_id) if isinstance(instance_id, str) else None
        engine_model = (data.get("engine_config"), data.get("latency_model"))
        unchanged = known is not None and known == engine_model
        if unchanged:
            data["engine_config"], data["latency_model"] = engine_model = known
        beat = Heartbeat.from_map(data, engine_model_checked=unchanged)
        self._checked[beat.instance_id] = engine_model
        return beat


def _progress_list(data: Mapping[str, Any], name: str) -> Sequence[RequestProgress]:
    entries = field_of(data, name, list)
    if len(entries) > MAX_HEARTBEAT_REQUESTS:
        raise ValidationError(name, f"must have at most {MAX_HEARTBEAT_REQUESTS} entries (got {len(entries)})")
    progress = _well_formed_progress(entries)
    if progress is not None:
        return progress
    return tuple(RequestProgress.from_list(v, name) for v in entries)  # raises, naming the bad entry


def _well_formed_progress(entries: list[Any]) -> ProgressList | None:
    """``entries`` as :meth:`RequestProgress.from_list` would decode them, checked list-wide
    with builtins (a beat lists ~70 requests; checking them one by one was most of
    decoding it, and most beats a dispatcher applies are never read entry by entry); None
    when any entry is not well formed (the caller then finds which, and why)."""
    if not entries:
        return ProgressList([])
    if set(map(type, entries)) != {list}:
        return None  # types first: len() of a non-list entry (a null, a number) would raise
    lengths = set(map(len, entries))
    if not lengths <= {6, 8, 9}:
        return None
    if 9 in lengths and not all(_is_adapter_name(entry[8]) for entry in entries if len(entry) == 9):
        return None
    ids = list(map(_FIRST, entries))
    if set(map(type, ids)) != {str} or min(map(len, ids)) < 1 or max(map(len, ids)) > MAX_REQUEST_ID_CHARS:
        return None
    required = list(chain.from_iterable(map(_REQUIRED_COUNTS, entries)))
    optional = list(chain.from_iterable(map(_OPTIONAL_COUNTS, entries)))
    if None in optional:
        optional = [count for count in optional if count is not None]
    for counts in (required, optional):
        if counts and (set(map(type, counts)) != {int} or min(counts) < 0 or max(counts) >= 2**31):
            return None
    return ProgressList(entries)


_FIRST = itemgetter(0)
_REQUIRED_COUNTS = itemgetter(1, 2, 3)
_OPTIONAL_COUNTS = itemgetter(slice(4, 8))


def _is_adapter_name(value: Any) -> bool:
    return value is None or (isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS)


class ProgressList(Sequence[RequestProgress]):
    """A decoded beat's request list: checked when decoded (:func:`_well_formed_progress`),
    made into :class:`RequestProgress` entries only when read entry by entry (a dispatcher
    reads a beat's lists only when a decision rebuilds its replica); equal to the tuple of
    its entries."""

    __slots__ = ("_raw", "_items")

    def __init__(self, raw: list[list[Any]]) -> None:
        self._raw: list[list[Any]] | None = raw
        self._items: tuple[RequestProgress, ...] | None = None

    def _made(self) -> tuple[RequestProgress, ...]:
        if self._items is None:
            assert self._raw is not None
            self._items = tuple([RequestProgress(*values) for values in self._raw])
            self._raw = None
        return self._items

    def column(self, position: int) -> list[Any]:
        """One field of every entry (0: the request ids), without making the entries."""
        return list(map(itemgetter(position), self._raw if self._raw is not None else self._made()))

    def values(self) -> Sequence[Sequence[Any]]:
        """The entries as decoded lists (6, 8 or 9 values), or as entries once made."""
        return self._raw if self._raw is not None else self._made()

    def __len__(self) -> int:
        return len(self._raw) if self._raw is not None else len(self._made())

    def __getitem__(self, index):  # type: ignore[no-untyped-def]  # int or slice, as tuple's
        return self._made()[index]

    def __iter__(self) -> Iterator[RequestProgress]:
        return iter(self._made())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ProgressList | tuple):
            return self._made() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._made())

    def __repr__(self) -> str:
        return repr(self._made())


def progress_values(progress: Sequence[RequestProgress]) -> Sequence[Sequence[Any]]:
    """A beat's list entry by entry as :class:`RequestProgress` fields in order (a decoded
    one's entries as decoded, 6, 8 or 9 values, without making them into entries: a replica
    rebuild reads every entry once)."""
    if type(progress) is ProgressList:  # not isinstance: a Sequence's check is an ABC's, every beat
        return progress.values()
    return progress


def progress_column(progress: Sequence[RequestProgress], position: int) -> list[Any]:
    """One field of every entry of a beat's list (0: the request ids, 1: the prompt
    tokens), of a decoded one without making its entries."""
    if type(progress) is ProgressList:
        return progress.column(position)
    return list(map(itemgetter(position), progress))


def _finished_ids(values: Any) -> tuple[str, ...]:
    if not isinstance(values, list | tuple) or not all(
            isinstance(v, str) and 0 < len(v) <= MAX_REQUEST_ID_CHARS for v in values):
        raise ValidationError("finished_ids", f"must be a list of strings of 1-{MAX_REQUEST_ID_CHARS} characters")
    return tuple(values)


def _count(data: Mapping[str, Any], name: str) -> int:
    value = field_of(data, name, int)
    if value < 0:
        raise ValidationError(name, f"must be >= 0 (got {value})")
    return value


def _step_samples(values: Any) -> tuple[tuple[int | float, ...], ...]:
    """Lists of 4 or 5 finite numbers >= 0 (a NaN would poison the latency refit)."""
    if not isinstance(values, list | tuple) or not all(
            isinstance(v, list | tuple) and len(v) in (4, 5)
            and all(isinstance(n, int | float) and not isinstance(n, bool) and math.isfinite(n) and n >= 0
                    for n in v) for v in values):
        raise ValidationError("step_samples", "must be a list of 4- or 5-element lists of finite numbers >= 0")
    return tuple(tuple(v) for v in values)


def _check_engine_model(data: Mapping[str, Any]) -> None:
    """The engine config's fields have their types and are finite, and the latency model
    would build (checked without building it: this runs for every beat), or the beat is
    refused here, naming the field: a value that is not (an infinite
    block count) would otherwise raise inside the dispatcher's view, beat after beat."""
    config = field_of(data, "engine_config", dict)
    check_adapter_lists(config)
    for spec in fields(EngineConfig):
        value = config.get(spec.name)
        if value is None:
            continue
        default = spec.default
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, str):  # the hardware's names
            ok = isinstance(value, str) and len(value) <= MAX_HARDWARE_NAME_CHARS
        elif isinstance(default, int):  # counts and sizes: 2**31 is far past any engine's
            ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31
        else:
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if spec.name == "interconnect" and value not in INTERCONNECTS:
            raise ValidationError("engine_config", f"interconnect: must be one of "
                                                   f"{', '.join(INTERCONNECTS)} (got {value!r:.80})")
        if not ok:
            raise ValidationError("engine_config", f"{spec.name}: must be a finite "
                                                   f"{type(default).__name__} (got {value!r:.80})")
    latency = field_of(data, "latency_model", dict, required=False)
    if latency is not None:
        try:
            check_latency_model_dict(latency)
        except (TypeError, ValueError) as exc:
            raise ValidationError("latency_model", str(exc)) from None


def _finished_sizes(values: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(values, list | tuple) or not all(
            isinstance(v, list | tuple) and len(v) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**31 for n in v)
            for v in values):
        raise ValidationError("finished_sizes", "must be a list of [prompt tokens, output tokens] pairs of ints >= 0")
    return tuple((int(v[0]), int(v[1])) for v in values)


def decode_heartbeat(raw: bytes) -> Heartbeat:
    return Heartbeat.from_map(unpack_map(raw))
