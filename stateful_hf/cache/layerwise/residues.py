"""Residue blocks: device blocks split by residue class among LAYERED chunks (LayerKV's layer-wise allocation).

The device pool is [layers, blocks, 2, block_size, Hkv, D]: a block is one token range for every
layer. A LAYERED chunk with keep factor f and residue r needs only the layers l with l % f == r on
the device, so up to f such chunks with distinct residues occupy one physical block, each owning its
own layers of it. A residue block in mode f holds owners[r] for r < f (None: residue r unused).
No policy here; the store holds its lock around every call.
"""

from __future__ import annotations


def kept_layers(num_layers: int, factor: int, residue: int) -> list[int]:
    """Layers a chunk of keep factor `factor` and `residue` keeps on the device: 0 keeps none, 1 all,
    f >= 2 the evenly spaced r, r + f, ... (8 layers, f = 2, r = 1 -> 1, 3, 5, 7 as in LayerKV)."""
    if factor == 0:
        return []
    return list(range(residue, num_layers, factor))


class ResidueTable:
    """blocks: {device block: (factor, [owner (session id, chunk index) or None] * factor)}.

    Invariant (checked by the store's audit): a block is in this table iff some LAYERED chunk's
    `residue_block` names it; its owners are exactly those chunks, at their residues; it is never free in
    the device pool and never owned whole by a DEVICE chunk or a shadow."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int, list[tuple[str, int] | None]]] = {}

    def free_residues(self, factor: int) -> int:
        """Unused residue slots in the residue blocks already open in mode `factor`."""
        return sum(owners.count(None) for f, owners in self.blocks.values() if f == factor)

    def blocks_needed(self, factor: int, n: int) -> int:
        """New device blocks n more chunks of keep factor `factor` would take (0 for factors 0 and 1:
        factor 1 chunks take whole blocks, counted by the caller)."""
        if factor < 2:
            return 0
        return max(0, -(-(n - self.free_residues(factor)) // factor))

    def place(self, factor: int, owners: list[tuple[str, int]], new_blocks: list[int]) -> list[tuple[int, int]]:
        """Give each owner a (block, residue): free residues of existing blocks first, then `new_blocks`
        (exactly `blocks_needed(factor, len(owners))` fresh device blocks). Returns one per owner."""
        if len(new_blocks) != self.blocks_needed(factor, len(owners)):
            raise ValueError(f"{len(owners)} chunks of factor {factor} need "
                             f"{self.blocks_needed(factor, len(owners))} new blocks, got {len(new_blocks)}")
        for b in new_blocks:
            if b in self.blocks:
                raise ValueError(f"block {b} is already a residue block")
            self.blocks[b] = (factor, [None] * factor)
        out = []
        todo = iter(owners)
        for b, (f, slots) in sorted(self.blocks.items()):
            if f != factor:
                continue
            for r in range(f):
                if slots[r] is None:
                    who = next(todo, None)
                    if who is None:
                        return out
                    slots[r] = who
                    out.append((b, r))
        if len(out) != len(owners):
            raise AssertionError("residue placement ran out of residues")
        return out

    def release(self, block: int, residue: int) -> bool:
        """Give residue `residue` of `block` back; True when the block is now unused (the caller frees it)."""
        factor, owners = self.blocks[block]
        owners[residue] = None
        if all(o is None for o in owners):
            del self.blocks[block]
            return True
        return False
