"""Deleting the consumers a consumer group no longer needs.

Consumers are named after their process (``{role}-{hostname}``); under a Kubernetes
Deployment a pod's name, and so its consumer's, changes at every rollout and reschedule,
and Redis keeps every consumer it ever saw: ``XINFO CONSUMERS`` grows without end. So a
:class:`blockq.wire.streams.GroupConsumer` deletes, at most every ``sweep_interval_s``,
the consumers of its group that have been idle for ``idle_ms`` and hold no pending entry.
A dead peer's pending entries are first claimed by a live consumer (after
``claim_idle_ms``), and its empty consumer goes later.

A consumer with pending entries is never deleted: ``XGROUP DELCONSUMER`` would drop them
from the pending list, and nobody could claim that work again. The check and the delete
are one script, so an entry read by that consumer between the two cannot be lost.
"""

from __future__ import annotations

from typing import Any

DEFAULT_IDLE_CONSUMER_MS = 3_600_000  # an hour: a live consumer reads every few seconds
SWEEP_INTERVAL_S = 300.0

# KEYS: stream. ARGV: group, minimum idle ms, the caller's own consumer name (kept).
# Returns the names deleted. XINFO's `idle` is the time since the consumer's last read
# (since its last attempted read on Redis 7.2+), so a live consumer never qualifies.
_SWEEP_SCRIPT = """
local deleted = {}
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #consumer, 2 do info[consumer[i]] = consumer[i + 1] end
  if info['pending'] == 0 and info['idle'] >= tonumber(ARGV[2]) and info['name'] ~= ARGV[3] then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], info['name'])
    deleted[#deleted + 1] = info['name']
  end
end
return deleted
"""


async def delete_idle_consumers(client: Any, stream: str, group: str, *, idle_ms: int, keep: str) -> list[str]:
    """Delete ``group``'s consumers on ``stream`` idle for at least ``idle_ms`` with no
    pending entries, except ``keep``; the names deleted. ``client``: an asyncio client."""
    deleted = await client.eval(_SWEEP_SCRIPT, 1, stream, group, idle_ms, keep)
    return [name.decode() if isinstance(name, bytes) else name for name in deleted]
