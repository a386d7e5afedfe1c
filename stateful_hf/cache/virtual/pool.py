"""vAttention's device layout: each session's KV contiguous in virtual memory, physical pages on demand.

Per layer one K and one V buffer `[slots, max_context, kv_heads, head_dim]` inside one reserved
virtual range; a session owns a slot while it has device blocks; chunk k of the session in slot s
is block `s * blocks_per_slot + k`. So the same memory is both a paged pool (blocks of
`block_size` rows: the paged kernels and every tier copy work unchanged) and, per session, one
contiguous `[length, kv_heads, head_dim]` tensor that dense kernels (SDPA) read without a block table.

CPU: an anonymous `mmap` with MAP_NORESERVE (nothing committed), viewed by torch without a copy; the
OS commits a page on first touch; pages go back with MADV_DONTNEED, which also zeroes them. CUDA:
the driver's virtual memory API (`CudaReservation`), mapping physical chunks of the allocation
granularity as slots fill; the reservation maps its first chunk before `data` is made over the range
(torch asks the driver for the pointer's device, and an unmapped address has none), so one chunk
stays committed while the pool lives.

vAttention's two latency hiders:
  - deferred reclamation: a freed block keeps its committed pages ("cached", up to `keep_bytes` in
    all, oldest given back first; `reclaim()` gives back the rest, and on CUDA an allocation that
    finds no physical memory reclaims first). A cached block holds stale KV, so it is zeroed when it
    is handed out again: no session ever reads another's data.
  - pages mapped ahead: `prefetch(owners)` commits the pages of blocks a session will grow into
    (the next decode step's block) while they are still free, from `PageMapper`'s background thread
    (`virtual/mapper.py`), so the step that allocates them maps nothing. A prefetched block is cached and clean (zeros).
Pool state is guarded by its own lock: the store calls allocate/free under the store lock, the
mapper thread calls prefetch.
"""

from __future__ import annotations

import mmap
import threading

import torch

from ...kernels.blocks import blocks_for
from ..pools.pool import libc
from ..pools.tier import LazyFree
from ..spec import KVSpec
from .reservation import CudaReservation

PAGE = mmap.PAGESIZE


class NoSlotError(MemoryError):
    """Every slot is owned by a session: one must leave the device before another enters."""


class VirtualPool:
    """The contract of every pool (`tier.TierPool`), except that `allocate` needs the owner of each
    block, because a block's id follows from (slot, chunk); plus the slots (`slot_of`, `free_slots`,
    `slots_needed`), deferred reclamation (`reclaim`) and pages mapped ahead (`prefetch`)."""

    virtual = True
    device_tier = True       # always the device tier
    slice_blocks = False     # block b is not data[:, b]: copies go through read / write

    def __init__(self, spec: KVSpec, capacity_blocks: int, max_context: int, keep_bytes: int = 64 << 20, *,
                 transfer: LazyFree | None = None):
        bs = spec.block_size
        self.spec = spec
        self.blocks_per_slot = blocks_for(max_context, bs)
        self.num_slots = capacity_blocks // self.blocks_per_slot
        if self.num_slots < 1:
            raise ValueError(f"virtual layout: the capacity ({capacity_blocks * bs} tokens) holds no slot of "
                             f"max_context {self.blocks_per_slot * bs} tokens; raise device_capacity")
        self.num_blocks = self.num_slots * self.blocks_per_slot
        self.slot_len = self.blocks_per_slot * bs
        shape = (spec.num_layers, 2, self.num_slots, self.slot_len, spec.num_kv_heads, spec.head_dim)
        itemsize = torch.empty((), dtype=spec.dtype).element_size()
        self.reserved_bytes = itemsize
        for d in shape:
            self.reserved_bytes *= d
        if spec.device.type == "cuda":
            self._mem = CudaReservation(self.reserved_bytes, spec.device)
            self.data = self._mem.tensor(shape, spec.dtype)
        else:
            self._mem = mmap.mmap(-1, self.reserved_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                  | getattr(mmap, "MAP_NORESERVE", 0), prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self.data = torch.frombuffer(self._mem, dtype=spec.dtype).view(shape)
        self._row_bytes = spec.num_kv_heads * spec.head_dim * itemsize
        self._used: dict[int, str] = {}              # block -> owning session
        self._slot_of: dict[str, int] = {}
        self._count: dict[int, int] = {}             # slot -> used blocks
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self.block_bytes = 2 * spec.num_layers * bs * self._row_bytes
        self.keep_bytes = keep_bytes
        self._cached: dict[int, bool] = {}           # free block with committed pages -> holds stale KV; oldest first
        self._guard = threading.RLock()
        self.transfer = transfer    # frees go through Transfer.release (transfer.py); None outside a store
        self.pages_released = 0
        self.blocks_prefetched = 0

    # ---- the BlockPool contract -----------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def num_free(self) -> int:
        return self.num_blocks - len(self._used)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def bytes_per_slot(self) -> int:
        return self.spec.bytes_per_block

    @property
    def bytes(self) -> int:
        return self.reserved_bytes

    def slots_needed(self, owners: list[tuple[str, int]]) -> int:
        return len({sid for sid, _ in owners if sid not in self._slot_of})

    def slot_of(self, session_id: str) -> int | None:
        return self._slot_of.get(session_id)

    def allocate(self, n: int, owners: list[tuple[str, int]] | None = None) -> list[int]:
        # inference_mode: zeroing must work whether `data` was made inside inference mode or not
        with self._guard, torch.inference_mode():
            return self._allocate(n, owners)

    def _allocate(self, n: int, owners: list[tuple[str, int]] | None) -> list[int]:
        if owners is None or len(owners) != n:
            raise ValueError("a virtual pool allocates per (session, chunk): pass owners")
        if self.slots_needed(owners) > len(self._free_slots):
            raise NoSlotError(f"{self.slots_needed(owners)} sessions need a slot, {len(self._free_slots)} free")
        for sid, k in owners:                            # validate all before taking any (raise = no change)
            if not 0 <= k < self.blocks_per_slot:
                raise ValueError(f"chunk {k} is past the slot's {self.blocks_per_slot} blocks (max_context)")
            slot = self._slot_of.get(sid)
            if slot is not None and slot * self.blocks_per_slot + k in self._used:
                raise ValueError(f"chunk {k} of session {sid!r} already has a block")
        if len(set(owners)) != len(owners):
            raise ValueError("a (session, chunk) asks for two blocks")
        out = []
        for sid, k in owners:
            if sid not in self._slot_of:
                slot = self._free_slots.pop()
                self._slot_of[sid], self._count[slot] = slot, 0
            slot = self._slot_of[sid]
            block = slot * self.blocks_per_slot + k
            self._used[block] = sid
            self._count[slot] += 1
            stale = self._cached.pop(block, None)
            if stale:                                    # deferred reclamation: pages kept, data zeroed
                for rows, _, _ in self._block_rows(slot, k):
                    rows.zero_()
            elif stale is None and not isinstance(self._mem, mmap.mmap):   # CUDA: map the block's pages
                self._map(slot, k)
            out.append(block)
        return out

    def _map(self, slot: int, k: int) -> None:
        """CUDA: back block k of `slot` with physical memory; when there is none left, give back
        every cached block's pages and try once more."""
        try:
            for _, start, end in self._block_rows(slot, k):
                self._mem.acquire(start, end - start)
        except RuntimeError:
            if not self._cached:
                raise
            self.reclaim()
            for _, start, end in self._block_rows(slot, k):
                self._mem.acquire(start, end - start)

    def _block_rows(self, slot: int, k: int):
        """Per layer and K/V: (rows [block_size, Hkv, D] of block k of `slot`, byte start, byte end)."""
        bs, first = self.spec.block_size, self.data.data_ptr()
        for layer in range(self.spec.num_layers):
            for kv in (0, 1):
                rows = self.data[layer, kv, slot, k * bs:(k + 1) * bs]
                start = rows.data_ptr() - first
                yield rows, start, start + bs * self._row_bytes

    def free(self, blocks: list[int]) -> None:
        """Blocks become free once no copy in flight touches them (`Transfer.release` waits for those
        copies). Mutates: the blocks in use, the slots, the cached pages."""
        self.give_back(self.transfer.release(self, blocks) if self.transfer is not None and blocks else blocks)

    def give_back(self, blocks: list[int]) -> None:
        """Blocks no copy touches become free; their pages stay committed (cached) within `keep_bytes`.
        Mutates: the blocks in use, the slots, the cached pages."""
        with self._guard, torch.inference_mode():
            for block in blocks:
                sid = self._used.pop(block)
                slot = block // self.blocks_per_slot
                self._cached[block] = True
                self._count[slot] -= 1
                if self._count[slot] == 0:
                    del self._count[slot], self._slot_of[sid]
                    self._free_slots.append(slot)
            self._trim(self.keep_bytes)

    @property
    def cached_bytes(self) -> int:
        """Bytes of free blocks whose pages stay committed for reuse (deferred reclamation)."""
        return len(self._cached) * self.block_bytes

    def reclaim(self) -> int:
        """Give back the pages of every free block; returns the bytes given back."""
        with self._guard, torch.inference_mode():
            before = self.cached_bytes
            self._trim(0)
            return before

    def _trim(self, limit: int) -> None:
        while self._cached and self.cached_bytes > limit:
            block = next(iter(self._cached))
            del self._cached[block]
            self._release_pages(block // self.blocks_per_slot, block % self.blocks_per_slot)

    def prefetch(self, owners: list[tuple[str, int]]) -> int:
        """Commit the pages of the blocks (session, chunk) would get, for sessions that hold a slot,
        while those blocks are free and not cached yet (others are skipped: the call may come late).
        They become cached, clean blocks. Returns how many were committed."""
        done = 0
        with self._guard, torch.inference_mode():
            for sid, k in owners:
                slot = self._slot_of.get(sid)
                if slot is None or not 0 <= k < self.blocks_per_slot:
                    continue
                block = slot * self.blocks_per_slot + k
                if block in self._used or block in self._cached:
                    continue
                if isinstance(self._mem, mmap.mmap):     # first touch commits (and the rows must read 0)
                    for rows, _, _ in self._block_rows(slot, k):
                        rows.zero_()
                else:
                    self._map(slot, k)
                self._cached[block] = False
                done += 1
            self.blocks_prefetched += done
            self._trim(max(self.keep_bytes, done * self.block_bytes))
        return done

    def check(self, owned: set[int]) -> None:
        assert not set(self._cached) & set(self._used), "virtual pool: a block is both cached and in use"
        assert set(self._used) == owned, (
            f"virtual pool: blocks in use {sorted(set(self._used) ^ owned)[:8]} disagree with the chunk tables")
        assert sum(self._count.values()) == len(self._used) and len(self._count) + len(self._free_slots) == \
            self.num_slots, "virtual pool: slot accounting is off"

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Paged views (K, V) of one layer: [num_blocks, block_size, kv_heads, head_dim], contiguous."""
        shape = (self.num_blocks, self.spec.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        return self.data[layer, 0].view(shape), self.data[layer, 1].view(shape)

    def dense(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer as [slots, max_context, kv_heads, head_dim]: a session is one slot row."""
        return self.data[layer, 0], self.data[layer, 1]

    def read(self, layer: int, ids: torch.Tensor) -> torch.Tensor:        # [n, 2, block_size, H, D]
        k, v = self.layer(layer)
        return torch.stack((k.index_select(0, ids), v.index_select(0, ids)), dim=1)

    def write(self, layer: int, ids: torch.Tensor, blocks: torch.Tensor) -> None:
        k, v = self.layer(layer)
        k.index_copy_(0, ids, blocks[:, 0])
        v.index_copy_(0, ids, blocks[:, 1])

    # ---- memory ---------------------------------------------------------------------------------

    def committed_bytes(self) -> int:
        """Resident bytes of the reservation (CPU: pages the OS has committed, from mincore)."""
        if isinstance(self._mem, mmap.mmap):
            return _resident_pages(self.data.data_ptr(), self.reserved_bytes) * PAGE
        return self._mem.mapped_bytes

    def _release_pages(self, slot: int, k: int) -> None:                  # with the guard held
        """Give back the pages of one block (each layer, K and V). Rows on pages shared with
        neighbouring blocks are zeroed instead, so a reused block reads as zeros either way."""
        bs = self.spec.block_size
        if not isinstance(self._mem, mmap.mmap):   # CUDA: zero (pieces are shared), then unmap unused pieces,
            ranges = []                           # only once the zeroing (and every kernel before it) ran:
            for rows, start, end in self._block_rows(slot, k):
                rows.zero_()
                ranges.append((start, end - start))
            torch.cuda.current_stream(self.data.device).synchronize()   # cuMemUnmap is not stream-ordered
            for start, length in ranges:
                self._mem.release(start, length)
            return
        for rows, start, end in self._block_rows(slot, k):
            a, b = -(-start // PAGE) * PAGE, end // PAGE * PAGE
            if b <= a:                    # smaller than a page: nothing whole to give back
                rows.zero_()
                continue
            self._mem.madvise(mmap.MADV_DONTNEED, a, b - a)
            self.pages_released += (b - a) // PAGE
            head = -(-(a - start) // self._row_bytes)      # rows touching the partial first page
            tail = -(-(end - b) // self._row_bytes)        # rows touching the partial last page
            rows[:head].zero_()
            rows[bs - tail:].zero_()


def _resident_pages(addr: int, length: int) -> int:
    """Pages of [addr, addr + length) resident in RAM (mincore(2) through ctypes)."""
    import ctypes

    n = (length + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * n)()
    if libc().mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in bytes(vec))
