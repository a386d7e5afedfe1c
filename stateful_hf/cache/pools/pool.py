"""A physical pool of KV blocks: preallocated tensor + free list. No policy lives here.

Every tier (device, host, disk) is a BlockPool of the same geometry, so one copy routine moves
chunks between any two of them, layer by layer. Every pool keeps the contract of `tier.py`'s `TierPool`.

Memory is taken as it is used: a pool in (unpinned) CPU memory is an anonymous private mapping with
MAP_NORESERVE (`lazy_zeros`), so creating it reserves address space only and the OS commits a page,
zero-filled, when it is first written. Low block ids are handed out first, so a pool's committed
memory grows with its high-water mark. `reserved_bytes` is the pool's size, `committed_bytes()`
its resident pages (mincore). Pinned host pools (CUDA) and device pools on a GPU are committed at once.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from dataclasses import dataclass

import torch

from ..spec import KVSpec
from .tier import LazyFree

PAGE = mmap.PAGESIZE


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """A CPU tensor of zeros backed by an anonymous private mapping (nothing committed until written),
    and the mapping (keep it alive as long as the tensor)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize
    for d in shape:
        nbytes *= d
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype), None
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0),
                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mem, dtype=dtype).view(shape), mem


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the pages under a contiguous CPU tensor that are resident in RAM (mincore(2))."""
    length = t.numel() * t.element_size()
    if length == 0:
        return 0
    addr = t.data_ptr()
    start = addr // PAGE * PAGE
    n = (addr + length - start + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * n)()
    if libc().mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * PAGE), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return int(torch.frombuffer(vec, dtype=torch.uint8).bitwise_and(1).sum()) * PAGE


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library of this process (mincore, madvise), loaded once."""
    return ctypes.CDLL(None, use_errno=True)


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
               pin_memory: bool = False) -> tuple[torch.Tensor, mmap.mmap | None]:
    """Zeros for a pool: lazily committed on the CPU unless pinned (then, like off the CPU, at once)."""
    device = torch.device(device)
    if device.type == "cpu" and not (pin_memory and torch.cuda.is_available()):
        return lazy_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory and device.type == "cpu"), None


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the maximal runs where both id lists count up by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class BlockPool:
    """`data` is [layers, num_blocks, 2, block_size, kv_heads, head_dim]; dim 2 is (K, V).

    Contract (`tier.TierPool`): `allocate`, `free`, `give_back` and `take` are the only mutations of
    the free list; the caller (the store) owns the mapping of blocks to sessions and holds its lock
    around every call. `transfer` (given by the store; None outside one): frees go through
    `Transfer.release` (transfer.py). `device_tier`: this is the store's device pool.
    """

    virtual = False       # not vAttention's layout (virtual/pool.py)
    slice_blocks = True   # block b of every layer is data[:, b] (transfer.copy_now slices runs of ids)
    pages_released = 0    # the virtual layout's counters: none here
    cached_bytes = 0
    blocks_prefetched = 0

    def __init__(self, spec: KVSpec, num_blocks: int, device: torch.device | str | None = None, *,
                 pin_memory: bool = False, data: torch.Tensor | None = None, transfer: LazyFree | None = None,
                 device_tier: bool = False):
        self.spec = spec
        self.num_blocks = num_blocks
        self.transfer = transfer
        self.device_tier = device_tier
        shape = (spec.num_layers, num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self._mem = None                  # the lazy mapping under `data`, if any
        if data is None:
            device = torch.device(device) if device is not None else spec.device
            data, self._mem = host_zeros(shape, spec.dtype, device, pin_memory)
        elif tuple(data.shape) != shape or data.dtype != spec.dtype:
            raise ValueError(f"pool data must be {shape} {spec.dtype}, got {tuple(data.shape)} {data.dtype}")
        self.data = data
        self._views: tuple[torch.Tensor, list] | None = None     # (data they view, per layer (K, V, rows))
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
    def bytes_per_slot(self) -> int:
        return self.spec.bytes_per_block

    @property
    def bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def reserved_bytes(self) -> int:
        return self.bytes

    def committed_bytes(self) -> int:
        """Resident bytes: the touched pages of a lazy pool, else (committed at creation) all of it."""
        return resident_bytes(self.data) if self._mem is not None else self.bytes

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
        self.give_back(self.transfer.release(self, blocks) if self.transfer is not None and blocks else blocks)

    def give_back(self, blocks: list[int]) -> None:
        """Blocks no copy touches any more join the free list (`free`, and the transfer engine for
        blocks whose freeing it deferred). Mutates: the free list."""
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
        """Views (K, V) of one layer, each [num_blocks, block_size, kv_heads, head_dim] (strided); made once."""
        k, v, _ = self._layer_views()[layer]
        return k, v

    def layer_rows(self, layer: int) -> torch.Tensor | None:
        """One layer as rows [num_blocks * 2 * block_size, kv_heads, head_dim] (a view; `slot_rows` indexes it);
        None where `data` is not one contiguous tensor of that layout."""
        return self._layer_views()[layer][2]

    def slot_rows(self, slots: torch.Tensor) -> SlotRows:
        """The rows of `layer_rows` that slots [T] (block * block_size + offset) name, K and V: once per step."""
        bs = self.spec.block_size
        key = slots + (slots // bs) * bs          # block * 2 * bs + offset
        return SlotRows(key, key + bs)

    def _layer_views(self) -> list:
        """Per layer (K view, V view, rows view) of the current `data`, made on first use (a subclass may swap
        `data`: the views follow it)."""
        if self._views is None or self._views[0] is not self.data:
            d = self.data
            flat = d.is_contiguous() and d.dim() == 6
            self._views = (d, [(d[i, :, 0], d[i, :, 1], d[i].view(-1, *d.shape[-2:]) if flat else None)
                               for i in range(d.shape[0])])
        return self._views[1]


@dataclass(frozen=True, slots=True)
class SlotRows:
    """A step's K/V destinations in a `BlockPool` layer seen as rows (`layer_rows`), made once per step."""

    key: torch.Tensor           # [T] long, the pool's device
    value: torch.Tensor         # [T] key + block_size


def write_kv(
    key_cache: torch.Tensor,    # [num_blocks, block_size, Hkv, D] one layer of a pool (a view of it)
    value_cache: torch.Tensor,
    key: torch.Tensor,          # rows [T, Hkv, D], or whole blocks [n, block_size, Hkv, D]
    value: torch.Tensor,
    slots: torch.Tensor,        # rows: [T] block * block_size + offset; blocks: [n] block ids. Long, caches' device
    rows: tuple[torch.Tensor, SlotRows] | None = None,   # rows only: (BlockPool.layer_rows, BlockPool.slot_rows)
) -> None:
    """Store K/V in one pool layer: row t at slot `slots[t]` (vLLM's reshape_and_cache), or, given
    whole blocks, block i at block `slots[i]` (a restore: one copy per block instead of per row).
    With `rows` (the step's slots made into row indices of the layer once, by the pool that holds the
    caches), two `index_copy_` there and no index arithmetic. Mutates the two caches only. The cache keeps
    values in its own dtype, not autograd history: gradients never flow into stored KV."""
    if key.requires_grad or value.requires_grad:
        key, value = key.detach(), value.detach()
    if key.dtype != key_cache.dtype:
        key = key.to(key_cache.dtype)
    if value.dtype != value_cache.dtype:
        value = value.to(value_cache.dtype)
    if rows is not None:
        flat, at = rows
        flat.index_copy_(0, at.key, key)
        flat.index_copy_(0, at.value, value)
        return
    if key.dim() == 4:
        key_cache.index_copy_(0, slots, key)
        value_cache.index_copy_(0, slots, value)
        return
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key
    value_cache[blocks, offsets] = value
