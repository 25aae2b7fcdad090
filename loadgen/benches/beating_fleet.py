"""An emulated fleet for ``blockq dispatch-bench --redis``: instances that only beat.

Every 100 ms each instance beats the same load (``running`` / ``waiting`` requests of
ShareGPT-like lengths) and reports as finished what was placed on it since its last beat
(read back from its queue), as a fleet that keeps pace with its arrivals would. It runs
in a child process of its own, so that a bench measures the dispatcher's work and not
the emulation's.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.process import BaseProcess
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event

import redis

from blockq.wire.connections import connect
from blockq.wire.keys import PAYLOAD_FIELD, Keys
from blockq.wire.protocol import encode, unpack_map
from loadgen.benches.dispatch import HEARTBEAT_INTERVAL_S, heartbeat_of, loaded_scheduler

PRESET = "llama2-7b-a30"
# How long the fleet's first round of beats may take to appear (1,024 loaded engines
# are built first, in a freshly spawned interpreter).
FLEET_START_TIMEOUT_S = 120.0
HEARTBEATS_MAXLEN = 20_000  # the beat stream's cap, as the workers keep it (workers/worker.py)


def beat_fleet(redis_url: str, key_prefix: str, num_instances: int, running: int, waiting: int, seed: int,
               num_rounds: Synchronized, stop: Event) -> None:
    """Child process: ``num_instances`` instances beating every 100 ms until ``stop``;
    ``num_rounds`` counts the rounds of beats written (late rounds are not skipped).

    The load never changes, so each instance's beat map is built once and only its
    sequence number, times and finished ids are set per round: a round of 1,024 beats
    built from engine state took ~135 ms, more than the interval."""
    keys = Keys(key_prefix)
    rng = random.Random(seed)
    beat_maps = {f"i{k}": heartbeat_of(f"i{k}", loaded_scheduler(rng, PRESET, running, waiting), 0, 0.0,
                                       PRESET).to_map() for k in range(num_instances)}
    instance_of_queue = {keys.instance_queue(instance_id): instance_id for instance_id in beat_maps}
    queue_positions = dict.fromkeys(instance_of_queue, "0-0")
    client = connect(redis_url)
    started_at = next_round_at = time.perf_counter()
    seq = 0
    try:
        while not stop.is_set():
            seq += 1
            finished = _read_placed(client, queue_positions, instance_of_queue)
            pipe = client.pipeline(transaction=False)
            for instance_id, beat_map in beat_maps.items():
                beat = {**beat_map, "seq": seq, "sent_at_s": time.time(),
                        "engine_time_s": time.perf_counter() - started_at,
                        "finished_ids": finished.get(instance_id, [])}
                pipe.xadd(keys.heartbeats, {PAYLOAD_FIELD: encode(beat)}, maxlen=HEARTBEATS_MAXLEN,
                          approximate=True)
            pipe.execute()
            num_rounds.value = seq
            next_round_at += HEARTBEAT_INTERVAL_S
            stop.wait(max(0.0, next_round_at - time.perf_counter()))
    finally:
        client.close()


def _read_placed(client: redis.Redis, queue_positions: dict[str, str],
                 instance_of_queue: dict[str, str]) -> dict[str, list[str]]:
    """The ids placed on each instance since the last call (its queue read from there on)."""
    finished: dict[str, list[str]] = {}
    for stream, entries in client.xread(queue_positions):  # type: ignore[union-attr]
        queue = stream.decode()
        queue_positions[queue] = entries[-1][0].decode()
        finished[instance_of_queue[queue]] = [unpack_map(fields[PAYLOAD_FIELD.encode()])["id"]
                                              for _, fields in entries]
    return finished


@dataclass
class EmulatedFleet:
    """The fleet's process (:func:`beat_fleet`), its stop event and its count of rounds."""

    process: BaseProcess
    stop: Event
    num_rounds: Synchronized
    num_instances: int

    @classmethod
    def start(cls, redis_url: str, keys: Keys, num_instances: int, running: int, waiting: int,
              seed: int) -> EmulatedFleet:
        """Spawn it (the caller runs an event loop and holds connections: no fork) and wait
        until its first round of beats is in Redis. A script that calls this needs the
        ``if __name__ == "__main__":`` guard, as any spawning script does."""
        context = get_context("spawn")
        stop, num_rounds = context.Event(), context.Value("q", 0)
        process = context.Process(target=beat_fleet, name="dispatch-bench-fleet", daemon=True,
                                  args=(redis_url, keys.prefix, num_instances, running, waiting, seed,
                                        num_rounds, stop))
        fleet = cls(process, stop, num_rounds, num_instances)
        process.start()
        deadline = time.monotonic() + FLEET_START_TIMEOUT_S
        while fleet.num_rounds.value < 1:
            if not fleet.process.is_alive() or time.monotonic() > deadline:
                fleet.close()
                raise RuntimeError(f"dispatch-bench: the emulated fleet did not beat "
                                   f"(exit code {fleet.process.exitcode})")
            time.sleep(0.05)
        return fleet

    @property
    def num_beats_sent(self) -> int:
        return self.num_rounds.value * self.num_instances

    def close(self) -> None:
        """Stop it and reap its process (terminated if it does not stop within 10 s)."""
        self.stop.set()
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
