"""The pools per tier (`TierPools`): which pool holds a chunk state's slots, which tier is below which,
and the one way a chunk's slots are given back; and their room (`Capacity`): what a step could get now.

Owns: the residue table (LayerKV's device blocks split by residue class, `layerwise/residues.py`;
None without layerwise_kv), a sub-allocator of the device pool. References (does not create): the
device, host, hidden, disk and disk-hidden pools (`store_parts.open_pools` opens them; each keeps
`tier.TierPool`'s contract, so callers ask a pool what it is, never probe it). Mutates:
pools' free lists (`release`, `vacate`, `free_residue`, `place_residues`) and the released chunk (it
becomes DROPPED; a chunk other sessions share stays theirs: the prefix sharing part,
`prefix/sharing.py`, says so). Tells the disk state when a disk slot is given back.
Every method runs with the store lock held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ...options import Layout
from ..prefix.sharing import PrefixSharing
from ..sessions.session import ON_DISK, Chunk, ChunkState, Session, SessionTable
from ..turn import ChunkNeeds, PoolSizes, Room, blocks_at_most, check_factor, needs, places_of
from .pool import BlockPool
from .tier import TierPool

if TYPE_CHECKING:
    from ..disk.state import DiskState
    from ..disk.tier import DiskTier
    from ..feature import NoDisk
    from ..hidden.states import HiddenPool
    from ..layerwise.residues import ResidueTable

DEVICE, HOST, DISK, DROPPED = ChunkState.DEVICE, ChunkState.HOST, ChunkState.DISK, ChunkState.DROPPED
HIDDEN, DISK_HIDDEN, LAYERED = ChunkState.HIDDEN, ChunkState.DISK_HIDDEN, ChunkState.LAYERED


class TierPools:
    def __init__(self, device: TierPool, host: BlockPool | None, disk: DiskTier | None, hidden: HiddenPool | None,
                 disk_hidden: HiddenPool | None, disk_state: DiskState | NoDisk, sharing: PrefixSharing,
                 residues: ResidueTable | None, let_go: Callable[[Session, Chunk], None],
                 recount: Callable[[str], None]):
        self.device, self.host, self.disk = device, host, disk
        self.sharing = sharing
        self.hidden, self.disk_hidden = hidden, disk_hidden
        self.disk_state = disk_state           # `feature.NoDisk` without a disk tier (then no chunk is ON_DISK)
        self.residues = residues               # layerwise_kv only; mutated only through place_residues / free_residue
        self.let_go = let_go                   # `SessionTable.let_go`: a session let go of a chunk
        self.recount = recount                 # `SessionTable.recount`: whose tokens per tier may have changed
        self._by_state = {DEVICE: device, HOST: host, DISK: disk.pool if disk is not None else None,
                          HIDDEN: hidden, DISK_HIDDEN: disk_hidden,
                          LAYERED: host}       # a LAYERED chunk's host slot (its residue block: the table)
        present = [t for t in (DEVICE, HOST, DISK) if self._by_state[t] is not None] + [DROPPED]
        self._below = {t: present[present.index(t) + 1] for t in present[:-1]}
        self._below[HIDDEN] = DISK_HIDDEN if disk_hidden is not None else DROPPED
        self._below[DISK_HIDDEN] = DROPPED

    def sizes(self) -> PoolSizes:
        """The device and host pools' sizes."""
        return PoolSizes(self.device.num_blocks, 0 if self.host is None else self.host.num_blocks)

    def pool(self, state: ChunkState) -> TierPool | None:
        """The pool holding slots of chunks in `state` (None: DROPPED, or a tier this store lacks)."""
        return self._by_state.get(state)

    def below(self, state: ChunkState) -> ChunkState:
        """Where chunks in `state` go when their tier needs room (absent tiers are skipped)."""
        return self._below[state]

    def release(self, s: Session, k: int) -> None:
        """Session `s` lets go of chunk k, which becomes a fresh DROPPED chunk of `s`; what it holds
        (slot, shadow, hidden source, residue) is freed unless other sessions still hold it (a shared
        chunk)."""
        c = s.chunks[k]
        self.recount(s.session_id)
        if c.state in ON_DISK or (c.source is not None and c.source[0] in ON_DISK):
            self.disk_state.mark_changed((s.session_id,))     # its disk rows change; vacate's callers mark theirs
        if not self.sharing.detach(s, k):      # else others still hold it: they keep its device block, if any
            self.vacate(c)
            s.chunks[k] = Chunk()
        self.let_go(s, c)

    def vacate(self, c: Chunk) -> None:
        """Free whatever chunk `c` holds; its fields are left for the caller to reassign
        (`Chunk.assign`: in place, so for every holder of a shared chunk)."""
        if c.loc is not None:
            self._by_state[c.state].free([c.loc])
        if c.shadow is not None:
            self.device.free([c.shadow])
        if c.source is not None:
            self._by_state[c.source[0]].free([c.source[1]])
        if c.residue_block is not None:
            self.free_residue(c)

    def place_residues(self, factor: int, owners: list[tuple[str, int]],
                       new_blocks: list[int]) -> list[tuple[int, int]]:
        """(block, residue) per owner: free residues of open residue blocks first, then `new_blocks`
        (device blocks just allocated, exactly `residues.blocks_needed(factor, len(owners))`)."""
        return self.residues.place(factor, owners, new_blocks)

    def free_residue(self, c: Chunk) -> bool:
        """Give back the residue `c` holds (the caller clears `c.residue_block`); a residue block with
        no residue left returns to the device pool. True if a device block was freed."""
        block, _, residue = c.residue_block
        if self.residues.release(block, residue):
            self.device.free([block])
            return True
        return False

    @staticmethod
    def used_bytes(pool: TierPool | None) -> int:
        """Bytes of `pool`'s slots in use (K/V or hidden-state slots), 0 for an absent tier."""
        if pool is None:
            return 0
        return (pool.num_blocks - pool.num_free) * pool.bytes_per_slot


NO_EXCLUDE: frozenset[str] = frozenset()


def count_chunks(sessions: Iterable[Session], state: ChunkState, sharing: PrefixSharing, *, shadows: bool,
                 idle_only: bool) -> int:
    """Chunk objects of `sessions` in `state` (with `shadows`, also HOST/HIDDEN chunks cached on the
    device), a shared chunk once; with `idle_only`, only those no busy session holds. One pass, a set
    only for chunks with several holders: this runs every step (`StepPlanner.plan`, and the engine
    scheduler's `room`)."""
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


def device_room(tiers: TierPools, busy: Iterable[Session]) -> int:
    """`Capacity.device_blocks` from the pool's own count, given the `busy` sessions: every device block
    not free holds one DEVICE chunk, one shadow or one LayerKV residue block (`check_integrity`), so the
    free and idle ones are the blocks less the residue blocks less the chunks (and shadows) a busy
    session holds, a shared chunk once. `check_integrity` compares it with a count of every session."""
    residues = len(tiers.residues.blocks) if tiers.residues is not None else 0
    held = count_chunks(busy, DEVICE, tiers.sharing, shadows=True, idle_only=False)
    return tiers.device.num_blocks - residues - held


class Capacity:
    """What a step could get now and what one would take: the engine scheduler's questions
    (`device_blocks` through `KVStore.room`, `host_blocks`, `device_slots`, `chunk_needs`, `blocks_needed`).
    A shared chunk counts once, and only if none of its holders is busy; `turn.py` classifies chunks.
    Mutates nothing. Every method runs with the store lock held."""

    def __init__(self, sessions: SessionTable, tiers: TierPools, layout: Layout):
        self.sessions, self.tiers, self.sharing = sessions, tiers, tiers.sharing
        self.layout, self.block_size = layout, tiers.device.spec.block_size

    def chunk_needs(self, s: Session, end: int, length: int | None, factor: int) -> ChunkNeeds:
        """Per chunk below `end`, what a step of `s` must do (`turn.needs`)."""
        return needs(places_of(s), end, s.num_tokens if length is None else length, factor, self.block_size)

    def held_blocks(self, s: Session) -> float:
        """Device blocks `s` holds: a whole block per DEVICE chunk, 1/f of one per residue block."""
        return sum(1.0 if c.state is ChunkState.DEVICE else (1.0 / c.residue_block[1] if c.residue_block is not None
                                                             else 0.0) for c in s.chunks)

    def blocks_needed(self, s: Session, end: int, length: int | None, factor: int) -> int:
        """Device blocks such a step takes at most: a block per chunk it fills or copies up at factor 1;
        at keep factor f != 1, ceil(fills / f) residue blocks (none at 0) plus the copies (HOST chunks
        are read in place)."""
        fills, copies, _ = self.chunk_needs(s, end, length, factor)
        return blocks_at_most(factor, len(fills)) + len(copies)

    def residue_blocks_needed(self, factor: int, n_chunks: int) -> int:
        """Device blocks `n_chunks` new chunks of keep factor `factor` take now (no residue block is open
        without layerwise_kv: the bound `blocks_at_most`)."""
        check_factor(factor, self.tiers.device.spec.num_layers)
        if self.tiers.residues is None or factor == 1:
            return blocks_at_most(factor, n_chunks)
        return self.tiers.residues.blocks_needed(factor, n_chunks)

    def device_blocks(self) -> int:
        """Free device blocks, plus idle sessions' cached shadows and DEVICE chunks (which `plan_step`
        moves down). Busy sessions' blocks do not count. O(the busy sessions' chunks), whatever the
        number of sessions on the device (`device_room`)."""
        return device_room(self.tiers, self.sessions.busy())

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
        if self.layout is not Layout.VIRTUAL:
            return None
        pool = self.tiers.device
        idle = sum(1 for s in self.sessions if not s.busy and pool.slot_of(s.session_id) is not None)
        return pool.free_slots + idle

    def room(self) -> Room:
        """What a step could get now (host slots only where a layer-wise step can fill them)."""
        return Room(self.device_blocks(), self.host_blocks() if self.tiers.residues is not None else 0,
                    self.device_slots())

    def has_slot(self, s: Session) -> bool | None:
        """Virtual layout: whether `s` holds a device slot; None for the paged layout."""
        return None if self.layout is not Layout.VIRTUAL else self.tiers.device.slot_of(s.session_id) is not None
