"""A physical pool of KV blocks: preallocated tensor + free list. No policy lives here."""

from __future__ import annotations

import torch

from .spec import KVSpec


class BlockPool:
    """`data` is [layers, num_blocks, 2, block_size, kv_heads, head_dim]; dim 2 is (K, V).

    Contract: `allocate` and `free` are the only mutations of the free list; the caller (the store)
    owns the mapping of blocks to sessions. Not thread-safe on its own: the store holds its lock.
    """

    def __init__(self, spec: KVSpec, num_blocks: int, device: torch.device | str | None = None,
                 pin_memory: bool = False):
        self.spec = spec
        self.num_blocks = num_blocks
        device = torch.device(device) if device is not None else spec.device
        self.data = torch.zeros(
            (spec.num_layers, num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_dim),
            dtype=spec.dtype, device=device, pin_memory=pin_memory and device.type == "cpu",
        )
        # Pop from the end: low block ids are handed out first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"pool has {len(self._free)} free blocks, {n} requested")
        out = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        return out

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (K, V) of one layer, each [num_blocks, block_size, kv_heads, head_dim] (strided)."""
        return self.data[layer, :, 0], self.data[layer, :, 1]
