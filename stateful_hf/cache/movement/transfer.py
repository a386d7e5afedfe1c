"""Copies of chunks between pools, layer by layer, and the ordering rules every copy obeys.

On CUDA a copy to or from the device runs on a side stream and records one event per layer; the
attention of layer l waits on event l only (Pensieve's pipelined swap-in: the batch starts before
the swap-in ends). Between two CPU pools (host <-> disk) a copy is synchronous. Every copy between
tiers is issued here, one method per kind, and counted in `issued`: whole blocks (`copy`), some
layers of some blocks (`copy_layers`: LayerKV's kept layers to their host slots), device chunks
into hidden slots (`store_hidden`: HCache), hidden slots between hidden pools (`copy_hidden`) and
blocks out of and into the store (`read_out`, `write_in`: a session's export and import) and a
block into another of the same pool (`duplicate`: copy-on-write of a shared chunk);
all but `copy` to or from the device pool are synchronous, and each first settles its source (rule 5).
A pool is told apart by what it declares (`tier.TierPool`): `device_tier`, `virtual`, `slice_blocks`.

Ordering discipline (every rule holds on CUDA; the emulator below checks them on the CPU):
1. Every copy has an event per layer (`Copy.events`), recorded on the copy stream after that layer;
   the copy stream first waits for the compute stream, so a copy reads what the step wrote.
2. Nothing reads a destination before waiting on its copy's event. The step's attention of layer l
   waits on event l of every swap-in (`wait_event`). A device -> host/disk copy lands in pinned
   staging buffers; it is written into the destination pool only after its event is synchronized
   (`Copy.poll`), and every reader of a host/disk pool settles the copies into it first
   (`settle`): a copy out of that pool, the step's in-place host reads (layer-wise), the disk index
   write (a chunk is named on disk only once its bytes are there), export (`synchronize`).
3. A block that a copy in flight reads (its source) or writes (its destination) returns to its free
   list only after the copy's events completed: lazy free, as mini-sglang's `lazy_free_region`.
   `BlockPool.free` passes blocks through `release`, which holds those back (`deferred`); they are
   given back when their copy is reaped: a non-blocking poll at each copy and at the end of a step,
   or a wait when an allocation needs them (`BlockPool.allocate`). Deferred blocks count as free
   (`num_free`, `check`). A virtual pool's free waits for such copies at once instead. Each pool is
   given the transfer engine when it is made (its `transfer`), so every free passes through here.
4. Host staging uses pinned buffers owned by their `Copy` until its event completed, never reused
   before (each copy makes its own; torch's pinned allocator recycles them after). A host -> device
   copy of few runs reads the pinned host pool itself, with no staging (rule 3 holds its source).
5. Copies between CPU pools and every CPU-side read settle the copies into their source first.

Async emulator (STATEFUL_HF_EMULATE_ASYNC=1 or SessionStore(..., emulate_async=True)): on any
device, a copy to or from the device pool is only recorded; layer l of it is performed when its
event l is waited on (`wait_event`, `EmulatedEvent.synchronize`), all of it at the end of the step
(`end_step`, called by commit / abort) or on `settle` / `synchronize`. Its destination blocks read
NaN until then, and a source block returned to its free list while its copy is pending (which rule 3
forbids; `lazy_free = False` breaks it on purpose) is overwritten with NaN first, as the compute
stream may overwrite a reused block on a GPU. Exact-output tests then fail on any broken rule.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import torch

from ..pools.pool import block_runs
from ..pools.tier import TierPool
from .copies import Copy, EmulatedEvent, poison

if TYPE_CHECKING:
    from ..hidden.states import HiddenCapture, HiddenPool

ENV = "STATEFUL_HF_EMULATE_ASYNC"
MAX_DIRECT_RUNS = 32     # a host -> device copy of at most this many runs per layer is DMA'd from the pinned pool


def emulate_from_env() -> bool:
    return os.environ.get(ENV, "") == "1"


def copy_now(src: TierPool, src_ids: list[int], dst: TierPool, dst_ids: list[int]) -> None:
    """Synchronous copy of blocks src_ids of `src` to dst_ids of `dst`, every layer. Between pools whose
    block b is `data[:, b]` (`slice_blocks`), each run of consecutive ids is one strided slice copy over
    all layers (no gathered temporary: half the memory traffic of index_select + index_copy_); other
    pools (a VirtualPool) copy layer by layer through their read / write."""
    if src is not dst and src.slice_blocks and dst.slice_blocks:
        for s, d, n in block_runs(src_ids, dst_ids):
            dst.data[:, d:d + n].copy_(src.data[:, s:s + n])
        return
    s_idx = torch.tensor(src_ids, device=src.device)
    d_idx = torch.tensor(dst_ids, device=dst.device)
    for layer in range(src.spec.num_layers):
        dst.write(layer, d_idx, src.read(layer, s_idx).to(dst.device))


def _direct_runs(src: TierPool, src_ids: list[int], dst: TierPool, dst_ids: list[int]) -> list | None:
    """Runs of a host -> device copy that can be DMA'd straight out of a pinned pool (no CPU copy),
    or None: the source is not pinned, either pool is not sliced by block, or the ids are too scattered."""
    if not (src.slice_blocks and dst.slice_blocks and dst.device_tier and src.device.type == "cpu"):
        return None
    runs = block_runs(src_ids, dst_ids)
    return runs if len(runs) <= MAX_DIRECT_RUNS and src.data.is_pinned() else None


def _pinned_gather(src: TierPool, layer: int, s_idx: torch.Tensor) -> torch.Tensor:
    """Layer `layer` of blocks s_idx of a CPU pool, gathered once into a new pinned buffer."""
    if not src.slice_blocks:
        return src.read(layer, s_idx).pin_memory()
    part = src.data[layer]                                                   # [blocks, 2, block, H, D]
    stage = torch.empty((len(s_idx), *part.shape[1:]), dtype=part.dtype, pin_memory=True)
    return torch.index_select(part, 0, s_idx, out=stage)


def wait_event(event, device: torch.device) -> None:
    """Make the current stream of `device` wait for `event` (emulated: perform that layer now)."""
    if isinstance(event, EmulatedEvent):
        event.synchronize()
    else:
        torch.cuda.current_stream(device).wait_event(event)


class Transfer:
    """Owns the copy stream, the copies in flight, the blocks held back for them (rule 3) and the
    count of copies issued. Made before the pools (each is given it); the copies to or from the
    device tier's pool (`device_tier`), on `device`, are the queued ones.
    Contract: called with the store lock held (an internal lock covers `synchronize` from outside
    it); it changes free lists only through a pool's `give_back`, never chunk tables."""

    def __init__(self, device: torch.device, emulate: bool = False):
        self.device = torch.device(device)
        self.emulate = bool(emulate)
        # slots copied, by kind
        self.issued = {"blocks": 0, "layers": 0, "hidden": 0, "hidden_slots": 0, "exported": 0, "imported": 0,
                       "duplicated": 0}
        self.lazy_free = True       # rule 3; False only to show the emulator catching its absence
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and not emulate else None
        self._pending: list[Copy] = []                                 # copies not known to have landed
        self._deferred: list[tuple[Copy, object, list[int]]] = []     # (copy, pool, blocks) held back
        self._last: Copy | None = None                                 # the latest swap-in
        self._lock = threading.RLock()

    # ---- copies ---------------------------------------------------------------------------------

    def copy(self, src: TierPool, src_ids: list[int], dst: TierPool, dst_ids: list[int]) -> list | None:
        """Blocks src_ids of `src` to dst_ids of `dst`, every layer; per-layer events (CUDA or
        emulated), or None when the copy is done on return (CPU pools). Mutates: the copies in flight."""
        if not src_ids:
            return None
        with self._lock:
            self._reap(wait=False)
            self.settle(src)                         # rule 5: read the source once it has landed
            self.issued["blocks"] += len(src_ids)
            asynchronous = (src.device_tier or dst.device_tier) and (self.emulate or self.stream is not None)
            if not asynchronous:
                copy_now(src, src_ids, dst, dst_ids)
                return None
            c = Copy(src, src_ids, dst, dst_ids, emulated=self.emulate)
            if self.emulate:
                poison(dst, c.dst_ids)                  # reads NaN until it lands
                c.events = [EmulatedEvent(c, layer) for layer in range(src.spec.num_layers)]
                c.staged = [None] * len(c.events)
            else:
                self._launch(c)
            self._pending.append(c)
            if dst.device_tier:
                self._last = c
            return c.events

    def copy_out(self, src: TierPool, src_ids: list[int], dst: TierPool, dst_ids: list[int]) -> list | None:
        """`copy`, for a copy kept while its source goes on serving (a disk copy written behind): its
        source blocks must not change before it has read them. On CUDA the compute stream then waits for
        the copy stream (later steps writing those blocks come after it); the emulator performs it now."""
        events = self.copy(src, src_ids, dst, dst_ids)
        if events is not None:
            with self._lock:
                if self.emulate:
                    self.settle(dst)
                else:
                    torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return events

    def copy_layers(self, src: TierPool, dst: TierPool, moves: list[tuple[int, list[int], list[int]]]) -> None:
        """For each (layer, src_ids, dst_ids) of `moves`, that layer of blocks src_ids of `src` to
        dst_ids of `dst` (LayerKV: the layers a residue block keeps, to their host slots). Synchronous."""
        moves = [m for m in moves if m[1]]
        if not moves:
            return
        with self._lock:
            self.settle(src)                         # rule 5
            for layer, src_ids, dst_ids in moves:
                part = src.read(layer, torch.tensor(src_ids, device=src.device))
                dst.write(layer, torch.tensor(dst_ids, device=dst.device), part.to(dst.device))
                self.issued["layers"] += len(src_ids)

    def store_hidden(self, capture: HiddenCapture, src: TierPool, blocks: list[int], dst: HiddenPool,
                     slots: list[int]) -> None:
        """Device blocks' chunks into hidden slots of `dst` (HCache): the hidden layers from the
        capture, the K/V layers from `src` (`HiddenPool.store_from`). Synchronous."""
        if not blocks:
            return
        with self._lock:
            self.settle(src)                         # rule 5
            dst.store_from(capture, src, blocks, slots)
            self.issued["hidden"] += len(blocks)

    def copy_hidden(self, src: HiddenPool, src_ids: list[int], dst: HiddenPool, dst_ids: list[int]) -> None:
        """Hidden slots src_ids of `src` to dst_ids of `dst` (host <-> disk, same split;
        `HiddenPool.copy_slots`). Synchronous."""
        if not src_ids:
            return
        with self._lock:
            self.settle(src)                         # rule 5
            src.copy_slots(src_ids, dst, dst_ids)
            self.issued["hidden_slots"] += len(src_ids)

    def read_out(self, src: TierPool, ids: list[int]) -> torch.Tensor:
        """Blocks `ids` of `src` out of the store, [n, layers, 2, block_size, kv_heads, head_dim] on the
        CPU (an export). Synchronous: every copy in flight lands first. Mutates nothing."""
        with self._lock:
            self.synchronize()
            idx = torch.tensor(ids, device=src.device)
            self.issued["exported"] += len(ids)
            return torch.stack([src.read(layer, idx).cpu() for layer in range(src.spec.num_layers)], dim=1)

    def duplicate(self, pool: TierPool, src: int, dst: int) -> None:
        """Block `src` of `pool` into its block `dst` (just allocated), every layer: a shared chunk's
        private copy (`Placement.copy_on_write`). Synchronous, on the current stream, after every copy in
        flight into `pool` has landed (rule 2). Mutates: block `dst`."""
        with self._lock:
            self.settle(pool)
            copy_now(pool, [src], pool, [dst])
            self.issued["duplicated"] += 1

    def write_in(self, dst: TierPool, ids: list[int], blocks: torch.Tensor) -> None:
        """`blocks` ([n, layers, ...] as `read_out` gives them) into blocks `ids` of `dst` (an import, into
        blocks just allocated that no copy touches). Synchronous. Mutates: those blocks."""
        if not ids:
            return
        with self._lock:
            idx = torch.tensor(ids, device=dst.device)
            for layer in range(dst.spec.num_layers):
                dst.write(layer, idx, blocks[:, layer].to(dst.device))
            self.issued["imported"] += len(ids)

    def _launch(self, c: Copy) -> None:
        """CUDA: queue every layer of `c` on the copy stream, an event after each."""
        src, dst = c.src, c.dst
        self.stream.wait_stream(torch.cuda.current_stream(self.device))   # rule 1
        with torch.cuda.stream(self.stream):     # everything made here belongs to the copy stream
            s_idx = torch.tensor(c.src_ids, device=src.device)
            d_idx = torch.tensor(c.dst_ids, device=dst.device)
            runs = _direct_runs(src, c.src_ids, dst, c.dst_ids)
            for layer in range(src.spec.num_layers):
                stage = None
                if runs is not None:                     # pinned pool -> device: DMA per run (rule 3 holds the source)
                    for s, d, n in runs:
                        dst.data[layer, d:d + n].copy_(src.data[layer, s:s + n], non_blocking=True)
                elif dst.device.type == "cpu":           # device -> host: into pinned staging (rules 2, 4)
                    part = src.read(layer, s_idx)        # [n, 2, block, H, D]; a gather on the copy stream
                    stage = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
                    stage.copy_(part, non_blocking=True)
                elif src.device.type == "cpu":           # host/disk -> device: gathered into pinned staging (rule 4)
                    stage = _pinned_gather(src, layer, s_idx)
                    dst.write(layer, d_idx, stage.to(dst.device, non_blocking=True))
                else:
                    dst.write(layer, d_idx, src.read(layer, s_idx))
                ev = torch.cuda.Event()
                ev.record(self.stream)
                c.events.append(ev)
                c.staged.append(stage)                   # owned by the copy until its event completed

    # ---- waiting --------------------------------------------------------------------------------

    def settle(self, pool=None) -> None:
        """Every copy into `pool` (any pool if None) has landed when this returns (rule 2)."""
        with self._lock:
            for c in self._pending:
                if pool is None or c.dst is pool:
                    c.poll(wait=True)
            self._reap(wait=False)

    def _reap(self, wait: bool, pool=None) -> None:
        """Forget landed copies; give back the blocks held for them (for `pool`'s: waiting, if `wait`)."""
        keep = []
        for c, p, blocks in self._deferred:
            if c.poll(wait=wait and (pool is None or p is pool)):
                p.give_back(blocks)
            else:
                keep.append((c, p, blocks))
        self._deferred = keep
        self._pending = [c for c in self._pending if not c.poll(wait=False)]

    def end_step(self) -> None:
        """The step's forward is over. Emulated copies land (on a GPU they would have by now; the
        step waited on what it read); on CUDA landed copies are reaped without waiting."""
        with self._lock:
            if self.emulate:
                for c in self._pending:
                    c.poll(wait=True)
            self._reap(wait=False)

    def synchronize(self) -> None:
        """Every copy has landed and every held-back block is free again."""
        with self._lock:
            self.settle()
            self._reap(wait=True)

    def swap_in_pending(self) -> bool:
        """True while a swap-in copy is in flight (swap-out waits: concurrent copies lose bandwidth)."""
        with self._lock:
            return self._last is not None and not self._last.poll(wait=False)

    # ---- lazy free (rule 3) ---------------------------------------------------------------------

    def release(self, pool: TierPool, blocks: list[int]) -> list[int]:
        """Blocks of `pool` its owner frees (from `pool.free`): returns those free now; the ones a
        copy in flight reads or writes are held back until it lands (a virtual pool: waited for now)."""
        with self._lock:
            held: dict[int, list[int]] = {}
            rest = set(blocks)
            for i, c in enumerate(self._pending):
                if rest and not c.poll(wait=False):
                    mine = c.touches(pool, rest)
                    if mine:
                        held[i] = sorted(mine)
                        rest -= mine
            if not held:
                return blocks
            if not self.lazy_free:               # broken on purpose: the emulator must catch this
                if self.emulate:
                    poison(pool, sorted(b for c, ids in held.items() for b in ids
                                         if pool is self._pending[c].src))
                return blocks
            if pool.virtual:
                for i in held:
                    self._pending[i].poll(wait=True)
                return blocks
            for i, ids in held.items():
                self._deferred.append((self._pending[i], pool, ids))
            return [b for b in blocks if b in rest]

    def deferred_ids(self, pool: TierPool) -> list[int]:
        """Blocks of `pool` held back for copies in flight (free once those land)."""
        with self._lock:
            return [b for _, p, blocks in self._deferred if p is pool for b in blocks]

    def reclaim(self, pool: TierPool) -> None:
        """Wait for the copies holding blocks of `pool` and give those blocks back."""
        with self._lock:
            self._reap(wait=True, pool=pool)
