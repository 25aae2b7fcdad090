"""OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) parsed and
validated into a :class:`GenerationPlan`: the blockq requests to submit for one API call.

Pure functions, no I/O: the HTTP gateway and the batch runner share them. Every problem
raises :class:`blockq.wire.protocol.ValidationError` whose ``field`` is the offending JSON
field (``messages[2].content``, ``stream_options.include_usage``), so callers can answer
with OpenAI's error shape and ``param``.

Accepted and ignored (no effect on the emulated or vLLM engines behind blockq):
``seed``, ``user``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``,
``service_tier``, ``metadata``. Rejected with a named field: ``logprobs``/``top_logprobs``
on completions, ``suffix``, ``best_of`` other than ``n``, ``tools``/``functions``, and
``response_format`` other than ``text``. blockq extensions: ``priority`` (``interactive``
or ``batch``), ``slo_ttft_ms`` (this call's TTFT objective, ms) and ``best_effort`` (serve it
however late: never answered ``infeasible``). vLLM's own sampling extensions, as vLLM's
server takes them: ``ignore_eos`` (generate past EOS, to ``max_tokens``) and ``min_tokens``
(no EOS or stop sequence before this many tokens; at most ``max_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from blockq.client import SubmitSpec
from blockq.wire.protocol import MAX_SLO_TTFT_MS, PRIORITIES, ValidationError, check_min_tokens

ENDPOINT_COMPLETIONS = "completions"
ENDPOINT_CHAT = "chat.completions"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

Prompt = str | tuple[int, ...]


@dataclass(frozen=True)
class RequestDefaults:
    """Server-side defaults and bounds for parsing (all counts are per API call)."""

    completion_max_tokens: int = 16          # OpenAI's default for /v1/completions
    chat_max_tokens: int = 256               # when a chat request names no max_tokens
    max_n: int = 16                          # choices per prompt
    max_prompts: int = 64                    # prompts in one /v1/completions call
    max_messages: int = 1024
    max_choices: int = 128                   # prompts x n
    max_max_tokens: int = 32_768             # the protocol limit (``BLOCKQ_MAX_MAX_TOKENS``)

    def __post_init__(self) -> None:
        for name in ("completion_max_tokens", "chat_max_tokens", "max_n", "max_prompts", "max_messages",
                     "max_choices", "max_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1 (got {getattr(self, name)})")


@dataclass(frozen=True)
class GenerationPlan:
    """One API call as blockq requests: ``len(prompts) * n`` choices, prompt-major
    (choice ``i`` generates from ``prompts[i // n]``)."""

    endpoint: str
    model: str
    prompts: tuple[Prompt, ...]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    echo: bool
    priority: str
    slo_ttft_ms: float | None = None
    best_effort: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    # The name each request carries to the dispatcher (Request.model): a model or adapter
    # instances serve; None (the gateway's own names, BLOCKQ_GATEWAY_MODEL_NAMES): any instance.
    routed_model: str | None = None

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, choice_index: int) -> Prompt:
        return self.prompts[choice_index // self.n]

    def request_ids(self, base_id: str) -> list[str]:
        """Request id of every choice: ``base_id`` alone for one choice, else ``base_id-i``."""
        if self.num_choices == 1:
            return [base_id]
        return [f"{base_id}-{i}" for i in range(self.num_choices)]

    def submit_specs(self, base_id: str, tenant: str, priority: str | None = None) -> list[SubmitSpec]:
        """One :class:`SubmitSpec` per choice, with deterministic ids from ``base_id``."""
        return [
            SubmitSpec(prompt=self.prompt_of(i), max_tokens=self.max_tokens, temperature=self.temperature,
                       top_p=self.top_p, stop=self.stop, priority=priority or self.priority, tenant=tenant,
                       request_id=request_id, slo_ttft_ms=self.slo_ttft_ms, best_effort=self.best_effort,
                       ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, model=self.routed_model)
            for i, request_id in enumerate(self.request_ids(base_id))
        ]


# --- JSON size/depth ------------------------------------------------------------------------

# Only brackets outside strings count, and only their nesting, not their kind: a body whose
# brackets do not match is invalid JSON that json.loads refuses next, at the first mismatch,
# having nested no deeper than this count. Every step is a C loop over the text (count,
# replace, split, translate), so a 4 MiB body costs milliseconds of the event loop; the
# regex scan this replaces took 0.2-0.4 s there (docs/gateway.md).
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_BRACKETS_AS_SQUARE = bytes.maketrans(b"{}", b"[]")


def check_json_depth(text: str, max_depth: int) -> None:
    """Raise ValidationError("body") when arrays/objects nest deeper than ``max_depth``.

    Runs before ``json.loads`` so that a hostile body cannot exhaust the parser's recursion;
    strings are stripped first so brackets inside them do not count. Exact for valid JSON;
    invalid JSON with too many unclosed brackets is refused as too deep.
    """
    if text.count("[") + text.count("{") <= max_depth:
        return  # too few brackets to nest deeper, wherever they are: most bodies stop here
    if "\\" in text:
        # Escapes as a parser reads them, left to right: escaped backslashes, then escaped
        # quotes. The quotes left delimit strings.
        text = text.replace("\\\\", "").replace('\\"', "")
    outside = "".join(text.split('"')[::2])  # the even pieces between quotes are outside strings
    brackets = outside.encode("utf-8", "surrogatepass").translate(_BRACKETS_AS_SQUARE, _NOT_BRACKETS)
    too_deep = b"[" * (max_depth + 1)
    num_passes = 0
    while brackets:
        if too_deep in brackets:  # each opener of a run is inside the one before it
            raise ValidationError("body", f"JSON nesting deeper than {max_depth} levels")
        # One level a pass: ``[[]]`` becomes ``[]``, as replace does not look again at
        # what it joined. What no pass reduces is unmatched.
        reduced = brackets.replace(b"[]", b"")
        if num_passes == max_depth or len(reduced) == len(brackets):
            break
        brackets, num_passes = reduced, num_passes + 1
    # The pairs removed nest at most num_passes deep; each opener left adds at most one level.
    if num_passes + brackets.count(b"[") > max_depth:
        raise ValidationError("body", f"JSON nesting deeper than {max_depth} levels")


# --- field readers --------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _read(body: Mapping[str, Any], name: str, check: Callable[[Any], bool], expected: str,
          default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise ValidationError(name, f"must be {expected} (got {type(value).__name__})")
    return value


def _read_int(body: Mapping[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    value = _read(body, name, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer", default)
    if value is not None and not low <= value <= high:
        raise ValidationError(name, f"must be between {low} and {high} (got {value})")
    return value


def _read_float(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = float(_read(body, name, _is_number, "a number", default))
    if not low <= value <= high:
        raise ValidationError(name, f"must be between {low} and {high} (got {value})")
    return value


def _read_optional_float(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    if body.get(name) is None:
        return None
    return _read_float(body, name, 0.0, low, high)


def _read_bool(body: Mapping[str, Any], name: str) -> bool:
    return bool(_read(body, name, lambda v: isinstance(v, bool), "a boolean", False))


def _read_top_p(body: Mapping[str, Any]) -> float:
    top_p = _read_float(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0.0:
        raise ValidationError("top_p", f"must be in (0, 1] (got {top_p})")
    return top_p


def _read_stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValidationError("stop", "must be a non-empty string or a list of non-empty strings")
    return tuple(stop)


def _read_common(body: Any, max_tokens_default: int, defaults: RequestDefaults) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise ValidationError("body", "must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ValidationError("model", "is required and must be a non-empty string")
    n = _read_int(body, "n", 1, 1, defaults.max_n)
    best_of = _read_int(body, "best_of", None, 1, defaults.max_n)
    if best_of is not None and best_of != n:
        raise ValidationError("best_of", "only best_of equal to n is supported")
    stream = _read_bool(body, "stream")
    options = _read(body, "stream_options", lambda v: isinstance(v, Mapping), "an object", {})
    include_usage = _read_bool(options, "include_usage") if options else False
    if options and not stream:
        raise ValidationError("stream_options", "is only allowed when stream is true")
    for name in ("presence_penalty", "frequency_penalty"):
        _read_float(body, name, 0.0, -2.0, 2.0)
    _read_int(body, "seed", None, -(2**63), 2**64 - 1)
    _read(body, "user", lambda v: isinstance(v, str), "a string")
    _read(body, "logit_bias", lambda v: isinstance(v, Mapping), "an object")
    priority = _read(body, "priority", lambda v: isinstance(v, str), "a string", "interactive")
    if priority not in PRIORITIES:
        raise ValidationError("priority", f"must be one of {', '.join(PRIORITIES)} (got {priority!r})")
    return {
        "model": model, "n": n, "stream": stream, "include_usage": include_usage, "priority": priority,
        "slo_ttft_ms": _read_optional_float(body, "slo_ttft_ms", 1.0, MAX_SLO_TTFT_MS),
        "best_effort": _read_bool(body, "best_effort"),
        "ignore_eos": _read_bool(body, "ignore_eos"),
        # Bounded by max_tokens in _plan, once a chat body's max_completion_tokens is applied.
        "min_tokens": _read_int(body, "min_tokens", 0, 0, defaults.max_max_tokens),
        "temperature": _read_float(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _read_top_p(body),
        "max_tokens": _read_int(body, "max_tokens", max_tokens_default, 1, defaults.max_max_tokens),
        "stop": _read_stop(body),
    }


# --- completions ----------------------------------------------------------------------------


def _token_ids(value: Sequence[Any], name: str) -> tuple[int, ...]:
    if not value:
        raise ValidationError(name, "must not be empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in value):
        raise ValidationError(name, "token ids must be integers in [0, 2**31)")
    return tuple(value)


def _read_prompts(body: Mapping[str, Any], defaults: RequestDefaults) -> tuple[Prompt, ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise ValidationError("prompt", "is required")
    if isinstance(prompt, str):
        prompts: list[Prompt] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [_token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    elif isinstance(prompt, list):
        prompts = [_token_ids(prompt, "prompt")]
    else:
        raise ValidationError("prompt", "must be a string, a list of strings, or token ids")
    if len(prompts) > defaults.max_prompts:
        raise ValidationError("prompt", f"at most {defaults.max_prompts} prompts per request (got {len(prompts)})")
    for i, p in enumerate(prompts):
        if isinstance(p, str) and not p:
            raise ValidationError("prompt" if len(prompts) == 1 else f"prompt[{i}]", "must not be empty")
    return tuple(prompts)


def parse_completion_request(body: Any, defaults: RequestDefaults = RequestDefaults()) -> GenerationPlan:
    """Validate a ``/v1/completions`` body; raises ValidationError naming the field."""
    common = _read_common(body, defaults.completion_max_tokens, defaults)
    prompts = _read_prompts(body, defaults)
    if body.get("logprobs") is not None:
        raise ValidationError("logprobs", "is not supported")
    if body.get("suffix") is not None:
        raise ValidationError("suffix", "is not supported")
    echo = _read_bool(body, "echo")
    if echo and not all(isinstance(p, str) for p in prompts):
        raise ValidationError("echo", "is only supported with text prompts")
    return _plan(ENDPOINT_COMPLETIONS, common, prompts, echo, defaults)


def _plan(endpoint: str, common: dict[str, Any], prompts: tuple[Prompt, ...], echo: bool,
          defaults: RequestDefaults) -> GenerationPlan:
    if len(prompts) * common["n"] > defaults.max_choices:
        raise ValidationError("n", f"prompts x n must be at most {defaults.max_choices}")
    check_min_tokens(common["min_tokens"], common["max_tokens"])
    return GenerationPlan(endpoint=endpoint, prompts=prompts, echo=echo, **common)


# --- chat completions -----------------------------------------------------------------------


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None


def _message_text(content: Any, name: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValidationError(f"{name}[{i}]", "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ValidationError(name, "must be a string or a list of text parts")


def read_messages(body: Mapping[str, Any], defaults: RequestDefaults) -> tuple[ChatMessage, ...]:
    """The ``messages`` of a chat body, validated (roles, text-only content)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValidationError("messages", "is required and must be a non-empty list")
    if len(messages) > defaults.max_messages:
        raise ValidationError("messages", f"at most {defaults.max_messages} messages (got {len(messages)})")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValidationError(f"messages[{i}]", "must be an object")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValidationError(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)} (got {role!r})")
        content = message.get("content")
        text = "" if content is None and role == "assistant" else _message_text(content, f"messages[{i}].content")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise ValidationError(f"messages[{i}].name", "must be a string")
        out.append(ChatMessage(role=role, content=text, name=name))
    return tuple(out)


def parse_chat_request(body: Any, render: Callable[[Sequence[ChatMessage]], str],
                       defaults: RequestDefaults = RequestDefaults()) -> GenerationPlan:
    """Validate a ``/v1/chat/completions`` body and render its messages with ``render``."""
    common = _read_common(body, defaults.chat_max_tokens, defaults)
    completion_tokens = _read_int(body, "max_completion_tokens", None, 1, defaults.max_max_tokens)
    if completion_tokens is not None:
        common["max_tokens"] = completion_tokens
    messages = read_messages(body, defaults)
    if body.get("logprobs"):
        raise ValidationError("logprobs", "is not supported")
    for name in ("tools", "functions"):
        if body.get(name):
            raise ValidationError(name, "is not supported")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, Mapping)
                                        or response_format.get("type") != "text"):
        raise ValidationError("response_format", "only {\"type\": \"text\"} is supported")
    prompt = render(messages)
    if not prompt:
        raise ValidationError("messages", "render to an empty prompt")
    return _plan(ENDPOINT_CHAT, common, (prompt,), False, defaults)
