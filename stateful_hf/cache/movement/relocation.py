"""Relocation: a session's chunks moved on request — chosen chunks of an idle session to a named tier
(`store.move`: operators, tests, hints, migration), made of placement's moves down and swap-in's moves
up, and a (possibly busy) session's device chunks one tier down (`store.evict`).

Collaborators: the pools, placement, swap-in, the hidden tier (`feature.NoHiddenStates` when the store
captures nothing), the registered features (`settle` before a session's chunks move), the transfer
engine. Mutates: the chosen chunks (and, to make room, other idle sessions' chunks by the policy).
Nothing moves when a check fails. Runs with the store lock held, under `placement.moving(reason)`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..errors import SessionBusyError
from ..pools.tier_pools import TierPools
from ..sessions.session import ON_DISK, TIERS, ChunkState, Session
from .placement import Placement
from .swap_in import SwapIn
from .transfer import Transfer

if TYPE_CHECKING:
    from ..feature import NoHiddenStates, StoreFeature
    from ..hidden.tier import HiddenTier

DEVICE, HOST, HIDDEN, DISK = ChunkState.DEVICE, ChunkState.HOST, ChunkState.HIDDEN, ChunkState.DISK
DISK_HIDDEN, DROPPED = ChunkState.DISK_HIDDEN, ChunkState.DROPPED
_ORDER = list(ChunkState)      # up is towards the device


def chunk_indices(chunks) -> list[int]:
    """`move`'s chunk argument: an iterable of int chunk indices (not bools, floats or strings)."""
    if isinstance(chunks, (str, bytes)) or not isinstance(chunks, Iterable):
        raise TypeError(f"chunks must be an iterable of chunk indices (ints), got {chunks!r}")
    out = []
    for k in chunks:
        try:
            if isinstance(k, bool):
                raise TypeError
            out.append(operator.index(k))       # ints, numpy / 0-d torch integers
        except TypeError:
            raise TypeError(f"chunk indices must be ints, got {k!r} ({type(k).__name__})") from None
    return out


def target_state(tier: str) -> ChunkState:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; choose from {TIERS}")
    return ChunkState(tier)


class Relocation:
    def __init__(self, tiers: TierPools, placement: Placement, swap_in: SwapIn, hidden: HiddenTier | NoHiddenStates,
                 transfer: Transfer):
        self.tiers, self.placement, self.swap_in = tiers, placement, swap_in
        self.hidden, self.transfer = hidden, transfer
        self.features: tuple[StoreFeature, ...] = ()      # registered by `store_parts.assemble`

    def move(self, s: Session, chunks: list[int], target: ChunkState) -> None:
        """`KVStore.move` on `s`: move chosen chunks of an idle session to `tier` ("device", "host", "hidden", "disk",
        "dropped"). An operator and test hook; making room moves other idle sessions' chunks down by
        the policy. Dropped chunks cannot move up (only their ids remain: the next turn recomputes
        them). Only device chunks whose hidden states were captured become "hidden"; hidden chunks
        move to the device (K/V rebuilt by projection), to "disk" (where they stay hidden states,
        DISK_HIDDEN, and come back with "hidden" or "device") or are dropped. `reason` labels the
        moves in `self.moves` (moves.REASONS)."""
        if s.busy:
            raise SessionBusyError(s.session_id)
        for f in self.features:
            f.settle(s)
        ks = sorted(set(chunks))
        if any(not 0 <= k < len(s.chunks) for k in ks):
            raise IndexError(f"session {s.session_id!r} has chunks 0..{len(s.chunks) - 1}, got {ks}")
        for k in ks:                     # a shared chunk moves for every holder: none may be running
            for h in self.tiers.sharing.holders(s, k):
                if h.busy:
                    raise SessionBusyError(h.session_id)
        self.hidden.check_move(s, ks, target)
        if target is not DROPPED and self.tiers.pool(target) is None:
            raise ValueError(f"this store has no {target.value} tier")
        reads = [k for k in ks if s.chunks[k].state in ON_DISK and
                 _ORDER.index(s.chunks[k].state) > _ORDER.index(target)]
        if self.placement.prove(s, reads):    # chunks that failed their checksum are dropped, not moved
            ks = [k for k in ks if k not in reads or s.chunks[k].state is not DROPPED]
        dest = {k: self.hidden.target(s.chunks[k].state, target) for k in ks}
        ks = [k for k in ks if s.chunks[k].state is not dest[k]]
        if target is not DROPPED and any(s.chunks[k].state is DROPPED for k in ks):
            raise ValueError(f"session {s.session_id!r}: dropped chunks keep only token ids and cannot move "
                             f"to {target.value}; the next turn recomputes them")
        up = [k for k in ks if _ORDER.index(s.chunks[k].state) > _ORDER.index(dest[k])]
        down = [k for k in ks if k not in up]
        excl = {s.session_id}
        groups = {state: [(s, k) for k in down if s.chunks[k].state is state]     # before any moves
                  for state in (DEVICE, HOST, HIDDEN, DISK, DISK_HIDDEN)}
        for state, items in groups.items():
            if items:
                self.placement.move_down(items, state, excl, target=dest[items[0][1]], strict=True)
        if up:
            restore = self.hidden.new_restore(self.placement.counters)
            self.swap_in.move_up([(s, k) for k in up], target, excl, restore=restore, wait=True)
            self.swap_in.finish(restore)
            self.transfer.synchronize()

    def prefetch_shared(self, blocks: int) -> int:
        """`KVStore.prefetch_shared`: the chunks that several sessions share and that sit on the host or disk
        move up to the device, most holders first, at most `blocks` of them; none whose holders are busy.
        Returns the tokens moved (each counted once)."""
        seen, found = set(), []
        for s in self.tiers.sharing.sharing_sessions(self.placement.sessions.find):
            for k, c in enumerate(s.chunks):
                if c.shared and c.state in (HOST, DISK) and id(c) not in seen:
                    seen.add(id(c))
                    found.append((-len(c.entry.holders), s.session_id, k, s))
        found.sort(key=operator.itemgetter(0, 1, 2))
        chosen: dict[str, tuple[Session, list[int]]] = {}
        for _, sid, k, s in found[:max(blocks, 0)]:
            chosen.setdefault(sid, (s, []))[1].append(k)
        moved = 0
        for s, ks in chosen.values():
            try:
                self.move(s, ks, DEVICE)
            except SessionBusyError:
                continue
            moved += sum(len(s.chunks[k].entry.ids) for k in ks if s.chunks[k].state is DEVICE
                         and s.chunks[k].entry is not None)
        return moved

    def evict(self, s: Session) -> int:
        """`KVStore.evict`: the device chunks of `s` (not those a busy co-holder runs on) one tier down
        (host if present, else dropped), its layered chunks settled to the host, its cached shadows
        freed. Returns device blocks freed. Allowed on a busy session: the engine suspends a running
        request this way when decoding runs out of blocks, keeping the session's lease."""
        freed = sum(f.settle(s) for f in self.features)
        items = [(s, k) for k, c in enumerate(s.chunks) if c.state is DEVICE
                 and all(h is s or not h.busy for h in self.tiers.sharing.holders(s, k))]
        self.placement.move_down(items, DEVICE, {s.session_id})
        return len(items) + freed + self.placement.drop_shadows(s)
