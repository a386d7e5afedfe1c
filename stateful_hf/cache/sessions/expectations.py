"""When idle sessions expect their next turns (`KVStore.expect`: a hint's `expected_arrival`, an agent's
tool pause), in order, so the engine can bring a session's KV up shortly before its turn (`due`).

Owns: the heap of (expected time, session id), one entry per expectation set. Entries are checked
against the session when popped (lazy deletion): one whose session was deleted, whose expectation
was replaced or has lapsed by activity is dropped. Guarded by the store lock.
"""

from __future__ import annotations

import heapq
import math


class Expectations:
    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []

    def push(self, at: float, session_id: str) -> None:
        """Mutates: the heap."""
        heapq.heappush(self._heap, (at, session_id))

    def soonest(self) -> float:
        """<= every pending expectation's time (inf: none)."""
        return self._heap[0][0] if self._heap else math.inf

    def pop_due(self, until: float) -> list[tuple[float, str]]:
        """The entries expected by `until`, soonest first, removed. Mutates: the heap."""
        out = []
        while self._heap and self._heap[0][0] <= until:
            out.append(heapq.heappop(self._heap))
        return out
