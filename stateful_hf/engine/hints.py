"""Hints (Symphony's advisory requests): "this session will send a turn soon".

`engine.hint(session_id)` queues the session for prefetching: a background thread copies its host
and disk chunks up to the device (and rebuilds hidden-state chunks' K/V there by projection), one
chunk per store call, off the critical path of every request.

Rules that keep a hint harmless:
- It only uses device blocks that are free now, above the engine's admission reserve: it never
  pushes other sessions' KV down. Prefetched chunks are ordinary DEVICE chunks of an idle session,
  so the store may move them down again whenever it needs the blocks (they count as available).
- It stops as soon as the session becomes busy (its request arrived: the store raises
  SessionBusyError and the request's own step copies up the rest), when cancelled, or when the
  session is gone or changed under it. Each `store.move` is atomic under the store lock, so a
  request never sees a half-moved chunk; it sees some chunks already up, the rest still below.
- Dropped chunks (only token ids remain) are not recomputed by the prefetch: the turn recomputes them
  in its first step, batched with other work, or, for a hint with `expected_arrival`, the engine's
  warm-up does, `warm_ahead` seconds before that time (`warmup.py`).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from dataclasses import dataclass, field

from ..cache.doors.engine import CapacityError, Place, SessionBusyError, StoreError

_BELOW = (Place.CACHED, Place.HOST, Place.LOWER)    # what a hint brings up


@dataclass(eq=False)
class Hint:
    """One advisory request. Read `done`, `moved_tokens`, `stopped` ("done", "busy", "no room",
    "cancelled", "unknown session", "error: ..."); `wait()` for it; `cancel()` it."""

    session_id: str
    expected_arrival: float | None          # seconds from when the hint was sent, if the sender knows
    priority: int
    sent_at: float = field(default_factory=time.monotonic)
    moved_chunks: int = 0
    moved_tokens: int = 0                   # tokens whose KV was copied (or flipped) up to the device
    stopped: str | None = None
    finished_at: float | None = None
    _cancel: bool = False
    _event: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        """Stop after the chunk being moved (no-op once done). Chunks already moved stay up."""
        self._cancel = True

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def _finish(self, why: str) -> None:
        self.stopped, self.finished_at = why, time.monotonic()
        self._event.set()


class Prefetcher:
    """The hint queue of one engine and its worker thread (started on demand, exits when idle).
    Order: higher `priority` first, then earlier expected arrival, then first sent."""

    def __init__(self, engine):
        self.engine, self.store = engine, engine.store
        self._lock = threading.Lock()
        self._queue: list[tuple[tuple, Hint]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._active: dict[str, Hint] = {}      # session id -> its latest hint (queued or running)

    def hint(self, session_id: str, expected_arrival: float | None = None, priority: int | None = None) -> Hint:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session id must be a non-empty string, got {session_id!r}")
        if expected_arrival is not None and not expected_arrival >= 0:
            raise ValueError(f"expected_arrival is seconds from now (>= 0), got {expected_arrival!r}")
        h = Hint(session_id, expected_arrival, int(priority or 0))
        arrival = h.sent_at + expected_arrival if expected_arrival is not None else math.inf
        with self._lock:
            old = self._active.get(session_id)
            if old is not None and not old.done:
                old.cancel()                    # the newest hint of a session replaces older ones
            self._active[session_id] = h
            heapq.heappush(self._queue, ((-h.priority, arrival, next(self._seq)), h))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="stateful-hf-hints", daemon=True)
                self._thread.start()
        return h

    def cancel(self, session_id: str) -> None:
        with self._lock:
            h = self._active.get(session_id)
        if h is not None:
            h.cancel()

    def pending(self) -> int:
        with self._lock:
            return sum(1 for _, h in self._queue if not h.done)

    def join(self, timeout: float | None = None) -> None:
        """Wait until the worker has nothing left (for tests and benchmarks)."""
        t = self._thread
        if t is not None:
            t.join(timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                _, h = heapq.heappop(self._queue)
            try:
                h._finish(self._prefetch(h))
            except Exception as e:              # a hint never raises into anyone; it reports
                h._finish(f"error: {type(e).__name__}: {e}")
            finally:
                with self._lock:
                    if self._active.get(h.session_id) is h:
                        del self._active[h.session_id]

    def _reserve_blocks(self) -> int:
        return math.ceil(self.engine.scheduler.config.reserve_fraction * self.store.pool_sizes.device_blocks)

    def _prefetch(self, h: Hint) -> str:
        store, bs = self.store, self.store.block_size
        if h.session_id not in store:
            return "unknown session"
        while True:
            if h._cancel:
                return "cancelled"
            try:
                if store.is_busy(h.session_id):
                    return "busy"
                places, n = store.places(h.session_id), store.num_tokens(h.session_id)
            except StoreError:
                return "unknown session"
            # Next chunk below the device, leading chunks first (a turn's first layer reads them first).
            below = [(k, p) for k, p in enumerate(places) if p in _BELOW]
            if not below:
                return "done"
            k, place = below[0]
            cost = 0 if place is Place.CACHED else 1   # a chunk still cached on the device flips for free
            if cost and store.free_blocks() - cost < self._reserve_blocks():
                return "no room"
            try:
                store.move(h.session_id, [k], "device", reason="hint")
            except SessionBusyError:
                return "busy"
            except CapacityError:
                return "no room"
            except (IndexError, ValueError):    # truncated or dropped since we looked: a turn ran
                return "changed"
            except StoreError:
                return "unknown session"
            h.moved_chunks += 1
            h.moved_tokens += max(min(bs, n - k * bs), 0)
