"""Movement of chunks between tiers: the store's internals (a mixin of SessionStore).

Every method here runs with the store lock held and keeps the invariant that each chunk's KV lives
in exactly one place (plus, for HOST chunks, an optional device `shadow` that is a cached copy).
Moving down follows the policy; making room in a tier moves its lowest-value chunks one tier down:
device -> host -> disk -> dropped (a tier that is absent is skipped). With hidden states in use
(`_hidden_down`), device chunks whose hidden states were captured go down to HIDDEN instead of
HOST, hidden chunks go down to the disk tier's hidden file (DISK_HIDDEN) if there is a disk tier,
and from there (or without one) to dropped (HCache, `hidden_states.py`).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

from .errors import CapacityError, StoreError
from .moves import REASONS, MoveBatch
from .pool import BlockPool
from .session import Chunk, ChunkState, Session

DEVICE, HOST, DISK, DROPPED = ChunkState.DEVICE, ChunkState.HOST, ChunkState.DISK, ChunkState.DROPPED
HIDDEN, DISK_HIDDEN, LAYERED = ChunkState.HIDDEN, ChunkState.DISK_HIDDEN, ChunkState.LAYERED
SHADOWED = (HOST, HIDDEN)     # states whose chunks may keep a device shadow
ON_DISK = (DISK, DISK_HIDDEN)


class TieringMixin:
    # provided by SessionStore: device_pool, host_pool, disk, transfer, policy, counters, block_size,
    # _sessions, swap_out_threshold, _disk_dirty, hidden_pool, disk_hidden_pool, capture, project, _hidden_down,
    # moves (a MoveLedger), _move_reason (why the moves under way happen; see moves.py)

    @contextmanager
    def _moving(self, reason: str):
        """Moves inside are recorded with `reason` (the innermost wins: room made during a step is "pressure")."""
        if reason not in REASONS:
            raise ValueError(f"unknown move reason {reason!r}; choose from {REASONS}")
        prev, self._move_reason = self._move_reason, reason
        try:
            yield
        finally:
            self._move_reason = prev

    def _record_move(self, src: ChunkState, dst: ChunkState, items: list[tuple[Session, int]], t0: float) -> None:
        """Account one move batch (items: the chunks moved, in any state now); t0: perf_counter at its start."""
        if not items:
            return
        pool = None if dst is DROPPED else self._pool(dst)
        hidden = getattr(pool, "hidden_spec", None)
        per_slot = 0 if pool is None else hidden.bytes_per_block if hidden is not None else self.spec.bytes_per_block
        per_session: dict[str, int] = {}
        for s, k in items:
            per_session[s.session_id] = per_session.get(s.session_id, 0) + self._ntok(s, k)
        self.moves.record(MoveBatch(src.value, dst.value, self._move_reason, len(items), sum(per_session.values()),
                                    per_slot * len(items), time.perf_counter() - t0, tuple(per_session.items())))

    def _pool(self, state: ChunkState) -> BlockPool | None:
        if state is DEVICE:
            return self.device_pool
        if state is HOST:
            return self.host_pool
        if state is DISK:
            return self.disk.pool if self.disk is not None else None
        if state is HIDDEN:
            return self.hidden_pool
        if state is DISK_HIDDEN:
            return self.disk_hidden_pool
        if state is LAYERED:      # its host slot (its device share is in the share table)
            return self.host_pool
        return None

    def _below(self, state: ChunkState) -> ChunkState:
        if state is HIDDEN:
            return DISK_HIDDEN if self.disk_hidden_pool is not None else DROPPED
        if state is DISK_HIDDEN:
            return DROPPED
        order = [t for t in (DEVICE, HOST, DISK) if self._pool(t) is not None] + [DROPPED]
        return order[order.index(state) + 1]

    def _ntok(self, s: Session, k: int) -> int:
        return s.chunk_len(k, self.block_size)

    def _release(self, s: Session, k: int) -> None:
        """Session `s` lets go of chunk k, which becomes a fresh DROPPED chunk of `s`; its slots are
        freed unless other sessions still hold it (a shared chunk, prefix_sharing.py)."""
        if self.sharing.detach(s, k):
            return
        self._vacate(s.chunks[k])
        s.chunks[k] = Chunk()

    def _vacate(self, c: Chunk) -> None:
        """Free whatever chunk `c` holds (slot, shadow, hidden source, share); its fields are left for
        the caller to reassign (`Chunk.assign`: in place, for every holder of a shared chunk)."""
        if c.loc is not None:
            self._pool(c.state).free([c.loc])
        if c.shadow is not None:
            self.device_pool.free([c.shadow])
        if c.source is not None:
            self._pool(c.source[0]).free([c.source[1]])
            self._disk_dirty |= c.source[0] is DISK_HIDDEN
        if c.share is not None:
            self._release_share(c)
        if c.state in ON_DISK:
            self._disk_dirty = True

    def _candidates(self, state: ChunkState, exclude: set[str], shadowed: bool | None = None):
        """(session, chunk) pairs in `state` of idle sessions outside `exclude`, in policy order: one
        pair per physical chunk; a shared chunk only if every holder is idle and outside `exclude`,
        ranked by its most valuable holder (its value counts every holder)."""
        now = self.clock()
        self.policy.prepare(self._sessions.values(), now)
        found = [(s, k) for s in self._sessions.values() if not s.busy and s.session_id not in exclude
                 for k, c in enumerate(s.chunks)
                 if c.state is state and (shadowed is None or (c.shadow is not None) == shadowed)
                 and self.sharing.free_to_move(c, exclude)]
        bs = self.block_size
        found = self.sharing.unique(found)
        found.sort(key=lambda sk: max(self.policy.key(h, sk[1], bs, now) for h in self.sharing.holders(*sk)))
        return found

    def _take(self, state: ChunkState, n: int, exclude: set[str],
              owners: list[tuple[str, int]] | None = None) -> list[int]:
        """Allocate n slots of a tier, first making room by moving its lowest-value chunks down.
        `owners` ((session id, chunk) per slot) places device blocks in a virtual layout's slots."""
        pool = self._pool(state)
        if getattr(pool, "virtual", False):
            self._free_device_slots(pool.slots_needed(owners), exclude)
        if n > pool.num_free and state in ON_DISK and pool.limbo:
            self._sync_disk(force=True)        # freed disk slots are reusable once the index forgets them
        if n > pool.num_free:
            self._make_room(state, n - pool.num_free, exclude)
            if n > pool.num_free and state in ON_DISK:
                self._sync_disk(force=True)
        if n > pool.num_free:
            raise CapacityError(f"{state.value} tier: {n} blocks needed, {pool.num_free} free and no more "
                                "can be freed from idle sessions (the others are busy)")
        return pool.allocate(n, owners)

    def _free_device_slots(self, needed: int, exclude: set[str]) -> None:
        """Virtual layout: while fewer slots are free than `needed`, the idle session of lowest value
        holding a slot leaves the device (its chunks move down, its cached shadows are dropped)."""
        with self._moving("slots"):
            self._free_slots(needed, exclude)

    def _free_slots(self, needed: int, exclude: set[str]) -> None:
        pool, now = self.device_pool, self.clock()
        self.policy.prepare(self._sessions.values(), now)
        while pool.free_slots < needed:
            holders = [s for s in self._sessions.values() if not s.busy and s.session_id not in exclude
                       and pool.slot_of(s.session_id) is not None]
            if not holders:
                raise CapacityError(f"all {pool.num_slots} device slots are held by busy sessions; "
                                    "raise device_capacity or lower max_context")
            victim = min(holders, key=lambda s: min(self.policy.key(s, k, self.block_size, now)
                                                    for k in range(max(len(s.chunks), 1))))
            self._move_down([(victim, k) for k, c in enumerate(victim.chunks) if c.state is DEVICE], DEVICE, exclude)
            for c in victim.chunks:
                if c.shadow is not None:
                    pool.free([c.shadow])
                    c.shadow = None

    def _make_room(self, state: ChunkState, n: int, exclude: set[str]) -> None:
        with self._moving("pressure"):
            self._room(state, n, exclude)

    def _room(self, state: ChunkState, n: int, exclude: set[str]) -> None:
        if state is DEVICE:
            shadowed = self._candidates(HOST, exclude, shadowed=True) + self._candidates(HIDDEN, exclude, shadowed=True)
            for s, k in shadowed[:n]:   # lazy reclamation: no copy
                self.device_pool.free([s.chunks[k].shadow])
                s.chunks[k].shadow = None
                n -= 1
            if n > 0:
                self._move_down(self._candidates(DEVICE, exclude)[:n], DEVICE, exclude)
        elif state in SHADOWED:
            for s, k in self._candidates(state, exclude, shadowed=True)[:n]:   # still on device: revert
                c = s.chunks[k]
                self._pool(state).free([c.loc])
                c.assign(DEVICE, c.shadow)
                n -= 1
            if n > 0:
                self._move_down(self._candidates(state, exclude, shadowed=False)[:n], state, exclude)
        elif state in ON_DISK:
            self._move_down(self._candidates(state, exclude)[:n], state, exclude)

    def _move_down(self, items: list[tuple[Session, int]], state: ChunkState, exclude: set[str],
                   target: ChunkState | None = None, strict: bool = False) -> None:
        """Move chunks in `state` down to `target` (default: the next present tier). When the target
        has no room they are dropped instead, or, if `strict`, CapacityError is raised unchanged."""
        items = self.sharing.unique(items)
        if not items:
            return
        if target is None and state is DEVICE and self._hidden_down:   # the policy keeps hidden states
            hid = [(s, k) for s, k in items if self.capture.valid[s.chunks[k].loc]]
            items = [(s, k) for s, k in items if not self.capture.valid[s.chunks[k].loc]]
            self._move_down(hid, DEVICE, exclude | {s.session_id for s, _ in items}, target=HIDDEN)
            if not items:
                return
        target = target or self._below(state)
        if target in ON_DISK or target is DROPPED:    # a shared chunk never goes to disk shared
            items = self.sharing.unshare(items)
        exclude = exclude | {s.session_id for s, _ in items}
        if target in ON_DISK and not self._disk_usable(strict):
            target = DROPPED
        if target is not DROPPED:
            try:
                slots = self._take(target, len(items), exclude)
            except CapacityError:
                if strict:
                    raise
                target, slots = DROPPED, []
        if target is DROPPED:
            t0 = time.perf_counter()
            for s, k in items:
                self.counters.dropped += self._ntok(s, k)
                self._release(s, k)
            self._record_move(state, DROPPED, items, t0)
            return
        t0 = time.perf_counter()
        if target is HIDDEN:
            self._check_hidden_source(items, state)
            self.hidden_pool.store_from(self.capture, self.device_pool, [s.chunks[k].loc for s, k in items], slots)
        elif target is DISK_HIDDEN:   # from HIDDEN: same split, a copy of slots
            self.hidden_pool.copy_slots([s.chunks[k].loc for s, k in items], self.disk_hidden_pool, slots)
        else:
            self.transfer.copy(self._pool(state), [s.chunks[k].loc for s, k in items], self._pool(target), slots)
        if target in ON_DISK and not self._disk_written(items, target, slots):   # not durable: not on disk
            if strict:
                raise StoreError(f"the disk tier {str(self.disk.dir)!r} could not flush its data file; nothing "
                                 "was moved and the tier is degraded")
            self._move_down(items, state, exclude, target=DROPPED)
            return
        self._record_move(state, target, items, t0)
        for (s, k), slot in zip(items, slots):
            self._vacate(s.chunks[k])
            s.chunks[k].assign(target, slot)
            n = self._ntok(s, k)
            if target is HIDDEN:
                self.counters.swapped_out_hidden += n
            elif target is HOST:
                self.counters.swapped_out_host += n
            else:
                self.counters.swapped_out_disk += n
        if target in ON_DISK:
            self._disk_dirty = True

    def _check_hidden_source(self, items: list[tuple[Session, int]], state: ChunkState) -> None:
        if self.capture is None:
            raise ValueError("this store keeps no hidden states (hidden_states='never', or 'auto' on a model "
                             "whose K/V is not larger than its hidden states): use hidden_states='always'")
        bad = [(s.session_id, k) for s, k in items if state is not DEVICE or not self.capture.valid[s.chunks[k].loc]]
        if bad:
            raise ValueError(f"chunks {bad[:4]} cannot become hidden: their hidden states were not captured "
                             "(only device chunks computed or rebuilt from hidden states while capturing can)")

    def _move_up(self, items: list[tuple[Session, int]], target: ChunkState, exclude: set[str],
                 restore=None) -> list:
        """Copy HOST/DISK chunks up to `target` (DEVICE or HOST); returns per-layer copy events (CUDA).
        HIDDEN / DISK_HIDDEN chunks to the device join `restore` (a HiddenRestore run layer by layer
        by the step) and keep their hidden slot as `source` until the step commits; DISK_HIDDEN
        chunks to HIDDEN are a copy of slots."""
        events = []
        items = self.sharing.unique(items)     # a chunk shared by sessions of one step moves once
        flips = [(s, k) for s, k in items if target is DEVICE and s.chunks[k].shadow is not None]
        for s, k in flips:                     # cached on the device still: no copy
            c = s.chunks[k]
            self._pool(c.state).free([c.loc])
            c.assign(DEVICE, c.shadow)
            self.counters.device_hits += self._ntok(s, k)
        flipped = {(id(s), k) for s, k in flips}
        rest = [(s, k) for s, k in items if (id(s), k) not in flipped]
        slots = self._take(target, len(rest), exclude, [(s.session_id, k) for s, k in rest]) if rest else []
        rebuilt = {st: [(s, k) for s, k in rest if s.chunks[k].state is st] for st in (HIDDEN, DISK_HIDDEN)}
        for i, (s, k) in enumerate(rest):
            c = s.chunks[k]
            if c.state in (HIDDEN, DISK_HIDDEN) and target is not HIDDEN:
                if target is not DEVICE or restore is None:
                    raise ValueError("hidden chunks move up to the device only (their K/V is rebuilt there)")
                n = self._ntok(s, k)
                restore.add(self._pool(c.state), c.loc, slots[i], k * self.block_size, n,
                            (s.session_id, k, (c.state, c.loc)))
                self.counters.restored_hidden += n
                self.counters.restored_hidden_disk += n if c.state is DISK_HIDDEN else 0
                c.assign(DEVICE, slots[i], source=(c.state, c.loc))
        if target is DEVICE:                   # queued for the step's rebuild, timed there (restore_seconds)
            for st, group in rebuilt.items():
                self._record_move(st, DEVICE, group, time.perf_counter())
        up = [(i, s, k) for i, (s, k) in enumerate(rest) if s.chunks[k].state is DISK_HIDDEN]
        if up:                                 # disk hidden states up to the host hidden pool
            t0 = time.perf_counter()
            self.disk_hidden_pool.copy_slots([s.chunks[k].loc for _, s, k in up], self.hidden_pool,
                                             [slots[i] for i, _, _ in up])
            self._record_move(DISK_HIDDEN, HIDDEN, [(s, k) for _, s, k in up], t0)
            for i, s, k in up:
                self._vacate(s.chunks[k])
                s.chunks[k].assign(HIDDEN, slots[i])
        for source in (HOST, DISK):
            group = [(i, s, k) for i, (s, k) in enumerate(rest) if s.chunks[k].state is source]
            if not group:
                continue
            t0 = time.perf_counter()
            ev = self.transfer.copy(self._pool(source), [s.chunks[k].loc for _, s, k in group],
                                    self._pool(target), [slots[i] for i, _, _ in group])
            self._record_move(source, target, [(s, k) for _, s, k in group], t0)
            if ev:
                events.append(ev)
            for i, s, k in group:
                self._vacate(s.chunks[k])
                s.chunks[k].assign(target, slots[i])
                if target is DEVICE and self.capture is not None:
                    self.capture.valid[slots[i]] = False        # K/V only: its hidden states are unknown
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
        pool = self.device_pool
        if (self.host_pool is None and self.hidden_pool is None) or self.transfer.swap_in_pending() \
                or getattr(pool, "virtual", False):   # a virtual layout frees slots on demand instead
            return
        shadows = sum(1 for _, _, c in self.sharing.physical(self._sessions.values()) if c.shadow is not None)
        want = math.ceil(self.swap_out_threshold * pool.num_blocks) - pool.num_free - shadows
        if want <= 0:
            return
        with self._moving("ahead"):
            self._swap_out(self._candidates(DEVICE, set())[:want])

    def _swap_out(self, items: list[tuple[Session, int]]) -> None:
        pool = self.device_pool
        keep_hidden = [self._hidden_down and self.capture.valid[s.chunks[k].loc] for s, k in items]
        hid = [sk for sk, h in zip(items, keep_hidden) if h]
        kv = [sk for sk, h in zip(items, keep_hidden) if not h]
        for group, target in ((hid, HIDDEN), (kv, HOST)):
            if not group or self._pool(target) is None:
                continue
            try:
                slots = self._take(target, len(group), {s.session_id for s, _ in items})
            except CapacityError:
                continue
            blocks = [s.chunks[k].loc for s, k in group]
            t0 = time.perf_counter()
            if target is HIDDEN:
                self.hidden_pool.store_from(self.capture, pool, blocks, slots)
            else:
                self.transfer.copy(pool, blocks, self.host_pool, slots)
            self._record_move(DEVICE, target, group, t0)
            for (s, k), slot in zip(group, slots):
                s.chunks[k].assign(target, slot, shadow=s.chunks[k].loc)
                n = self._ntok(s, k)
                if target is HIDDEN:
                    self.counters.swapped_out_hidden += n
                else:
                    self.counters.swapped_out_host += n
