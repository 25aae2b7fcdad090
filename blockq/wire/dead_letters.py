"""The dead-letter stream's entries (``bq:dead``): what a stage could not process, why,
and its raw bytes, bounded in size.

Redis runs with ``maxmemory`` and ``noeviction``: a dead-letter stream that grew without
bound would end in refused writes everywhere. Each entry keeps at most
:data:`DEAD_LETTER_MAX_RAW_BYTES` of its payload (the head of it), with the payload's
total length and SHA-256, so an operator can still tell entries apart and match them to
the original; the stream is trimmed to about :data:`DEAD_LETTER_MAXLEN` entries (the
latest are kept). So it holds at most about MAXLEN x (MAX_RAW_BYTES + reason and fields)
= 2,000 x 65 KiB, 130 MiB, an eighth of the embedded Redis' 1 GB, and far less when
entries are small; whole payloads (up to 4 MiB each) under the former cap of 1,000,000
entries had no practical bound.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

DEAD_LETTER_MAXLEN = 2_000
DEAD_LETTER_MAX_RAW_BYTES = 64 * 1024
# Reasons often embed an exception message, which can embed the input: keep them short
# enough for a log line, a dead-letter entry and a client's error field.
MAX_REASON_CHARS = 500


def dead_letter_fields(source_stream: str, entry_id: str, payload: bytes | None, reason: str, *,
                       max_raw_bytes: int = DEAD_LETTER_MAX_RAW_BYTES) -> dict[str, Any]:
    """The fields of a dead-letter entry: the reason (at most :data:`MAX_REASON_CHARS`),
    where it came from, and the raw bytes: ``raw`` the first ``max_raw_bytes`` of the
    payload, ``raw_bytes`` its whole length and ``raw_sha256`` its hash (hex), so that a
    cut payload is still identified (``raw_bytes`` > len(``raw``) says it was cut)."""
    raw = payload if payload is not None else b""
    return {
        "reason": bound_reason(reason),
        "source": source_stream,
        "entry_id": entry_id,
        "raw": raw[:max_raw_bytes],
        "raw_bytes": len(raw),
        "raw_sha256": hashlib.sha256(raw).hexdigest(),
        "at_s": f"{time.time():.6f}",
    }


def bound_reason(reason: str) -> str:
    """``reason`` cut to :data:`MAX_REASON_CHARS` characters."""
    return reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS - 3] + "..."
