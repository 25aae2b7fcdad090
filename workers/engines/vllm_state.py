"""Exact engine state from inside vLLM: its own scheduler, reporting what it holds after
every step.

vLLM's stat logger says how many requests run and wait, not which, nor how far each has
got; the outputs a worker streams lag the engine core by a step or more, and say nothing
of preemptions. The engine core runs in a process of its own, and vLLM chooses its
scheduler class by import path (``SchedulerConfig.scheduler_cls``). So the vLLM worker
names :class:`StateReportingScheduler` there: vLLM's scheduler unchanged, with one hook
after each step's outputs are applied (``update_from_output``) that sends a snapshot to
the worker over a local ZeroMQ socket. The socket is conflated: the worker reads only the
latest snapshot, and a step never waits for the worker (a send that cannot go is dropped).

A snapshot is JSON, :class:`EngineSnapshot`'s fields: ``at_s`` (``time.monotonic()`` at
the step's end: one clock for every process of the machine), ``running`` in vLLM's running
order and ``waiting`` in the order vLLM admits from (block holders first), each request as
``[request id, computed tokens, output tokens, preemptions so far]``, ``used_blocks`` (KV
blocks held, vLLM's null block left out) and ``num_steps``.

Request ids are vLLM's own: it appends ``-`` and 8 random characters to each id it is given
(``InputProcessor.assign_request_id``); :func:`worker_request_id` takes them off. This
module imports vLLM only in the engine-core process.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

# The worker's socket; set in the environment the engine-core process inherits.
STATE_ENDPOINT_ENV = "BLOCKQ_VLLM_STATE_ENDPOINT"
SCHEDULER_CLS = f"{__name__}.StateReportingScheduler"


@dataclass(frozen=True)
class EngineSnapshot:
    """One snapshot as the worker reads it (see the module's docstring)."""

    at_s: float
    running: tuple[tuple[str, int, int, int], ...]
    waiting: tuple[tuple[str, int, int, int], ...]
    used_blocks: int
    num_steps: int

    @classmethod
    def decode(cls, payload: bytes) -> EngineSnapshot:
        data = json.loads(payload)
        return cls(float(data["at_s"]), tuple(tuple(r) for r in data["running"]),  # type: ignore[misc]
                   tuple(tuple(r) for r in data["waiting"]), int(data["used_blocks"]),  # type: ignore[misc]
                   int(data["num_steps"]))


def worker_request_id(engine_request_id: str, known_ids: Any) -> str:
    """The worker's id of a request vLLM names ``engine_request_id``: itself when the worker
    knows it (vLLM run with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION), else without vLLM's
    random suffix."""
    if engine_request_id in known_ids:
        return engine_request_id
    return engine_request_id.rsplit("-", 1)[0]


def _entry(request: Any) -> list[Any]:
    return [request.request_id, int(request.num_computed_tokens), int(request.num_output_tokens),
            int(request.num_preemptions)]


def snapshot_of(scheduler: Any, num_steps: int) -> bytes:
    """The snapshot of a vLLM V1 scheduler, encoded."""
    waiting = [*scheduler.kv_holding_waiting, *scheduler.waiting]
    pool = scheduler.kv_cache_manager.block_pool
    used_blocks = pool.num_gpu_blocks - pool.get_num_free_blocks() - 1  # the null block is never free
    return json.dumps({"at_s": time.monotonic(), "running": [_entry(r) for r in scheduler.running],
                       "waiting": [_entry(r) for r in waiting], "used_blocks": max(0, used_blocks),
                       "num_steps": num_steps}, separators=(",", ":")).encode()


def _connect(endpoint: str) -> Any:
    import zmq

    socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.setsockopt(zmq.CONFLATE, 1)  # keep only the latest snapshot queued
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    return socket


try:
    from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler
except ImportError:  # the worker's side, without vLLM: only EngineSnapshot is used
    _VllmScheduler = object  # type: ignore[assignment,misc]


class StateReportingScheduler(_VllmScheduler):  # type: ignore[misc,valid-type]
    """vLLM's scheduler, sending a snapshot after every step (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        endpoint = os.environ.get(STATE_ENDPOINT_ENV)
        self._state_socket = _connect(endpoint) if endpoint else None
        self._num_steps = 0

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._num_steps += 1
        if self._state_socket is not None:
            import zmq

            # zmq.Again: the worker is not reading; its next read gets a later snapshot
            with contextlib.suppress(zmq.Again):
                self._state_socket.send(snapshot_of(self, self._num_steps), zmq.NOBLOCK)
        return outputs


class SnapshotReader:
    """The worker's side: the latest snapshot, and the preemptions it reveals.

    Snapshots may be dropped on the way (the socket keeps the latest only), so preemptions
    are found from each request's own count, which only grows: a request whose count is
    higher than in the last snapshot read was preempted since."""

    def __init__(self) -> None:
        self.latest: EngineSnapshot | None = None
        # The requests the engine core has held (by the worker's id): their preemptions.
        self._id_to_preemptions: dict[str, int] = {}

    def apply(self, snapshot: EngineSnapshot, known_ids: Any) -> list[str]:
        """Take ``snapshot`` as the latest (an older one than the latest is ignored); the
        worker ids of the requests preempted since the last one. Requests the worker no
        longer tracks (``known_ids``: it has answered or aborted them) are not noted."""
        if self.latest is not None and snapshot.num_steps <= self.latest.num_steps:
            return []
        self.latest = snapshot
        preempted: list[str] = []
        for entry in (*snapshot.running, *snapshot.waiting):
            request_id = worker_request_id(entry[0], known_ids)
            if request_id not in known_ids:
                continue
            num_preemptions = entry[3]
            if num_preemptions > self._id_to_preemptions.get(request_id, 0):
                preempted.append(request_id)
            self._id_to_preemptions[request_id] = num_preemptions
        return preempted

    def has_seen(self, request_id: str) -> bool:
        """Whether the engine core has held the request (in a snapshot read)."""
        return request_id in self._id_to_preemptions

    def forget(self, request_id: str) -> None:
        """A request the worker no longer tracks (finished or aborted)."""
        self._id_to_preemptions.pop(request_id, None)
