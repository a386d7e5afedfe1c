"""Movement of chunks between tiers: the store's internals (a mixin of SessionStore).

Every method here runs with the store lock held and keeps the invariant that each chunk's KV lives
in exactly one place (plus, for HOST chunks, an optional device `shadow` that is a cached copy).
Moving down follows the policy; making room in a tier moves its lowest-value chunks one tier down:
device -> host -> disk -> dropped (a tier that is absent is skipped).
"""

from __future__ import annotations

import math
import time

from .errors import CapacityError
from .pool import BlockPool
from .session import Chunk, ChunkState, Session

DEVICE, HOST, DISK, DROPPED = ChunkState.DEVICE, ChunkState.HOST, ChunkState.DISK, ChunkState.DROPPED


class TieringMixin:
    # provided by SessionStore: device_pool, host_pool, disk, transfer, policy, counters, block_size,
    # _sessions, swap_out_threshold, _disk_dirty

    def _pool(self, state: ChunkState) -> BlockPool | None:
        if state is DEVICE:
            return self.device_pool
        if state is HOST:
            return self.host_pool
        if state is DISK:
            return self.disk.pool if self.disk is not None else None
        return None

    def _below(self, state: ChunkState) -> ChunkState:
        order = [t for t in (DEVICE, HOST, DISK) if self._pool(t) is not None] + [DROPPED]
        return order[order.index(state) + 1]

    def _ntok(self, s: Session, k: int) -> int:
        return s.chunk_len(k, self.block_size)

    def _release(self, s: Session, k: int) -> None:
        """Free whatever the chunk holds and mark it DROPPED."""
        c = s.chunks[k]
        if c.loc is not None:
            self._pool(c.state).free([c.loc])
        if c.shadow is not None:
            self.device_pool.free([c.shadow])
        if c.state is DISK:
            self._disk_dirty = True
        s.chunks[k] = Chunk()

    def _candidates(self, state: ChunkState, exclude: set[str], shadowed: bool | None = None):
        """(session, chunk) pairs in `state` of idle sessions outside `exclude`, in policy order."""
        now = time.monotonic()
        found = [(s, k) for s in self._sessions.values() if not s.busy and s.session_id not in exclude
                 for k, c in enumerate(s.chunks)
                 if c.state is state and (shadowed is None or (c.shadow is not None) == shadowed)]
        found.sort(key=lambda sk: self.policy.key(sk[0], sk[1], self.block_size, now))
        return found

    def _take(self, state: ChunkState, n: int, exclude: set[str]) -> list[int]:
        """Allocate n slots of a tier, first making room by moving its lowest-value chunks down."""
        pool = self._pool(state)
        if n > pool.num_free:
            self._make_room(state, n - pool.num_free, exclude)
        if n > pool.num_free:
            raise CapacityError(f"{state.value} tier: {n} blocks needed, {pool.num_free} free and no more "
                                "can be freed from idle sessions (the others are busy)")
        return pool.allocate(n)

    def _make_room(self, state: ChunkState, n: int, exclude: set[str]) -> None:
        if state is DEVICE:
            for s, k in self._candidates(HOST, exclude, shadowed=True)[:n]:   # lazy reclamation: no copy
                self.device_pool.free([s.chunks[k].shadow])
                s.chunks[k].shadow = None
                n -= 1
            if n > 0:
                self._move_down(self._candidates(DEVICE, exclude)[:n], DEVICE, exclude)
        elif state is HOST:
            for s, k in self._candidates(HOST, exclude, shadowed=True)[:n]:   # still on device: revert
                c = s.chunks[k]
                self.host_pool.free([c.loc])
                s.chunks[k] = Chunk(DEVICE, c.shadow)
                n -= 1
            if n > 0:
                self._move_down(self._candidates(HOST, exclude, shadowed=False)[:n], HOST, exclude)
        elif state is DISK:
            self._move_down(self._candidates(DISK, exclude)[:n], DISK, exclude)

    def _move_down(self, items: list[tuple[Session, int]], state: ChunkState, exclude: set[str],
                   target: ChunkState | None = None, strict: bool = False) -> None:
        """Move chunks in `state` down to `target` (default: the next present tier). When the target
        has no room they are dropped instead, or, if `strict`, CapacityError is raised unchanged."""
        if not items:
            return
        target = target or self._below(state)
        exclude = exclude | {s.session_id for s, _ in items}
        if target is not DROPPED:
            try:
                slots = self._take(target, len(items), exclude)
            except CapacityError:
                if strict:
                    raise
                target, slots = DROPPED, []
        if target is DROPPED:
            for s, k in items:
                self.counters.dropped += self._ntok(s, k)
                self._release(s, k)
            return
        self.transfer.copy(self._pool(state), [s.chunks[k].loc for s, k in items], self._pool(target), slots)
        for (s, k), slot in zip(items, slots):
            self._release(s, k)
            s.chunks[k] = Chunk(target, slot)
            n = self._ntok(s, k)
            if target is HOST:
                self.counters.swapped_out_host += n
            else:
                self.counters.swapped_out_disk += n
        if target is DISK:
            self._disk_dirty = True

    def _move_up(self, items: list[tuple[Session, int]], target: ChunkState, exclude: set[str]) -> list:
        """Copy HOST/DISK chunks up to `target` (DEVICE or HOST); returns per-layer copy events (CUDA)."""
        events = []
        flips = [(s, k) for s, k in items if target is DEVICE and s.chunks[k].shadow is not None]
        for s, k in flips:                     # cached on the device still: no copy
            c = s.chunks[k]
            self.host_pool.free([c.loc])
            s.chunks[k] = Chunk(DEVICE, c.shadow)
            self.counters.device_hits += self._ntok(s, k)
        flipped = {(id(s), k) for s, k in flips}
        rest = [(s, k) for s, k in items if (id(s), k) not in flipped]
        slots = self._take(target, len(rest), exclude) if rest else []
        for source in (HOST, DISK):
            group = [(i, s, k) for i, (s, k) in enumerate(rest) if s.chunks[k].state is source]
            if not group:
                continue
            ev = self.transfer.copy(self._pool(source), [s.chunks[k].loc for _, s, k in group],
                                    self._pool(target), [slots[i] for i, _, _ in group])
            if ev:
                events.append(ev)
            for i, s, k in group:
                self._release(s, k)
                s.chunks[k] = Chunk(target, slots[i])
                if target is DEVICE:
                    n = self._ntok(s, k)
                    if source is HOST:
                        self.counters.swapped_in_host += n
                    else:
                        self.counters.swapped_in_disk += n
        return events

    def _swap_out_ahead(self) -> None:
        """Pensieve's ahead-of-time swap-out: while fewer than `swap_out_threshold` of device blocks
        are free or reclaimable, copy the lowest-value idle device chunks to the host and keep their
        blocks as shadows (reclaimed only when the blocks are needed)."""
        if self.host_pool is None or self.transfer.swap_in_pending():
            return
        pool = self.device_pool
        shadows = sum(1 for s in self._sessions.values() for c in s.chunks if c.shadow is not None)
        want = math.ceil(self.swap_out_threshold * pool.num_blocks) - pool.num_free - shadows
        if want <= 0:
            return
        items = self._candidates(DEVICE, set())[:want]
        if not items:
            return
        try:
            slots = self._take(HOST, len(items), {s.session_id for s, _ in items})
        except CapacityError:
            return
        self.transfer.copy(pool, [s.chunks[k].loc for s, k in items], self.host_pool, slots)
        for (s, k), slot in zip(items, slots):
            s.chunks[k] = Chunk(HOST, slot, shadow=s.chunks[k].loc)
            self.counters.swapped_out_host += self._ntok(s, k)
