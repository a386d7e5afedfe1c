"""The ledger of chunk moves between tiers: cumulative totals per (source, target, reason), a log
line per move batch, and listeners (the server's metrics) told of each batch.

A batch is one call that moves chunks of one tier to another (`Placement.move_down`, a group of
`SwapIn.move_up`, an ahead-of-time swap-out group). Reasons (why the store moved them):

    pressure  a tier needed room: the eviction policy chose the lowest-value idle chunks
    ahead     ahead-of-time swap-out after a turn (Pensieve), chosen by the policy
    slots     virtual layout: an idle session gave up its device slot, chosen by the policy
    evict     `store.evict` (the engine suspends a running request that ran out of blocks)
    step      a step brought its sessions' stored chunks up to the device
    hint      a hint's prefetch (`store.move(..., reason="hint")`)
    explicit  `store.move` by a caller (an operator, a migration)

Bytes are whole slots of the target pool (a partial chunk still fills a slot); moves to "dropped"
copy nothing (0 bytes). Seconds are the wall time spent issuing the copy: on the CPU the copy itself,
on CUDA its enqueueing (the copy overlaps the step), unless the mover waited for it to land before the
batch was recorded (`landed`: a move up outside a step); a hidden chunk's K/V rebuilt on the device is
timed by the step that runs it (`Counters.restore_seconds`), so its up-move has 0 seconds here.
Everything runs under the store lock; listeners must be quick and must not call into the store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

REASONS = ("pressure", "ahead", "slots", "evict", "step", "hint", "explicit")
log = logging.getLogger("stateful_hf.moves")
_LOGGED_SESSIONS = 16          # a move batch's log line names at most this many sessions


@dataclass(frozen=True, slots=True)
class MoveBatch:
    src: str                   # a ChunkState value: "device", "host", "hidden", "disk", "disk_hidden", ...
    dst: str
    reason: str                # one of REASONS
    chunks: int
    tokens: int
    bytes: int
    seconds: float
    sessions: tuple[tuple[str, int], ...]   # (session id, its tokens moved), distinct, in batch order
    landed: bool = True        # `seconds` ran until the copy landed (synchronous, or waited on); False: its issue only


@dataclass(slots=True)
class MoveTotals:
    batches: int = 0
    chunks: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class MoveLedger:
    totals: dict[tuple[str, str, str], MoveTotals] = field(default_factory=dict)   # (src, dst, reason) ->
    listeners: list[Callable[[MoveBatch], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, batch: MoveBatch) -> None:
        with self._lock:
            t = self.totals.setdefault((batch.src, batch.dst, batch.reason), MoveTotals())
            t.batches += 1
            t.chunks += batch.chunks
            t.tokens += batch.tokens
            t.bytes += batch.bytes
            t.seconds += batch.seconds
        if log.isEnabledFor(logging.INFO):
            shown = [sid for sid, _ in batch.sessions[:_LOGGED_SESSIONS]]
            log.info("tier move %s -> %s (%s): %d chunks, %d tokens, %d bytes, %.6f s", batch.src, batch.dst,
                     batch.reason, batch.chunks, batch.tokens, batch.bytes, batch.seconds,
                     extra={"event": "tier_move", "src": batch.src, "dst": batch.dst, "reason": batch.reason,
                            "chunks": batch.chunks, "tokens": batch.tokens, "bytes": batch.bytes,
                            "seconds": batch.seconds, "sessions": shown,
                            "sessions_total": len(batch.sessions)})
        for fn in list(self.listeners):
            fn(batch)

    def snapshot(self) -> dict[tuple[str, str, str], MoveTotals]:
        """A copy of the totals."""
        with self._lock:
            return {k: MoveTotals(v.batches, v.chunks, v.tokens, v.bytes, v.seconds) for k, v in self.totals.items()}

    def subscribe(self, fn: Callable[[MoveBatch], None]) -> Callable[[], None]:
        """Call fn(batch) after each batch (on the moving thread, store lock held). Returns an unsubscribe."""
        self.listeners.append(fn)
        return lambda: self.listeners.remove(fn) if fn in self.listeners else None
