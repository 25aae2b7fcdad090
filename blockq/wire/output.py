"""Writes to a request's reply stream that hold when a request runs more than once.

A request may be executed twice: its worker died and it was placed again, or its worker
looked dead (paused, partitioned) and came back. Two rules keep what its reader sees
exactly-once:

* **Ownership.** ``owner:{id}`` names the one instance allowed to write the request's
  output. The dispatcher sets it when it places the request and moves it when it places
  the request again; every chunk and final record a worker writes goes through a script
  that checks it, so a stale executor's writes are refused (``FENCED``) and it drops the
  request. Writers that are not instances (a stage dead-lettering an entry) pass an
  empty writer id and skip the check.
* **One final record.** ``final:{id}`` is set in the same script that writes the final
  record (and the ``done`` entry): a second final record for a request is refused
  (``ALREADY_FINAL``), and so is any chunk after it.

The keys of one request share its hash tag, so the chunk script stays in one slot; the
final script also appends to the ``done`` stream, which on Redis Cluster shares their
slot through the key prefix's hash tag (:mod:`blockq.wire.keys`).
"""

from __future__ import annotations

from typing import Any

from blockq.wire.keys import Keys

WRITTEN = 1
ALREADY_FINAL = 0
FENCED = -1

DONE_STREAM_MAXLEN = 200_000

# Entries carry their message in field 'm' (keys.PAYLOAD_FIELD).
# KEYS: reply stream, owner, final flag. ARGV: writer id ('' = no owner check), payload, ttl s.
_CHUNK_SCRIPT = """
local owner = redis.call('GET', KEYS[2])
if ARGV[1] ~= '' and owner and owner ~= ARGV[1] then return -1 end
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
redis.call('XADD', KEYS[1], '*', 'm', ARGV[2])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
"""

# KEYS: reply stream, owner, final flag, done stream.
# ARGV: writer id, final payload, done payload ('' = none), ttl s, done maxlen.
_FINAL_SCRIPT = """
local owner = redis.call('GET', KEYS[2])
if ARGV[1] ~= '' and owner and owner ~= ARGV[1] then return -1 end
if not redis.call('SET', KEYS[3], ARGV[1] == '' and '-' or ARGV[1], 'NX', 'EX', tonumber(ARGV[4])) then
  return 0
end
redis.call('XADD', KEYS[1], '*', 'm', ARGV[2])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
if ARGV[3] ~= '' then
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', tonumber(ARGV[5]), '*', 'm', ARGV[3])
end
return 1
"""


def queue_chunk(pipe: Any, keys: Keys, request_id: str, reply_stream: str, writer_id: str, payload: bytes,
                ttl_s: int) -> None:
    """Queue one chunk of ``request_id``'s output on ``pipe`` (sync or asyncio), written
    only while ``writer_id`` owns the request and no final record exists; the pipeline's
    result for it is :data:`WRITTEN`, :data:`ALREADY_FINAL` or :data:`FENCED`.

    EVAL rather than EVALSHA: Redis forgets loaded scripts when it restarts, and these
    run on every stream flush of every request."""
    pipe.eval(_CHUNK_SCRIPT, 3, reply_stream, keys.owner(request_id), keys.final_flag(request_id),
              writer_id, payload, ttl_s)


def queue_final(pipe: Any, keys: Keys, request_id: str, reply_stream: str, writer_id: str, payload: bytes,
                done_payload: bytes | None, ttl_s: int) -> None:
    """Queue the final record (and the ``done`` entry) of ``request_id``, written at most
    once and only by its owner; results as :func:`queue_chunk`."""
    pipe.eval(_FINAL_SCRIPT, 4, reply_stream, keys.owner(request_id), keys.final_flag(request_id), keys.done,
              writer_id, payload, done_payload or b"", ttl_s, DONE_STREAM_MAXLEN)


def set_owner(pipe: Any, keys: Keys, request_id: str, instance_id: str, ttl_s: int) -> None:
    """Queue the hand-over of ``request_id``'s output to ``instance_id`` (at placement)."""
    pipe.set(keys.owner(request_id), instance_id, ex=ttl_s)
