"""A physical pool of KV blocks: preallocated tensor + free list. No policy lives here.

Every tier (device, host, disk) is a BlockPool of the same geometry, so one copy routine moves
chunks between any two of them, layer by layer.
"""

from __future__ import annotations

import torch

from .spec import KVSpec


class BlockPool:
    """`data` is [layers, num_blocks, 2, block_size, kv_heads, head_dim]; dim 2 is (K, V).

    Contract: `allocate` and `free` are the only mutations of the free list; the caller (the store)
    owns the mapping of blocks to sessions and holds its lock around every call.
    """

    transfer = None     # set by the store: frees go through Transfer.release (transfer.py)

    def __init__(self, spec: KVSpec, num_blocks: int, device: torch.device | str | None = None, *,
                 pin_memory: bool = False, data: torch.Tensor | None = None):
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (spec.num_layers, num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        if data is None:
            device = torch.device(device) if device is not None else spec.device
            data = torch.zeros(shape, dtype=spec.dtype, device=device,
                               pin_memory=pin_memory and device.type == "cpu" and torch.cuda.is_available())
        elif tuple(data.shape) != shape or data.dtype != spec.dtype:
            raise ValueError(f"pool data must be {shape} {spec.dtype}, got {tuple(data.shape)} {data.dtype}")
        self.data = data
        # Pop from the end: low block ids are handed out first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def num_free(self) -> int:
        """Free blocks, counting those held back for a copy in flight (allocate waits for them)."""
        return len(self._free) + (len(self.transfer.deferred_ids(self)) if self.transfer is not None else 0)

    @property
    def bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def free_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self, n: int, owners: list[tuple[str, int]] | None = None) -> list[int]:
        """n free blocks (any; `owners` matters only to a VirtualPool, where ids follow from owners)."""
        if n > len(self._free) and self.transfer is not None:
            self.transfer.reclaim(self)            # blocks held back for copies in flight (transfer.py)
        if n > len(self._free):
            raise MemoryError(f"pool has {len(self._free)} free blocks, {n} requested")
        out = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        return out

    def take(self, blocks: list[int]) -> None:
        """Mark specific blocks used (reopening a persisted tier)."""
        wanted = set(blocks)
        if len(wanted) != len(blocks) or not wanted <= set(self._free):
            raise ValueError("blocks to take must be distinct and free")
        self._free = [b for b in self._free if b not in wanted]

    def free(self, blocks: list[int]) -> None:
        """Blocks a copy in flight reads or writes return later, once it landed (transfer.py, rule 3)."""
        self._give_back(self.transfer.release(self, blocks) if self.transfer is not None and blocks else blocks)

    def _give_back(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def check(self, owned: set[int]) -> None:
        """Assert every block is free or in `owned` (the chunk tables' blocks), never both or neither."""
        free = self._free + (self.transfer.deferred_ids(self) if self.transfer is not None else [])
        assert len(free) == len(set(free)), "a block is free twice"
        both = set(free) & owned
        assert not both, f"blocks both free and owned: {sorted(both)[:8]}"
        assert len(free) + len(owned) == self.num_blocks, (
            f"{self.num_blocks - len(free) - len(owned)} blocks are neither free nor owned")

    def read(self, layer: int, ids: torch.Tensor) -> torch.Tensor:     # [n, 2, block_size, H, D]
        return self.data[layer].index_select(0, ids)

    def write(self, layer: int, ids: torch.Tensor, blocks: torch.Tensor) -> None:
        self.data[layer].index_copy_(0, ids, blocks)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (K, V) of one layer, each [num_blocks, block_size, kv_heads, head_dim] (strided)."""
        return self.data[layer, :, 0], self.data[layer, :, 1]
