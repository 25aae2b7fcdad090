"""LoRA adapters in the dispatcher (pure): how a replica numbers an instance's adapters,
and what ``block`` adds to a candidate's rank beyond its replica's forecast.

The replicas simulate adapters (:mod:`blockq.engine_model.packed_lora`): each request's
adapter reaches them in the beat (``RequestProgress.lora_adapter``), placements add theirs,
and the resident adapters are restored from the beat's ``loaded_loras``; so a forecast
already holds the load (``lora_load_ms``, where the adapter is not resident) and the wait
for an adapter slot (vLLM's ``max_loras`` rule). What it cannot hold is what a load costs
*later* requests: it evicts an adapter they will load again. So ``block`` ranks a candidate
where the request's adapter is not in use and not resident :data:`ADAPTER_AFFINITY_S`
later (docs/dispatcher.md, "Models and adapters"); the charge orders candidates only, the
predicted TTFT that admission judges leaves it out.

Requests naming no adapter, and instances without LoRA, are charged nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from blockq.wire.served_models import adapter_names, loaded_adapter_names

if TYPE_CHECKING:  # the replica (which InstanceView holds) numbers adapters with this module
    from dispatcher.instance_view import InstanceView

# What a load costs later requests, in the rank (s): block takes a load only where the
# instances with the adapter in use or resident are predicted this much slower. A chosen
# figure, measured against none: docs/results/lora.md ("The adapters in the replica").
ADAPTER_AFFINITY_S = 0.5


def adapter_ids(engine_config: Mapping[str, Any]) -> dict[str, int]:
    """An instance's adapters numbered from 1 in the order its engine config lists them
    (0 is the base model). The caller must not change the dict: it is shared."""
    return _numbered(adapter_names(engine_config))


@lru_cache(maxsize=256)
def _numbered(names: tuple[str, ...]) -> dict[str, int]:
    return {name: index for index, name in enumerate(names, start=1)}


def resident_adapter_ids(engine_config: Mapping[str, Any], ids: Mapping[str, int], max_loras: int) -> list[int]:
    """The resident adapters of the beat's ``loaded_loras`` as ``ids`` number them, least
    recently used first: names the instance does not serve are left out, and of a longer
    list than ``max_loras`` (no engine holds more) only the most recently used are kept."""
    if max_loras <= 0 or not ids:
        return []
    resident = [ids[name] for name in loaded_adapter_names(engine_config) if name in ids]
    return resident[-max_loras:]


def active_adapters(view: InstanceView) -> set[str]:
    """The adapters in use on ``view``'s instance: its running and waiting requests' (as
    vLLM's LoRA stats name them, ``running_lora_adapters`` / ``waiting_lora_adapters``,
    in the beat's engine stats) and those of the requests placed there since its beat."""
    stats = view.heartbeat.engine_stats or {}
    active = set(stats.get("running_lora_adapters") or ()) | set(stats.get("waiting_lora_adapters") or ())
    active.update(request.model for request in view.assigned_not_seen.values() if request.model is not None)
    return active


def adapter_charge(view: InstanceView, model: str | None) -> float:
    """Seconds added to the rank of ``view``'s instance for a request naming ``model``:
    :data:`ADAPTER_AFFINITY_S` where ``model`` is an adapter it serves that is neither in
    use there nor resident, else 0."""
    config = view.heartbeat.engine_config
    if model is None or not config.get("max_loras") or model not in adapter_names(config):
        return 0.0
    if model in active_adapters(view) or model in loaded_adapter_names(config):
        return 0.0
    return ADAPTER_AFFINITY_S
