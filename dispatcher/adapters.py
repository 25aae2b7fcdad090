"""What placing a LoRA request on an instance costs beyond its replica's forecast (pure).

The replicas (:class:`~dispatcher.replica.InstanceReplica`, the engine model's compiled
twin) do not model adapters, so ``block`` adds two charges to a candidate's forecast for a
request that names an adapter the candidate serves (docs/dispatcher.md, "Models and adapters"):

* **load**: the adapter is not resident there (not in the beat's ``loaded_loras``, not in
  use by its running or waiting requests, not named by a request this dispatcher placed
  there since the beat): the instance's ``lora_load_ms``, which the engine pays, so it is
  part of the predicted TTFT too; and in the rank at least :data:`ADAPTER_AFFINITY_S`: a
  load also evicts an adapter that later requests will load again, a cost no forecast of
  this request shows.
* **slot wait**: the adapter is not in use there and the adapters in use already number
  ``max_loras``: vLLM skips the request until one of those adapters has no request left
  (:mod:`blockq.engine_model.lora`), which may take many steps. The wait is not simulated;
  :data:`ADAPTER_SLOT_WAIT_S` ranks such a candidate behind one with a slot free, unless
  that one is predicted this much slower. It orders candidates only; the TTFT a decision
  predicts (and admission judges) leaves it out.

Requests naming no adapter, and instances without LoRA, are charged nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockq.wire.served_models import adapter_names, loaded_adapter_names
from dispatcher.instance_view import InstanceView

# The ranking's stand-in for waiting for an adapter slot (s): about a typical request's
# decode time on a loaded 7B instance (250 tokens at 25-40 ms a step is 6-10 s; a slot
# frees when the last request of some adapter ends, sooner than that). A chosen figure,
# not a measured one: it only has to rank a full instance behind one with a slot, and
# behind one with a free slot up to this much slower.
ADAPTER_SLOT_WAIT_S = 2.0
# The least a load costs in the rank (s): block takes a load only where the instances with
# the adapter resident are predicted this much slower. Chosen on the LoRA experiment
# (docs/results/lora.md): 30 ms (the load alone) left block at 0.57x Llumnix's loads.
ADAPTER_AFFINITY_S = 0.5


@dataclass(frozen=True, slots=True)
class AdapterCharge:
    """Seconds added to a candidate's forecast: ``load_s`` (in its TTFT) and ``wait_s``
    (in its rank only); ``loads``: the adapter is not resident there."""

    load_s: float = 0.0
    wait_s: float = 0.0
    loads: bool = False

    @property
    def rank_s(self) -> float:
        return (max(self.load_s, ADAPTER_AFFINITY_S) if self.loads else 0.0) + self.wait_s


NO_CHARGE = AdapterCharge()


def active_adapters(view: InstanceView) -> set[str]:
    """The adapters in use on ``view``'s instance: its running and waiting requests' (as
    vLLM's LoRA stats name them, ``running_lora_adapters`` / ``waiting_lora_adapters``,
    in the beat's engine stats) and those of the requests placed there since its beat."""
    stats = view.heartbeat.engine_stats or {}
    active = set(stats.get("running_lora_adapters") or ()) | set(stats.get("waiting_lora_adapters") or ())
    active.update(request.model for request in view.assigned_not_seen.values() if request.model is not None)
    return active


def adapter_charge(view: InstanceView, model: str | None) -> AdapterCharge:
    """What a request naming ``model`` costs on ``view``'s instance beyond its forecast."""
    config = view.heartbeat.engine_config
    max_loras = int(config.get("max_loras") or 0)
    if model is None or not max_loras or model not in adapter_names(config):
        return NO_CHARGE
    active = active_adapters(view)
    if model in active:
        return NO_CHARGE
    loads = model not in loaded_adapter_names(config)
    load_s = float(config.get("lora_load_ms") or 0.0) / 1000 if loads else 0.0
    wait_s = ADAPTER_SLOT_WAIT_S if len(active - {view.heartbeat.model}) >= max_loras else 0.0
    return AdapterCharge(load_s, wait_s, loads)
