"""Open generation calls, counted in all and per API key: the gateway's in-flight slots,
and the requests each key's open calls carry: its share of the backlog.

A call takes its slot before its body is read and gives it back when it ends, whatever way
(answered, refused, timed out, client gone), so slow uploaders and stalled streams count
against the same caps as running calls. Once the body is parsed, the call also takes its
requests (prompts x ``n``, up to 128) from its key's share, given back with the slot: a
key at its call cap could otherwise still fill most of the backlog. Pure: no I/O, no clock.
"""

from __future__ import annotations

from enum import Enum


class SlotLimit(Enum):
    """Which cap a refused call met."""

    GATEWAY = "max_in_flight"
    KEY = "key max_in_flight"
    KEY_REQUESTS = "key max_requests_in_flight"


class InFlightSlots:
    """``max_in_flight`` slots for the gateway; each key also has its own cap, passed in
    per call (the key's policy), so a key's cap can differ without a table of them here."""

    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.num_in_flight = 0
        self._key_to_num_in_flight: dict[str, int] = {}
        self._key_to_num_requests: dict[str, int] = {}

    def num_in_flight_of(self, key_id: str) -> int:
        return self._key_to_num_in_flight.get(key_id, 0)

    def take(self, key_id: str, key_max_in_flight: int) -> SlotLimit | None:
        """Take a slot for ``key_id``. Returns None when it is taken, else the cap that
        refuses it (and takes nothing)."""
        if self.num_in_flight >= self.max_in_flight:
            return SlotLimit.GATEWAY
        num_of_key = self.num_in_flight_of(key_id)
        if num_of_key >= key_max_in_flight:
            return SlotLimit.KEY
        self.num_in_flight += 1
        self._key_to_num_in_flight[key_id] = num_of_key + 1
        return None

    def give_back(self, key_id: str) -> None:
        """Give back a slot :meth:`take` took for ``key_id``."""
        num_of_key = self._key_to_num_in_flight.get(key_id, 0)
        if num_of_key <= 0:
            raise RuntimeError(f"slot given back twice for key {key_id!r}")
        self.num_in_flight -= 1
        if num_of_key == 1:
            del self._key_to_num_in_flight[key_id]  # the table holds only keys with open calls
        else:
            self._key_to_num_in_flight[key_id] = num_of_key - 1

    def num_requests_of(self, key_id: str) -> int:
        return self._key_to_num_requests.get(key_id, 0)

    def take_requests(self, key_id: str, num_requests: int, key_max_requests: int) -> SlotLimit | None:
        """Count ``num_requests`` more against ``key_id``'s share. Returns None when they
        fit, else SlotLimit.KEY_REQUESTS (and counts nothing)."""
        num_of_key = self.num_requests_of(key_id)
        if num_of_key + num_requests > key_max_requests:
            return SlotLimit.KEY_REQUESTS
        self._key_to_num_requests[key_id] = num_of_key + num_requests
        return None

    def give_back_requests(self, key_id: str, num_requests: int) -> None:
        """Give back requests :meth:`take_requests` counted for ``key_id``."""
        left = self.num_requests_of(key_id) - num_requests
        if left < 0:
            raise RuntimeError(f"requests given back twice for key {key_id!r}")
        if left == 0:
            self._key_to_num_requests.pop(key_id, None)
        else:
            self._key_to_num_requests[key_id] = left
