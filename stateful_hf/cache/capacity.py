"""Capacity: what a step could get now and what one would take — the engine scheduler's questions
(`available_blocks`, `available_host_blocks`, `available_slots`, `chunk_needs`, `blocks_needed`).

Collaborators: the session table, the pools and prefix sharing (a shared chunk counts once, and only
if none of its holders is busy), the layered chunks (residue blocks; None without layerwise_kv);
`chunk_needs.py` classifies chunks. Mutates nothing. Every method runs with the store lock held.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .chunk_needs import ChunkNeeds, blocks_at_most, check_factor, needs
from .prefix.sharing import PrefixSharing
from .session import ChunkState, Session
from .session_table import SessionTable
from .tier_pools import TierPools

if TYPE_CHECKING:
    from .layerwise.chunks import LayeredChunks

DEVICE, HOST = ChunkState.DEVICE, ChunkState.HOST
NO_EXCLUDE: frozenset[str] = frozenset()


def count_chunks(sessions: Iterable[Session], state: ChunkState, sharing: PrefixSharing, *, shadows: bool,
                 idle_only: bool) -> int:
    """Chunk objects of `sessions` in `state` (with `shadows`, also HOST/HIDDEN chunks cached on the
    device), a shared chunk once; with `idle_only`, only those no busy session holds. One pass, a set
    only for chunks with several holders: this runs every step (`StepPlanner.plan`, and the engine
    scheduler's `available_blocks`)."""
    n, seen = 0, set()
    for s in sessions:
        if idle_only and s.busy:      # its private chunks are busy, its shared ones have a busy holder
            continue
        for c in s.chunks:
            if c.state is not state and (not shadows or c.shadow is None):
                continue
            e = c.entry
            if e is None or len(e.holders) == 1:        # held by `s` alone
                n += 1
            elif id(c) not in seen:
                seen.add(id(c))
                n += not idle_only or sharing.free_to_move(c, NO_EXCLUDE)
    return n


class Capacity:
    def __init__(self, sessions: SessionTable, tiers: TierPools, layered: LayeredChunks | None, layout: str):
        self.sessions, self.tiers, self.sharing = sessions, tiers, tiers.sharing
        self.layered, self.layout, self.block_size = layered, layout, tiers.device.spec.block_size

    def chunk_needs(self, s: Session, end: int, length: int | None, factor: int) -> ChunkNeeds:
        """`KVStore.chunk_needs`: per chunk below `end`, what a step of `s` must do (`chunk_needs.needs`)."""
        return needs(s, end, s.num_tokens if length is None else length, factor, self.block_size)

    def blocks_needed(self, s: Session, end: int, length: int | None, factor: int) -> int:
        """Device blocks such a step takes at most: a block per chunk it fills or copies up at factor 1;
        at keep factor f != 1, ceil(fills / f) residue blocks (none at 0) plus the copies (HOST chunks
        are read in place)."""
        fills, copies, _ = self.chunk_needs(s, end, length, factor)
        return blocks_at_most(factor, len(fills)) + len(copies)

    def residue_blocks_needed(self, factor: int, n_chunks: int) -> int:
        """Device blocks `n_chunks` new chunks of keep factor `factor` take now (no residue block is open
        without layerwise_kv: the bound `blocks_at_most`)."""
        if self.layered is None:
            return blocks_at_most(check_factor(factor, self.tiers.device.spec.num_layers), n_chunks)
        return self.layered.blocks_needed(factor, n_chunks)

    def device_blocks(self) -> int:
        """Free device blocks, plus idle sessions' cached shadows and DEVICE chunks (which `plan_step`
        moves down). Busy sessions' blocks do not count."""
        return self.tiers.device.num_free + count_chunks(self.sessions, DEVICE, self.sharing, shadows=True,
                                                         idle_only=True)

    def host_blocks(self) -> int:
        """Free host slots plus idle sessions' HOST chunks (which move down to make room); 0 without a host tier."""
        if self.tiers.host is None:
            return 0
        return self.tiers.host.num_free + count_chunks(self.sessions, HOST, self.sharing, shadows=False,
                                                       idle_only=True)

    def device_slots(self) -> int | None:
        """Virtual layout: device slots that busy sessions could still get, the free ones plus those
        held by idle sessions (which a step takes by moving them down). None for the paged layout,
        where only blocks count. Admitting a turn costs one: its session either claims a slot or
        keeps the one it holds out of reach."""
        if self.layout != "virtual":
            return None
        pool = self.tiers.device
        idle = sum(1 for s in self.sessions if not s.busy and pool.slot_of(s.session_id) is not None)
        return pool.free_slots + idle
