"""What the dispatcher knows about one instance (:class:`InstanceView`): its latest beat,
its health, what was placed on it since, and its scheduler replica. Kept up to date by
:class:`dispatcher.cluster_view.ClusterView`."""

from __future__ import annotations

from dataclasses import dataclass, field

from blockq.engine_model import EngineConfig
from blockq.wire.beats import Heartbeat
from blockq.wire.health import InstanceState
from blockq.wire.protocol import Request
from dispatcher.prefix_index import PrefixIndex
from dispatcher.replica import InstanceReplica


@dataclass
class InstanceView:
    """What the dispatcher knows about one instance."""

    instance_id: str
    heartbeat: Heartbeat
    last_beat_at_s: float           # dispatcher's clock when the beat reached Redis (else: was applied)
    health: InstanceState = InstanceState.JOINING
    assigned_not_seen: dict[str, Request] = field(default_factory=dict)
    num_assigned_total: int = 0
    batch_request_ids: set[str] = field(default_factory=set)  # batch work placed here, not finished
    replica: InstanceReplica | None = None
    # The beat the replica was last rebuilt from: a newer ``heartbeat`` makes it stale,
    # and the next decision that needs it rebuilds it (ClusterView.replica).
    replica_beat: Heartbeat | None = None
    replica_used_at_s: float = float("-inf")  # when a decision last asked for the replica
    replica_built_at_s: float = float("-inf")  # when it was last rebuilt (the caller's clock)
    # Whether refresh_health already reported this instance gone (dead or stopped) since
    # its last beat that said otherwise: its queue is re-placed once per departure.
    left_reported: bool = False
    drain_reported: bool = False    # whether refresh_health reported it draining (once per drain)
    # What its prefix cache is believed to hold (instances whose beats say prefix caching is on).
    prefix_index: PrefixIndex | None = None
    # False while it is known only from the registry of instances (ClusterView.seed): no
    # beat of it was heard since, so its beat is no proof of life and any beat replaces it.
    heard: bool = True

    @property
    def config(self) -> EngineConfig:
        return EngineConfig.from_dict(self.heartbeat.engine_config)

    @property
    def num_free_blocks(self) -> int:
        return int(self.heartbeat.engine_config.get("num_gpu_blocks", 0)) - self.heartbeat.num_used_blocks

    @property
    def num_running(self) -> int:
        return self.heartbeat.num_running_total

    @property
    def num_waiting(self) -> int:
        return self.heartbeat.num_waiting_total

    @property
    def num_outstanding(self) -> int:
        """Running + waiting + assigned but not yet in a beat."""
        return self.num_running + self.num_waiting + len(self.assigned_not_seen)
