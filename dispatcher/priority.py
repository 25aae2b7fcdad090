"""Priority classes at placement: ``batch`` is background work.

- An interactive request is never queued behind batch requests on an instance when
  another placement exists: instances with batch requests waiting are left out while any
  live instance has none.
- A batch request is placed only where the simulator's state shows idle capacity (a free
  sequence slot with nothing waiting, KV headroom); otherwise the dispatcher holds it
  (in Redis, un-ACKed) until some instance has room.
"""

from __future__ import annotations

from collections.abc import Sequence

from blockq.wire.protocol import Request
from dispatcher.instance_view import InstanceView

# Share of KV blocks that must be free before batch work is added to an instance.
BATCH_MIN_FREE_KV_FRACTION = 0.2


def has_waiting_batch(view: InstanceView) -> bool:
    """Whether a batch request placed here has not started running yet."""
    if not view.batch_request_ids:  # every batch request placed here and not finished is in it
        return False
    if any(r.priority == "batch" for r in view.assigned_not_seen.values()):
        return True
    return any(w.request_id in view.batch_request_ids for w in view.heartbeat.waiting)


def has_idle_capacity(view: InstanceView) -> bool:
    """A free sequence slot with nothing waiting, and KV headroom."""
    config = view.heartbeat.engine_config
    max_num_seqs = int(config.get("max_num_seqs", 0)) or 1
    num_blocks = int(config.get("num_gpu_blocks", 0)) or 1
    if view.num_waiting or view.num_running + len(view.assigned_not_seen) >= max_num_seqs:
        return False
    return view.num_free_blocks >= BATCH_MIN_FREE_KV_FRACTION * num_blocks


def eligible_candidates(request: Request, live: Sequence[InstanceView], *,
                        any_batch_work: bool = True) -> Sequence[InstanceView]:
    """The instances ``request`` may go to now; empty means "hold it". An interactive
    request with no batch work in the way gets ``live`` itself (policies keep what they
    derive from the candidate list while it is the same list). ``any_batch_work``: false
    when the caller knows no instance holds batch work (no pass over ``live`` then)."""
    if request.priority == "batch":
        return [v for v in live if has_idle_capacity(v)]
    if not any_batch_work:
        return live
    clear = [v for v in live if not has_waiting_batch(v)]
    if len(clear) == len(live):
        return live
    return clear or list(live)
