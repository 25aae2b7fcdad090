"""Chat messages rendered to one prompt string.

The default template is ChatML, the format most open chat models are tuned on::

    <|im_start|>system
    You are helpful.<|im_end|>
    <|im_start|>user
    Hello<|im_end|>
    <|im_start|>assistant

(each message as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, then the generation
prompt ``<|im_start|>assistant\\n``). ``plain`` renders ``{role}: {content}`` lines and ends
with ``assistant:``. Any other value of ``--chat-template`` / ``BLOCKQ_GATEWAY_CHAT_TEMPLATE``
is a path to a Jinja2 template in the Hugging Face / vLLM ``--chat-template`` convention:
it sees ``messages`` (list of ``{"role", "content", "name"}``), ``add_generation_prompt``
(true), ``bos_token`` and ``eos_token`` (empty), and runs in Jinja's immutable sandbox.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from blockq.config import ConfigError
from blockq.frontdoors.gateway.openai_requests import ChatMessage

Renderer = Callable[[Sequence[ChatMessage]], str]
BUILTIN_TEMPLATES = ("chatml", "plain")


def render_chatml(messages: Sequence[ChatMessage]) -> str:
    parts = [f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


def render_plain(messages: Sequence[ChatMessage]) -> str:
    lines = [f"{m.role}: {m.content}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


def _jinja_renderer(path: Path) -> Renderer:
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("chat_template: a template file needs the 'jinja2' package") from None
    try:
        source = path.read_text()
    except OSError as exc:
        raise ConfigError(f"chat_template: cannot read {path}: {exc.strerror}") from None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        template = env.from_string(source)
    except TemplateError as exc:
        raise ConfigError(f"chat_template: {path}: {exc}") from None

    def render(messages: Sequence[ChatMessage]) -> str:
        data = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})} for m in messages]
        return template.render(messages=data, add_generation_prompt=True, bos_token="", eos_token="")

    return render


def load_chat_template(spec: str) -> Renderer:
    """The renderer for a template name (``chatml``, ``plain``) or a Jinja2 file path."""
    if spec == "chatml":
        return render_chatml
    if spec == "plain":
        return render_plain
    return _jinja_renderer(Path(spec))
