"""A mixed fleet as one spec: ``6:llama2-7b-a30,4:llama2-7b-a100,2:llama2-7b-h100-tp2``.

Groups of ``COUNT:PRESET`` separated by commas; a group without a count (``llama2-7b-a30``)
is one instance. Instances are numbered group by group in the order written (``gpu0`` ...
``gpu5`` the A30s above, ``gpu6`` ... the A100s), the same in ``blockq simulate``,
``blockq bench`` and ``blockq up``. The one parser is :func:`parse_fleet`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

from blockq.engine_model.presets import EnginePreset, get_preset

MAX_FLEET_INSTANCES = 4096


@dataclass(frozen=True)
class FleetGroup:
    """``num_instances`` instances of the engine preset ``preset``."""

    num_instances: int
    preset: str


@dataclass(frozen=True)
class FleetSpec:
    """A fleet: its groups in order (validated by :func:`parse_fleet`)."""

    groups: tuple[FleetGroup, ...]

    @property
    def num_instances(self) -> int:
        return sum(group.num_instances for group in self.groups)

    @property
    def instance_presets(self) -> tuple[str, ...]:
        """The preset of every instance, by index."""
        return tuple(group.preset for group in self.groups for _ in range(group.num_instances))

    def preset_of(self, index: int) -> str:
        """The preset of instance ``index``; past the fleet's end (instances an autoscaler
        adds), the last group's."""
        presets = self.instance_presets
        return presets[index] if index < len(presets) else self.groups[-1].preset

    def presets(self) -> list[EnginePreset]:
        """The distinct presets, in the order they first appear."""
        return [get_preset(name) for name in dict.fromkeys(group.preset for group in self.groups)]

    @property
    def min_max_model_len(self) -> int:
        """The longest request every instance of the fleet can take."""
        return min(preset.config.max_model_len for preset in self.presets())

    def split(self, num_cells: int) -> tuple[FleetSpec, ...]:
        """The fleet split into ``num_cells`` cells (``blockq simulate --cells``, ``blockq up
        --cells``): instance ``i`` goes to cell ``i % num_cells``, interleaved, so that every
        cell gets the same mix of presets as far as the counts allow (a cell's load per
        instance, which the front compares, then means the same in every cell). Each cell's
        fleet keeps the groups in fleet order (a group none of whose instances land in the
        cell is left out), so its instance ``k`` is instance ``cell + k * num_cells`` of this
        fleet; cells differ in size by one at most (the first ``num_instances % num_cells``
        are the larger). Pure: the same fleet and count give the same cells.

        Raises:
            ValueError: naming ``cells`` when ``num_cells`` is below 1 or leaves a cell empty
                (more cells than instances).
        """
        if not 1 <= num_cells <= self.num_instances:
            raise ValueError(f"cells: must be between 1 and the fleet's {self.num_instances} instances, so that "
                             f"no cell is empty (got {num_cells})")
        group_of_instance = [index for index, group in enumerate(self.groups) for _ in range(group.num_instances)]
        return tuple(
            FleetSpec(tuple(FleetGroup(len(list(members)), self.groups[group].preset)
                            for group, members in groupby(group_of_instance[cell::num_cells])))
            for cell in range(num_cells))

    def __str__(self) -> str:
        return ",".join(f"{group.num_instances}:{group.preset}" for group in self.groups)


def parse_fleet(spec: str) -> FleetSpec:
    """Parse ``COUNT:PRESET[,COUNT:PRESET...]``; every preset must be known (a built-in name
    or a measured ``PROFILE.json``).

    Raises:
        ValueError: naming the group and its field (``count`` or ``preset``), or the whole
            ``fleet`` when it is empty or too large.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("fleet: must be COUNT:PRESET[,COUNT:PRESET...] (got an empty spec)")
    groups = tuple(_parse_group(index, text.strip()) for index, text in enumerate(spec.split(","), start=1))
    fleet = FleetSpec(groups)
    if fleet.num_instances > MAX_FLEET_INSTANCES:
        raise ValueError(f"fleet: at most {MAX_FLEET_INSTANCES} instances (got {fleet.num_instances})")
    return fleet


def _parse_group(index: int, text: str) -> FleetGroup:
    where = f"fleet: group {index} ({text!r})"
    if not text:
        raise ValueError(f"{where}: empty; write COUNT:PRESET")
    count_text, separator, preset = text.partition(":")
    if not separator:  # a bare preset: one instance
        count_text, separator, preset = "1", ":", text
    try:
        count = int(count_text)
    except ValueError:
        raise ValueError(f"{where}: count: must be an integer >= 1 (got {count_text!r})") from None
    if count < 1:
        raise ValueError(f"{where}: count: must be >= 1 (got {count})")
    preset = preset.strip()
    if not separator or not preset:
        raise ValueError(f"{where}: preset: missing; write COUNT:PRESET")
    try:
        get_preset(preset)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{where}: preset: {str(exc).removeprefix('preset: ')}") from None
    return FleetGroup(count, preset)
