"""Every Redis key, stream and consumer-group name blockq uses, in one place.

Keys carry a configurable prefix (default ``bq:``) so that several clusters can share
one Redis. Per-request and per-instance keys put the variable part in braces
(``out:{id}``, ``inst:{id}``).

Redis Cluster: Redis hashes only the first ``{...}`` of a key name, so a prefix that
itself holds a hash tag (``{bq}:``) puts every key of a cluster in one slot, whatever
follows. That is the layout blockq needs there: the dispatcher's fenced placement is one
MULTI/EXEC over the lease, ``ready``, instance queues, owner keys and reply streams; the
final-record script writes a reply stream and ``done``; admission reads ``req``, ``ready``
and every instance queue. Each such group would be CROSSSLOT under any per-key tag, so
on a cluster the prefix must carry a tag (:func:`hash_tag`; checked by
:func:`blockq.config.validate_redis_url`). The cost: one blockq cluster lives on one
shard (the cluster gives it failover, not spread); to spread load, run several cells,
each with its own tagged prefix (``{cell-a}:``, ``{cell-b}:``).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "bq:"

GROUP_PREDICT = "predict"
GROUP_DISPATCH = "dispatch"
GROUP_WORK = "work"
GROUP_FEEDBACK = "feedback"

# The one field of every stream entry that carries a message: its msgpack bytes.
PAYLOAD_FIELD = "m"
# The field of an ``autoscaler:decisions`` entry: the decision as JSON (for people and tools).
DECISION_FIELD = "decision"


def hash_tag(key: str) -> str | None:
    """The part of ``key`` Redis Cluster hashes when it is not the whole name: what lies
    between the first ``{`` and the first ``}`` after it, when not empty; None otherwise
    (then the whole key is hashed)."""
    start = key.find("{")
    if start < 0:
        return None
    end = key.find("}", start + 1)
    if end <= start + 1:
        return None
    return key[start + 1:end]


@dataclass(frozen=True)
class Keys:
    """Key names for one cluster (one prefix)."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix or len(self.prefix) > 64 or any(c.isspace() for c in self.prefix):
            raise ValueError(
                f"key_prefix: must be 1-64 characters without whitespace (got {self.prefix!r})"
            )

    @property
    def hash_tag(self) -> str | None:
        """The hash tag every key of this prefix shares (None: the prefix has none, and
        the keys spread over a cluster's slots)."""
        return hash_tag(self.prefix)

    @property
    def requests(self) -> str:
        """Ingress stream: raw requests from clients, the gateway and batch jobs."""
        return f"{self.prefix}req"

    @property
    def ready(self) -> str:
        """Requests annotated with a predicted output length, awaiting placement."""
        return f"{self.prefix}ready"

    @property
    def done(self) -> str:
        """One entry per finished request: true output length and timings."""
        return f"{self.prefix}done"

    @property
    def heartbeats(self) -> str:
        """One entry per worker heartbeat."""
        return f"{self.prefix}hb"

    @property
    def dead_letters(self) -> str:
        """Messages that could not be decoded or processed, with the reason."""
        return f"{self.prefix}dead"

    @property
    def cancellations(self) -> str:
        """Cancel notices, read by every worker."""
        return f"{self.prefix}cancel"

    @property
    def instances(self) -> str:
        """Hash: instance id -> its latest heartbeat (msgpack)."""
        return f"{self.prefix}instances"

    @property
    def dispatcher_lease(self) -> str:
        """String key holding the active dispatcher's id (leader lease)."""
        return f"{self.prefix}dispatcher:leader"

    @property
    def autoscaler_desired(self) -> str:
        """String: the fleet size the dispatcher leader's autoscaler wants (an integer);
        the local supervisor follows it, and seeds it with its initial size."""
        return f"{self.prefix}autoscaler:desired"

    @property
    def autoscaler_drain(self) -> str:
        """String: JSON list of the instance ids to drain first when the fleet shrinks
        (empty unless the latest decision shrank it)."""
        return f"{self.prefix}autoscaler:drain"

    @property
    def autoscaler_decisions(self) -> str:
        """Stream of every autoscaling decision (JSON, capped ``MAXLEN ~``)."""
        return f"{self.prefix}autoscaler:decisions"

    @property
    def cell_load(self) -> str:
        """Hash: this cell's load as its dispatcher leader last published it
        (:class:`blockq.cells.CellLoad`), read by the fronts that route between cells."""
        return f"{self.prefix}cell:load"

    def instance_queue(self, instance_id: str) -> str:
        """The queue stream of one engine instance."""
        return f"{self.prefix}inst:{{{instance_id}}}"

    def reply(self, request_id: str) -> str:
        """The stream a request's output chunks and final record are written to."""
        return f"{self.prefix}out:{{{request_id}}}"

    def owner(self, request_id: str) -> str:
        """String: the instance allowed to write the request's output (:mod:`blockq.wire.output`)."""
        return f"{self.prefix}owner:{{{request_id}}}"

    def final_flag(self, request_id: str) -> str:
        """String: set with the request's one final record (:mod:`blockq.wire.output`)."""
        return f"{self.prefix}final:{{{request_id}}}"

    def cancel_flag(self, request_id: str) -> str:
        """A short-lived flag saying the request was cancelled."""
        return f"{self.prefix}cancelled:{{{request_id}}}"

    def submitted(self, request_id: str) -> str:
        """String: the ingress entry id a request was accepted as (set once, by admission)."""
        return f"{self.prefix}submitted:{{{request_id}}}"

    def instance_queue_pattern(self) -> str:
        """SCAN pattern matching every instance queue."""
        return f"{self.prefix}inst:*"


@dataclass(frozen=True)
class BatchKeys:
    """Batch jobs' keys. rq keeps its own (``rq:job:{id}``, ``rq:queue:{name}``, under
    :attr:`rq_key_prefix` on Redis Cluster); these sit under the cluster prefix with the
    job id in braces (the hash tag, unless the prefix carries one)."""

    prefix: str = DEFAULT_PREFIX

    @property
    def rq_key_prefix(self) -> str:
        """rq's key namespace (its ``RQ_KEY_PREFIX``) on Redis Cluster: under the cluster
        prefix, so with its hash tag (``{bq}:rq``). rq runs MULTI/EXEC over a job, its queue
        and its registries; one tag for all of them keeps each in one slot."""
        return f"{self.prefix}rq"

    @property
    def queue_name(self) -> str:
        """The rq queue batch jobs are enqueued on (rq key ``rq:queue:{prefix}batch``)."""
        return f"{self.prefix}batch"

    def results(self, job_id: str) -> str:
        """Hash: custom_id -> the finished line of the output file (JSON)."""
        return f"{self.prefix}batch:{{{job_id}}}:results"

    def errors(self, job_id: str) -> str:
        """Hash: input line number -> the line of the errors file (JSON)."""
        return f"{self.prefix}batch:{{{job_id}}}:errors"

    def lease(self, job_id: str) -> str:
        """String with a TTL, held by the process running the job; gone = abandoned."""
        return f"{self.prefix}batch:{{{job_id}}}:lease"

    def cancel_flag(self, job_id: str) -> str:
        """Set by ``blockq batch cancel``; the running job stops when it sees it."""
        return f"{self.prefix}batch:{{{job_id}}}:cancel"

    def recovery_lock(self, job_id: str) -> str:
        """Short lock so that only one worker re-enqueues an abandoned job."""
        return f"{self.prefix}batch:{{{job_id}}}:recover"
