"""Warm-ups: a session's KV brought up to the device shortly before its expected turn.

A session that expects its next turn (`KVStore.expect`: a hint's `expected_arrival`, `X-Session-Retain`)
is ranked to keep its KV (`policy.py`), but under memory oversubscription much of it still goes down
or is dropped during the pause. `warm_ahead` seconds before the expected time, the engine submits a
warm-up: a turn over the session's own history (`Request.warmup`) that copies its lower-tier chunks
up and recomputes dropped ones, batched with other work, and adds no tokens (its one sampled token is
discarded). The returning turn then finds its history on the device and computes only its new input.

Rules that keep it harmless:
- lowest priority: admitted after every queued turn, given budget last, suspended first (`_order` in
  `scheduler.py`), and a running warm-up ends (what it brought up stays) whenever a turn is queued, so
  it never holds device blocks a turn waits for;
- it yields: a turn submitted for the session cancels it (what it brought up stays, as for any
  cancelled turn), and one whose session changed since it was submitted is dropped at admission;
- it runs only for a session whose KV is not all on the device, and only once per expectation.

Owns: the handle of each session's warm-up in flight (dropped when it ends), and `next_at` (the store
clock time of the next expectation, as last asked: when the idle loop next looks).
"""

from __future__ import annotations

import math
import threading

from ..cache.doors.engine import EngineStore, Place, StoreError
from .request import Request, RequestHandle
from .sampling import SamplingParams

WARM_SAMPLING = SamplingParams(max_new_tokens=1)    # greedy; the token is discarded


class WarmUps:
    def __init__(self, store: EngineStore, requests, ahead: float | None):
        self.store, self.requests, self.ahead = store, requests, ahead
        self._lock = threading.Lock()
        self.in_flight: dict[str, RequestHandle] = {}
        self.next_at = math.inf

    def expected(self, at: float) -> None:
        """An expectation was set for clock time `at` (`Engine.hint`; a caller of `KVStore.expect` itself
        says so here): the engine looks for due warm-ups from `at - ahead` on."""
        self.next_at = min(self.next_at, at)

    def wake_in(self) -> float | None:
        """Seconds until the next warm-up may be due (None: none pending, or warm-ups are off)."""
        if self.ahead is None or self.next_at == math.inf:
            return None
        return max(self.next_at - self.ahead - self.store.clock(), 0.0)

    def submit_due(self) -> None:
        """Submit the warm-ups due now (before each step)."""
        if self.ahead is None:
            return
        due, self.next_at = self.store.due(self.ahead)
        for sid in due:
            self.warm(sid)

    def warm(self, session_id: str) -> RequestHandle | None:
        """Submit a warm-up of the session now; None if its KV is all on the device, it is busy or has a
        request in flight here, or it is unknown."""
        store = self.store
        try:
            below = any(p is not Place.DEVICE for p in store.places(session_id))
            if store.is_busy(session_id) or not (below or store.missing_positions(session_id)):
                return None
            ids = store.token_ids(session_id)
        except StoreError:
            return None
        handle = self.requests.new_handle(session_id)
        r = Request(handle.request_id, session_id, ids, WARM_SAMPLING, None, warmup=True)
        if not self.requests.add(r, handle, lambda active_here: active_here or store.is_busy(session_id)):
            return None
        with self._lock:
            self.in_flight[session_id] = handle
        self.requests.when_finished(handle, lambda _: self._forget(session_id, handle))
        return handle

    def _forget(self, session_id: str, handle: RequestHandle) -> None:
        with self._lock:
            if self.in_flight.get(session_id) is handle:
                del self.in_flight[session_id]

    def yield_to(self, session_id: str) -> bool:
        """A turn was submitted for the session: cancel its warm-up in flight. Returns whether there was one."""
        with self._lock:
            h = self.in_flight.pop(session_id, None)
        if h is None or h.done:
            return False
        h.cancel()
        return True
