"""The contract of a tier's pool (`TierPool`), and what a pool asks of the transfer engine (`LazyFree`).

Every pool of a store keeps `TierPool`: the device pool (`pool.BlockPool`, or vAttention's
`virtual/pool.py` `VirtualPool`), the host pool (a `BlockPool` in host memory), the disk tier's
pools (`disk/pool.py`) and the hidden-state pools (`hidden/states.py` `HiddenPool`, and its disk
form). Every pool declares what callers tell pools apart by: `device_tier`, `virtual`,
`slice_blocks`, `bytes_per_slot` and the virtual layout's counters (0 where they do not apply);
nothing looks for an attribute a pool may lack. A pool is given its transfer engine when it is
made (`transfer`; None for a pool outside a store) and frees through it.

Each member's docstring says what it mutates; "reads only" mutates nothing. The caller holds the
store lock around every call (a virtual pool also guards itself: its page mapper thread). Pools hold
no policy and know no chunk: the store's parts own which slot holds what (docs/store.md).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..spec import KVSpec


class LazyFree(Protocol):
    """What a pool asks of the transfer engine (`transfer.Transfer`) about blocks that copies in
    flight read or write (transfer.py, rule 3)."""

    def release(self, pool: TierPool, blocks: list[int]) -> list[int]:
        """Of `blocks` (of `pool`) its owner frees, those free now. Mutates: the blocks held back."""

    def deferred_ids(self, pool: TierPool) -> list[int]:
        """Blocks of `pool` held back until their copies land. Reads only."""

    def reclaim(self, pool: TierPool) -> None:
        """Wait for the copies holding blocks of `pool`. Mutates: `pool`'s free list (`give_back`)."""


@runtime_checkable
class TierPool(Protocol):
    """A tier's preallocated slots (a block of `spec.block_size` tokens each) and their free list."""

    spec: KVSpec             # the store's KV geometry
    num_blocks: int          # slots in all
    data: torch.Tensor       # the storage; block b of every layer is data[:, b] unless `virtual`
    transfer: LazyFree | None   # given at construction: frees go through it (None: a pool outside a store)
    device_tier: bool        # the device tier's pool, the one steps attend over (copies to or from it are queued)
    virtual: bool            # vAttention's layout: `allocate` needs owners; the slot methods of VirtualPool
    slice_blocks: bool       # copies between two such pools slice runs of block ids (`transfer.copy_now`);
                             # False: every write goes through `write` (a virtual pool; the disk tier: pwrite)

    @property
    def device(self) -> torch.device:
        """Where the slots live. Reads only."""

    @property
    def num_free(self) -> int:
        """Free slots, counting those held back for a copy in flight. Reads only."""

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot holds (K/V of every layer, or a hidden chunk's split). Reads only."""

    @property
    def bytes(self) -> int:
        """Bytes of every slot. Reads only."""

    @property
    def reserved_bytes(self) -> int:
        """Bytes of address space reserved. Reads only."""

    @property
    def pages_released(self) -> int:
        """Pages given back to the OS (virtual layout; 0 elsewhere). Reads only."""

    @property
    def cached_bytes(self) -> int:
        """Bytes of free slots kept committed for reuse (virtual layout; 0 elsewhere). Reads only."""

    @property
    def blocks_prefetched(self) -> int:
        """Blocks whose pages were mapped ahead (virtual layout; 0 elsewhere). Reads only."""

    def committed_bytes(self) -> int:
        """Resident bytes. Reads only."""

    def allocate(self, n: int, owners: list[tuple[str, int]] | None = None) -> list[int]:
        """n free slots (`owners`: (session, chunk) per slot, needed by a virtual pool). Mutates: the free list."""

    def free(self, blocks: list[int]) -> None:
        """Slots their owner lets go of (those a copy touches return once it landed). Mutates: the free list."""

    def give_back(self, blocks: list[int]) -> None:
        """Slots no copy touches any more join the free list. Mutates: the free list."""

    def check(self, owned: set[int]) -> None:
        """Assert every slot is free or in `owned`, never both or neither. Reads only."""

    def read(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """K/V of slots `ids` of one layer, [n, 2, block_size, kv_heads, head_dim]. Reads only."""

    def write(self, layer: int, ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Put `blocks` (as `read` returns them) at slots `ids` of one layer. Mutates: those slots."""

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (K, V) of one layer, [num_blocks, block_size, kv_heads, head_dim] (a hidden pool has
        none: TypeError). Reads only."""
