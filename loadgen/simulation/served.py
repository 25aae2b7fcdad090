"""What a simulated fleet serves, and which model each request asks for.

Two experiments (docs/results/lora.md):

* **LoRA adapters** (``--adapters N``): every instance serves one base model and ``N``
  adapters (``lora-00`` ...), at most ``--max-loras`` resident, loading one costing
  ``--lora-load-ms``; each request names an adapter drawn with Zipf popularity
  (``--adapter-zipf``: adapter ``k`` of ``N`` drawn with weight ``1 / k**s``), seeded by the
  run's seed, so every policy of a seed serves the same requests the same adapters.
* **Several models** (``--models chat:0.8:3,code:0.2:1``): ``NAME:SHARE:INSTANCES``, the
  first ``INSTANCES`` instances serve the first model, and so on (the counts must add up
  to ``--instances``); each request names a model drawn by ``SHARE``.

The draws are a pure function of the seed and the request's position in the sample.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Any

# What the engine model charges per adapter load (ms): docs/dispatcher.md, "Models and adapters".
DEFAULT_LORA_LOAD_MS = 30.0


@dataclass(frozen=True)
class ModelShare:
    """One base model of a several-model fleet: its name, its share of the requests and how
    many instances serve it."""

    name: str
    share: float
    num_instances: int


@dataclass(frozen=True)
class ServedModels:
    """What the fleet serves (see the module docstring); the default serves one model and
    no adapter, and requests name none (as before models were named)."""

    num_adapters: int = 0
    adapter_zipf: float = 1.0
    max_loras: int = 8
    lora_load_ms: float = DEFAULT_LORA_LOAD_MS
    models: tuple[ModelShare, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.num_adapters <= 1000:
            raise ValueError(f"adapters: must be in [0, 1000] (got {self.num_adapters})")
        if not 0 <= self.adapter_zipf <= 10:
            raise ValueError(f"adapter_zipf: must be in [0, 10] (got {self.adapter_zipf})")
        if self.num_adapters and self.max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1 with adapters (got {self.max_loras})")
        if not 0 <= self.lora_load_ms <= 60_000:
            raise ValueError(f"lora_load_ms: must be in [0, 60000] (got {self.lora_load_ms})")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError("models: names must be distinct and non-empty")
        if any(m.share <= 0 or m.num_instances < 1 for m in self.models):
            raise ValueError("models: every share must be > 0 and every instance count >= 1")

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return tuple(f"lora-{index:02d}" for index in range(self.num_adapters))

    def check_fleet(self, num_instances: int, num_cells: int) -> None:
        """ValueError unless the model's instance counts cover the fleet (one cell only)."""
        if (self.models or self.num_adapters) and num_cells != 1:
            raise ValueError("models, adapters: simulated on one cell only")
        if self.models and sum(m.num_instances for m in self.models) != num_instances:
            raise ValueError(f"models: the instance counts add up to {sum(m.num_instances for m in self.models)}, "
                             f"not --instances {num_instances}")

    def engine_options(self, index: int) -> dict[str, Any]:
        """The emulated engine options of instance ``index`` (of the first fleet): its model,
        its adapters, and the engine config's LoRA settings as overrides."""
        options: dict[str, Any] = {}
        if self.models:
            options["model_name"] = self.model_of_instance(index)
        if self.num_adapters:
            options["lora_adapters"] = self.adapter_names
            options["config_overrides"] = (("max_loras", self.max_loras), ("lora_load_ms", self.lora_load_ms))
        return options

    def model_of_instance(self, index: int) -> str | None:
        """The base model instance ``index`` serves (None: the preset's, one-model fleets)."""
        end = 0
        for model in self.models:
            end += model.num_instances
            if index < end:
                return model.name
        return self.models[-1].name if self.models else None

    def draw(self, num_requests: int, seed: int) -> list[str | None]:
        """The model each request of a sample names, by position (None: none)."""
        if self.num_adapters:
            rng = random.Random(f"adapters-{seed}")
            weights = [1 / (rank ** self.adapter_zipf) for rank in range(1, self.num_adapters + 1)]
            return list(rng.choices(self.adapter_names, weights, k=num_requests))
        if self.models:
            rng = random.Random(f"models-{seed}")
            return list(rng.choices([m.name for m in self.models], [m.share for m in self.models], k=num_requests))
        return [None] * num_requests


def parse_models(text: str) -> tuple[ModelShare, ...]:
    """``NAME:SHARE:INSTANCES,...`` (argparse type; ArgumentTypeError naming the bad part)."""
    models = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, share, instances = (part.split(":") + ["", ""])[:3]
        try:
            models.append(ModelShare(name, float(share), int(instances)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--models: {part!r} is not NAME:SHARE:INSTANCES") from None
    return tuple(models)


def add_served_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adapters", type=int, default=0,
                        help="LoRA adapters every instance serves; each request names one (Zipf popularity)")
    parser.add_argument("--adapter-zipf", type=float, default=ServedModels.adapter_zipf,
                        help="Zipf exponent of the adapters' popularity (adapter k drawn with weight 1/k**s)")
    parser.add_argument("--max-loras", type=int, default=ServedModels.max_loras,
                        help="adapters resident at once and in one batch, per instance (vLLM's max_loras)")
    parser.add_argument("--lora-load-ms", type=float, default=DEFAULT_LORA_LOAD_MS,
                        help="model ms an adapter load adds to the step that needs it")
    parser.add_argument("--models", type=parse_models, default=(), metavar="NAME:SHARE:INSTANCES,...",
                        help="several base models on one fleet: each served by INSTANCES instances (in order), "
                             "named by SHARE of the requests")


def served_models_from_args(args: argparse.Namespace) -> ServedModels:
    """The flags of :func:`add_served_model_arguments`, validated (SystemExit naming the flag)."""
    try:
        return ServedModels(num_adapters=args.adapters, adapter_zipf=args.adapter_zipf, max_loras=args.max_loras,
                            lora_load_ms=args.lora_load_ms, models=tuple(args.models))
    except ValueError as exc:
        raise SystemExit(f"simulate: {exc}") from None
