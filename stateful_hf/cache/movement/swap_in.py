"""Swap-in: chunks coming up a tier (to the device for a step or a move, or disk hidden states up to
the host hidden pool), and the settling of hidden-state rebuilds after the step that ran them.

Collaborators: the pools, placement (to get slots, making room by the policy), the transfer engine
(copies; per-layer events on CUDA), the hidden tier (capture) and the disk state (`feature.py`'s null
parts when the store lacks them; hidden and disk chunks exist only where it has them), the move ledger via
placement, the counters (written: swapped_in_*, device_hits, restored_hidden*).
Mutates: the moved chunks (state, loc, shadow, source) and the pools' slots. A chunk rebuilt from
hidden states keeps its hidden slot as `source` until `settle` (after its step) frees it or, when
the rebuild did not finish, puts the chunk back in its hidden form. A KV chunk read up from disk keeps
its disk slot as its copy (`DiskCopies.keep`): the disk index is unchanged, a crash or a restart still
finds the chunk, and evicting it again writes nothing.
Every method runs with the store lock held.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..audit.stats import Counters
from ..pools.tier_pools import TierPools
from ..sessions.session import HIDDEN_FORMS, ChunkState, SessionTable
from .placement import Items, Placement
from .transfer import Transfer

if TYPE_CHECKING:
    from ..disk.state import DiskState
    from ..feature import NoDisk, NoHiddenStates
    from ..hidden.states import HiddenRestore
    from ..hidden.tier import HiddenTier

DEVICE, HOST, DISK = ChunkState.DEVICE, ChunkState.HOST, ChunkState.DISK
HIDDEN, DISK_HIDDEN = ChunkState.HIDDEN, ChunkState.DISK_HIDDEN


class SwapIn:
    def __init__(self, sessions: SessionTable, tiers: TierPools, placement: Placement, transfer: Transfer,
                 hidden: HiddenTier | NoHiddenStates, disk_state: DiskState | NoDisk, counters: Counters):
        self.sessions, self.tiers, self.placement, self.transfer = sessions, tiers, placement, transfer
        self.hidden, self.disk_state, self.counters = hidden, disk_state, counters
        self.block_size = tiers.device.spec.block_size

    def move_up(self, items: Items, target: ChunkState, exclude: set[str],
                restore: HiddenRestore | None = None, wait: bool = False) -> list:
        """Copy HOST/DISK chunks up to `target` (DEVICE or HOST); returns per-layer copy events (CUDA).
        HIDDEN / DISK_HIDDEN chunks to the device join `restore` (a HiddenRestore run layer by layer
        by the step) and keep their hidden slot as `source` until `settle`; DISK_HIDDEN chunks to
        HIDDEN are a copy of slots. Chunks still cached on the device (a shadow) take it back, no copy.
        `wait`: each copy lands before its batch is recorded (a move outside a step: its seconds are the copy's)."""
        events, bs, tiers, record = [], self.block_size, self.tiers, self.placement.record
        movers = [s for s, _ in items]
        items = tiers.sharing.unique(items)    # a chunk shared by sessions of one step moves once
        flips = [(s, k) for s, k in items if target is DEVICE and s.chunks[k].shadow is not None]
        for s, k in flips:
            c = s.chunks[k]
            tiers.pool(c.state).free([c.loc])
            c.assign(DEVICE, c.shadow)
            self.counters.device_hits += s.chunk_len(k, bs)
        flipped = {(id(s), k) for s, k in flips}
        rest = [(s, k) for s, k in items if (id(s), k) not in flipped]
        self.disk_state.prefetch(rest)         # every disk read of this move queued before the first copy
        slots = self.placement.take(target, len(rest), exclude, [(s.session_id, k) for s, k in rest]) if rest else []
        rebuilt = {st: [(s, k) for s, k in rest if s.chunks[k].state is st] for st in HIDDEN_FORMS}
        for i, (s, k) in enumerate(rest):
            c = s.chunks[k]
            if c.state in HIDDEN_FORMS and target is not HIDDEN:
                if target is not DEVICE or restore is None:
                    raise ValueError("hidden chunks move up to the device only (their K/V is rebuilt there)")
                n = s.chunk_len(k, bs)
                restore.add(tiers.pool(c.state), c.loc, slots[i], k * bs, n, (s.session_id, k, (c.state, c.loc)))
                self.counters.restored_hidden += n
                self.counters.restored_hidden_disk += n if c.state is DISK_HIDDEN else 0
                c.assign(DEVICE, slots[i], source=(c.state, c.loc))     # in place: for every holder
        if target is DEVICE:                   # queued for the step's rebuild, timed there (restore_seconds)
            for st, group in rebuilt.items():
                record(st, DEVICE, group, time.perf_counter())
        up = [(i, s, k) for i, (s, k) in enumerate(rest) if s.chunks[k].state is DISK_HIDDEN]
        if up:                                 # disk hidden states up to the host hidden pool
            t0 = time.perf_counter()
            self.transfer.copy_hidden(tiers.disk_hidden, [s.chunks[k].loc for _, s, k in up], tiers.hidden,
                                      [slots[i] for i, _, _ in up])
            record(DISK_HIDDEN, HIDDEN, [(s, k) for _, s, k in up], t0)
            self.disk_state.mark_changed(tiers.sharing.holder_ids([(s, k) for _, s, k in up]))   # their rows go
            for i, s, k in up:
                tiers.vacate(s.chunks[k])
                s.chunks[k].assign(HIDDEN, slots[i])
        for source in (HOST, DISK):
            group = [(i, s, k) for i, (s, k) in enumerate(rest) if s.chunks[k].state is source]
            if not group:
                continue
            t0 = time.perf_counter()
            ev = self.transfer.copy(tiers.pool(source), [s.chunks[k].loc for _, s, k in group],
                                    tiers.pool(target), [slots[i] for i, _, _ in group])
            if ev and wait:
                self.transfer.settle(tiers.pool(target))
            record(source, target, [(s, k) for _, s, k in group], t0, landed=not ev or wait)
            if ev:
                events.append(ev)
            if source is DISK:                 # their slots stay, as their disk copies: no index change
                self.disk_state.keep([(s, k) for _, s, k in group])
            for i, s, k in group:
                if source is HOST:
                    tiers.vacate(s.chunks[k])
                s.chunks[k].assign(target, slots[i])
                if target is DEVICE:
                    self.hidden.computed(slots[i], captured=False)     # K/V only: its hidden states are unknown
                    n = s.chunk_len(k, bs)
                    if source is HOST:
                        self.counters.swapped_in_host += n
                    else:
                        self.counters.swapped_in_disk += n
        # after the chunks are in place (making room above prunes the marks); a shared one moved for every holder.
        # No move up changes what the disk index names a chunk by (disk KV keeps its slot as its copy, a rebuild its
        # source), but disk hidden states to the host (marked above): the other holders' rows are not recomputed
        self.sessions.mark_moved(items, also=(s.session_id for s in movers), rows=False)
        return events

    def finish(self, restore: HiddenRestore | None) -> None:
        """Outside a step (a move up): rebuild every layer of `restore`'s chunks now, then `settle` them."""
        if restore is not None:
            restore.finish(self.tiers.device)
            self.settle(restore, ok=True)

    def settle(self, restore: HiddenRestore | None, ok: bool) -> None:
        """After a step: `ok` (the K/V of every layer was rebuilt) frees the hidden slots the blocks
        were rebuilt from; otherwise the chunks go back to their hidden form and their blocks are freed."""
        if restore is None:
            return
        for (sid, k, source), block in restore.chunks:
            s = self.sessions.find(sid)
            c = s.chunks[k] if s is not None and k < len(s.chunks) else None
            if c is None or c.state is not DEVICE or c.loc != block or c.source != source:
                continue       # the chunk was released meanwhile (its slots went with it)
            state, slot = source
            if state is DISK_HIDDEN:
                self.disk_state.mark_changed(self.tiers.sharing.holder_ids([(s, k)]))
            if ok:
                self.tiers.pool(state).free([slot])
                c.source = None
            else:
                self.tiers.device.free([block])
                c.assign(state, slot)
                self.sessions.mark_moved([(s, k)])
                n = s.chunk_len(k, self.block_size)
                self.counters.restored_hidden -= n
                self.counters.restored_hidden_disk -= n if state is DISK_HIDDEN else 0
        restore.chunks = []
