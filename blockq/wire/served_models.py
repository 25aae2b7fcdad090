"""What an instance serves, as its beats say: one base model and its LoRA adapters.

A worker publishes its base model's name in the beat's ``model`` and, when it serves LoRA
adapters, two lists in its engine config: ``lora_adapters`` (every adapter it is configured
with, by name) and ``loaded_loras`` (those resident on its GPU now, least recently used
first), beside ``max_loras``. A request names one of these names in ``model``
(:class:`blockq.wire.protocol.Request`); the dispatcher places it only where the name is
served (docs/dispatcher.md, "Models and adapters"). The lists change when the engine
restarts or loads an adapter, so beats stay small and the dispatcher re-reads them only then.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from blockq.wire.protocol import ValidationError

# Names an engine config may list; a longer list is refused (the beat must stay bounded).
MAX_ADAPTERS = 1024
MAX_NAME_CHARS = 256
ADAPTER_LISTS = ("lora_adapters", "loaded_loras")


class _Beat(Protocol):
    model: str
    engine_config: dict[str, Any]


def adapter_names(engine_config: Mapping[str, Any]) -> tuple[str, ...]:
    """The LoRA adapters an instance is configured with (empty: none)."""
    return tuple(engine_config.get("lora_adapters") or ())


def loaded_adapter_names(engine_config: Mapping[str, Any]) -> tuple[str, ...]:
    """The adapters resident on the instance's GPU as of its beat, least recently used first."""
    return tuple(engine_config.get("loaded_loras") or ())


def served_names(beat: _Beat) -> tuple[str, ...]:
    """Every name a request may give in ``model`` to be placed on ``beat``'s instance: its
    base model, then its adapters."""
    return (beat.model, *adapter_names(beat.engine_config))


def serves(beat: _Beat, model: str | None) -> bool:
    """Whether a request naming ``model`` may go to ``beat``'s instance (None: any may)."""
    return model is None or model == beat.model or model in adapter_names(beat.engine_config)


def check_adapter_lists(engine_config: Mapping[str, Any]) -> None:
    """Refuse (ValidationError on ``engine_config``) adapter lists that are not lists of at
    most :data:`MAX_ADAPTERS` non-empty names of at most :data:`MAX_NAME_CHARS` characters."""
    for name in ADAPTER_LISTS:
        values = engine_config.get(name)
        if values is None:
            continue
        if not isinstance(values, list | tuple) or len(values) > MAX_ADAPTERS or not all(
                isinstance(v, str) and 0 < len(v) <= MAX_NAME_CHARS for v in values):
            raise ValidationError("engine_config", f"{name}: must be a list of at most {MAX_ADAPTERS} "
                                                   f"names of 1-{MAX_NAME_CHARS} characters")
