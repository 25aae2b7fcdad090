"""The cancel notices a worker reads (``cancellations`` stream), remembered for a while.

Clients cancel with a flag (for a request not taken yet) and a notice on the stream (for
the worker running it). A worker reads the notices from where it started, and remembers
the latest ``max_remembered`` ids, so that a notice that arrives while its request is
being admitted (after the flag was read, before the engine has it) is not lost.
"""

from __future__ import annotations

from typing import Any

from blockq.wire.keys import PAYLOAD_FIELD

MAX_RECENT_CANCELS = 10_000
READ_BLOCK_MS = 500


class CancelNotices:
    """Reads the cancel stream from where the worker started; after a Redis outage it
    resumes after the last notice read (``cursor``), so none is skipped."""

    def __init__(self, client: Any, stream: str, max_remembered: int = MAX_RECENT_CANCELS) -> None:
        self.client = client
        self.stream = stream
        self.max_remembered = max_remembered
        self.cursor = "$"  # "$": notices from the first read on
        self._recent: dict[str, None] = {}  # insertion-ordered, bounded

    async def read(self) -> list[str]:
        """The ids of the notices that arrived (blocks up to :data:`READ_BLOCK_MS`), each
        remembered."""
        reply = await self.client.xread({self.stream: self.cursor}, count=100, block=READ_BLOCK_MS)
        request_ids = []
        for entry_id, fields in reply[0][1] if reply else []:
            self.cursor = entry_id
            request_id = fields.get(PAYLOAD_FIELD.encode(), b"").decode()
            self.remember(request_id)
            request_ids.append(request_id)
        return request_ids

    def remember(self, request_id: str) -> None:
        self._recent[request_id] = None
        if len(self._recent) > self.max_remembered:
            del self._recent[next(iter(self._recent))]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._recent
