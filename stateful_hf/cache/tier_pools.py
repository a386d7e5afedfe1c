"""The pools per tier: which pool holds a chunk state's slots, which tier is below which, and the
one way a chunk's slots are given back.

Owns: the residue table (LayerKV's device blocks split by residue class, `layerwise/residues.py`;
None without layerwise_kv), a sub-allocator of the device pool. References (does not create): the
device, host, hidden, disk and disk-hidden pools (`store_parts.open_pools` opens them). Mutates:
pools' free lists (`release`, `vacate`, `free_residue`, `place_residues`) and the released chunk (it
becomes DROPPED; a chunk other sessions share stays theirs: the prefix sharing part,
`prefix/sharing.py`, says so). Tells the disk state when a disk slot is given back.
Every method runs with the store lock held.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .pool import BlockPool
from .prefix.sharing import PrefixSharing
from .session import ON_DISK, Chunk, ChunkState, Session

if TYPE_CHECKING:
    from .disk.state import DiskState
    from .disk.tier import DiskTier
    from .hidden.states import HiddenPool
    from .layerwise.residues import ResidueTable

DEVICE, HOST, DISK, DROPPED = ChunkState.DEVICE, ChunkState.HOST, ChunkState.DISK, ChunkState.DROPPED
HIDDEN, DISK_HIDDEN, LAYERED = ChunkState.HIDDEN, ChunkState.DISK_HIDDEN, ChunkState.LAYERED


class TierPools:
    def __init__(self, device, host: BlockPool | None, disk: DiskTier | None, hidden: HiddenPool | None,
                 disk_hidden: HiddenPool | None, disk_state: DiskState | None, sharing: PrefixSharing,
                 residues: ResidueTable | None):
        self.device, self.host, self.disk = device, host, disk
        self.sharing = sharing
        self.hidden, self.disk_hidden = hidden, disk_hidden
        self.disk_state = disk_state           # None without a disk tier (then no chunk is ON_DISK)
        self.residues = residues               # layerwise_kv only; mutated only through place_residues / free_residue
        self._by_state = {DEVICE: device, HOST: host, DISK: disk.pool if disk is not None else None,
                          HIDDEN: hidden, DISK_HIDDEN: disk_hidden,
                          LAYERED: host}       # a LAYERED chunk's host slot (its residue block: the table)
        present = [t for t in (DEVICE, HOST, DISK) if self._by_state[t] is not None] + [DROPPED]
        self._below = {t: present[present.index(t) + 1] for t in present[:-1]}
        self._below[HIDDEN] = DISK_HIDDEN if disk_hidden is not None else DROPPED
        self._below[DISK_HIDDEN] = DROPPED

    def pool(self, state: ChunkState):
        """The pool holding slots of chunks in `state` (None: DROPPED, or a tier this store lacks)."""
        return self._by_state.get(state)

    def below(self, state: ChunkState) -> ChunkState:
        """Where chunks in `state` go when their tier needs room (absent tiers are skipped)."""
        return self._below[state]

    def release(self, s: Session, k: int) -> None:
        """Session `s` lets go of chunk k, which becomes a fresh DROPPED chunk of `s`; what it holds
        (slot, shadow, hidden source, residue) is freed unless other sessions still hold it (a shared
        chunk)."""
        if self.sharing.detach(s, k):
            return
        self.vacate(s.chunks[k])
        s.chunks[k] = Chunk()

    def vacate(self, c: Chunk) -> None:
        """Free whatever chunk `c` holds; its fields are left for the caller to reassign
        (`Chunk.assign`: in place, so for every holder of a shared chunk)."""
        if c.loc is not None:
            self._by_state[c.state].free([c.loc])
        if c.shadow is not None:
            self.device.free([c.shadow])
        if c.source is not None:
            self._by_state[c.source[0]].free([c.source[1]])
            if c.source[0] is DISK_HIDDEN:
                self.disk_state.mark_changed()
        if c.residue_block is not None:
            self.free_residue(c)
        if c.state in ON_DISK:
            self.disk_state.mark_changed()

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
    def used_bytes(pool) -> int:
        """Bytes of `pool`'s slots in use (K/V or hidden-state slots), 0 for an absent tier."""
        if pool is None:
            return 0
        hidden = getattr(pool, "hidden_spec", None)
        per = hidden.bytes_per_block if hidden is not None else pool.spec.bytes_per_block
        return (pool.num_blocks - pool.num_free) * per
