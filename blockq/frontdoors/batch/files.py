"""Where a batch job's files may be, and how much of its input is read.

A job is data that anyone able to write to the cluster's Redis can forge: a worker that
read and wrote whatever paths a job names would read, and overwrite, any file its user
can. So every path a job names is resolved (symlinks followed, ``..`` normalised) and must
lie under its root: the input file and a chat template file under the input root, the
results and errors files under the output root. The worker checks before it reads,
writes or leases anything; ``blockq batch submit`` checks the same, so that a user learns
at once (docs/batch.md).

================================  ============================================================
``BLOCKQ_BATCH_INPUT_ROOT``       where inputs and chat templates may be read (``--input-root``;
                                  default: the current directory)
``BLOCKQ_BATCH_OUTPUT_ROOT``      where results and errors may be written (``--output-root``;
                                  default: the input root)
``BLOCKQ_BATCH_MAX_LINE_BYTES``   longest input line, bytes (``--max-line-bytes``; 4 MiB)
``BLOCKQ_BATCH_MAX_LINES``        most lines in an input file (``--max-lines``; 50,000)
================================  ============================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from blockq.config import ConfigError
from blockq.frontdoors.batch.lines import DEFAULT_MAX_LINE_BYTES, DEFAULT_MAX_LINES, LineLimits
from blockq.frontdoors.gateway.chat_template import BUILTIN_TEMPLATES, Renderer, load_chat_template
from blockq.frontdoors.gateway.openai_requests import ChatMessage
from blockq.wire.protocol import ValidationError

if TYPE_CHECKING:
    from blockq.frontdoors.batch.runner import BatchOptions

ENV_INPUT_ROOT = "BLOCKQ_BATCH_INPUT_ROOT"
ENV_OUTPUT_ROOT = "BLOCKQ_BATCH_OUTPUT_ROOT"
ENV_MAX_LINE_BYTES = "BLOCKQ_BATCH_MAX_LINE_BYTES"
ENV_MAX_LINES = "BLOCKQ_BATCH_MAX_LINES"
# Hugging Face chat templates are a few KiB; a larger "template" is not one.
MAX_CHAT_TEMPLATE_BYTES = 1 << 20
# Paths in messages are cut: a forged job may name a megabyte-long one.
MAX_SHOWN_CHARS = 300
_ROOT_SOURCES = {"input root": f"--input-root, {ENV_INPUT_ROOT}", "output root": f"--output-root, {ENV_OUTPUT_ROOT}"}


class JobFileRefused(ConfigError):
    """A job names a path outside its root, or a chat template that may not be used; the
    message names the job's field and the root."""


@dataclass(frozen=True)
class BatchFilesConfig:
    """The roots a batch job's files must lie under (absolute directories) and the limits
    on reading its input. Build it with :meth:`from_env` (flags over environment over
    defaults); the worker hands it to the jobs it runs through :meth:`to_env`."""

    input_root: Path
    output_root: Path
    limits: LineLimits = field(default_factory=LineLimits)

    def __post_init__(self) -> None:
        for name in ("input_root", "output_root"):
            root = getattr(self, name)
            if not root.is_absolute():
                raise ConfigError(f"{name}: must be an absolute path (got {root})")
            if not root.is_dir():
                raise ConfigError(f"{name}: not a directory: {root}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, cwd: Path | None = None,
                 input_root: Path | None = None, output_root: Path | None = None,
                 max_line_bytes: int | None = None, max_lines: int | None = None) -> BatchFilesConfig:
        """The keyword arguments that are not None (flags) over ``BLOCKQ_BATCH_*`` over the
        defaults: input root ``cwd`` (the current directory), output root = input root.
        Roots are resolved. A default root of ``/`` (a service started without a working
        directory) is refused: it would confine nothing."""
        env = os.environ if env is None else env
        cwd = (cwd or Path.cwd()).resolve()
        raw_input = input_root or env.get(ENV_INPUT_ROOT) or None
        if raw_input is None and cwd == Path(cwd.anchor):
            raise ConfigError(f"input_root: not set, and the current directory is {cwd}, which would confine "
                              f"nothing; pass --input-root or set {ENV_INPUT_ROOT}")
        input_path = (cwd / raw_input).resolve() if raw_input else cwd
        raw_output = output_root or env.get(ENV_OUTPUT_ROOT) or None
        output_path = (cwd / raw_output).resolve() if raw_output else input_path
        if max_line_bytes is None:
            max_line_bytes = _env_int(env, ENV_MAX_LINE_BYTES, DEFAULT_MAX_LINE_BYTES)
        if max_lines is None:
            max_lines = _env_int(env, ENV_MAX_LINES, DEFAULT_MAX_LINES)
        limits = LineLimits(max_line_bytes=max_line_bytes, max_lines=max_lines)
        return cls(input_root=input_path, output_root=output_path, limits=limits)

    def to_env(self) -> dict[str, str]:
        """The ``BLOCKQ_BATCH_*`` variables :meth:`from_env` reads back as this config."""
        return {ENV_INPUT_ROOT: str(self.input_root), ENV_OUTPUT_ROOT: str(self.output_root),
                ENV_MAX_LINE_BYTES: str(self.limits.max_line_bytes), ENV_MAX_LINES: str(self.limits.max_lines)}


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name) or None
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}: must be a whole number (got {raw[:MAX_SHOWN_CHARS]!r})") from None


@dataclass(frozen=True)
class JobFiles:
    """A job's files once checked: resolved paths under their roots, and its renderer."""

    input_path: Path
    output_path: Path
    errors_path: Path
    render: Renderer


def confine_path(field_name: str, raw: object, root: Path, root_name: str) -> Path:
    """``raw`` resolved (symlinks followed, ``..`` normalised), which must be an absolute
    path under ``root`` (itself resolved); raises :class:`JobFileRefused` naming
    ``field_name`` and the root otherwise. Nothing is opened."""
    root = root.resolve()
    where = f"the {root_name} {root} ({_ROOT_SOURCES.get(root_name, root_name)})"
    shown = repr(raw)[:MAX_SHOWN_CHARS]
    if not isinstance(raw, str) or not Path(raw).is_absolute():
        raise JobFileRefused(f"{field_name}: must be an absolute path under {where} (got {shown})")
    try:
        resolved = Path(raw).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a NUL byte
        raise JobFileRefused(f"{field_name}: cannot resolve {shown} ({exc}); paths must lie under {where}") from None
    if not resolved.is_relative_to(root):
        through = "" if resolved == Path(raw) else f" (through a link or '..': {str(resolved)[:MAX_SHOWN_CHARS]})"
        raise JobFileRefused(f"{field_name}: {shown}{through} is outside {where}")
    return resolved


def check_job_files(options: BatchOptions, config: BatchFilesConfig) -> JobFiles:
    """Check every file ``options`` names against ``config`` (raises :class:`JobFileRefused`
    naming the field): the input a regular file under the input root; results and errors
    under the output root, in existing directories, apart from each other and the input;
    the chat template as :func:`check_chat_template`. Reads only the template."""
    input_path = confine_path("input_path", options.input_path, config.input_root, "input root")
    output_path = confine_path("output_path", options.output_path, config.output_root, "output root")
    errors_path = confine_path("errors_path", options.errors_path, config.output_root, "output root")
    if not input_path.is_file():
        raise JobFileRefused(f"input_path: not a regular file: {input_path}")
    for name, path in (("output_path", output_path), ("errors_path", errors_path)):
        if not path.parent.is_dir():
            raise JobFileRefused(f"{name}: directory does not exist: {path.parent}")
        if path.is_dir():
            raise JobFileRefused(f"{name}: is a directory: {path}")
    if len({input_path, output_path, errors_path}) < 3:
        raise JobFileRefused(f"output_path, errors_path: must differ from each other and from the input "
                             f"({output_path}, {errors_path}, {input_path})")
    render = check_chat_template(options.chat_template, config.input_root)
    return JobFiles(input_path, output_path, errors_path, render)


def check_chat_template(spec: object, input_root: Path) -> Renderer:
    """The renderer for a job's ``chat_template``: a built-in name, or a Jinja2 file under
    ``input_root`` (at most 1 MiB) that compiles in the gateway's immutable sandbox
    (:func:`blockq.frontdoors.gateway.chat_template.load_chat_template`). Raises
    :class:`JobFileRefused` naming ``chat_template``. A file template's failures at render
    time become the line's error (:func:`_contained`), not the job's."""
    if isinstance(spec, str) and spec in BUILTIN_TEMPLATES:
        return load_chat_template(spec)
    path = confine_path("chat_template", spec, input_root, "input root")
    if not path.is_file():
        raise JobFileRefused(f"chat_template: not a regular file: {path}")
    if path.stat().st_size > MAX_CHAT_TEMPLATE_BYTES:
        raise JobFileRefused(f"chat_template: {path} is over {MAX_CHAT_TEMPLATE_BYTES} bytes")
    try:
        render = load_chat_template(str(path))
    except ConfigError as exc:  # its message names chat_template and the file
        raise JobFileRefused(str(exc)[:2 * MAX_SHOWN_CHARS]) from None
    return _contained(render)


def _contained(render: Renderer) -> Renderer:
    """``render``, with any failure (the sandbox refusing an attribute, an undefined name, a
    division by zero: a template is code) raised as the messages' ValidationError, which
    fails that line only."""

    def contained(messages: Sequence[ChatMessage]) -> str:
        try:
            return render(messages)
        except Exception as exc:  # noqa: BLE001 - whatever the template raises is the line's error
            problem = f"the chat_template failed to render them ({type(exc).__name__}: {exc})"
            raise ValidationError("messages", problem[:MAX_SHOWN_CHARS]) from None

    return contained
