"""Copies of chunks between pools, layer by layer, and the ordering rules every copy obeys.

On CUDA a copy to or from the device runs on a side stream and records one event per layer; the
attention of layer l waits on event l only (Pensieve's pipelined swap-in: the batch starts before
the swap-in ends). Between two CPU pools (host <-> disk) a copy is synchronous.

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
   (`num_free`, `check`). A virtual pool's free waits for such copies at once instead.
4. Host staging uses pinned buffers owned by their `Copy` until its event completed, never reused
   before (each copy makes its own; torch's pinned allocator recycles them after).
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

import torch

from .pool import BlockPool, block_runs

ENV = "STATEFUL_HF_EMULATE_ASYNC"


def emulate_from_env() -> bool:
    return os.environ.get(ENV, "") == "1"


def _poison(pool, ids: list[int]) -> None:
    """Every layer of blocks `ids` of `pool` reads NaN."""
    idx = torch.tensor(ids, device=pool.device)
    for layer in range(pool.spec.num_layers):
        blocks = pool.read(layer, idx)
        pool.write(layer, idx, torch.full_like(blocks, float("nan")))


def copy_now(src: BlockPool, src_ids: list[int], dst: BlockPool, dst_ids: list[int]) -> None:
    """Synchronous copy of blocks src_ids of `src` to dst_ids of `dst`, every layer. Between pools whose
    block b is `data[:, b]` (`slice_blocks`), each run of consecutive ids is one strided slice copy over
    all layers (no gathered temporary: half the memory traffic of index_select + index_copy_); other
    pools (a VirtualPool) copy layer by layer through their read / write."""
    if src is not dst and getattr(src, "slice_blocks", False) and getattr(dst, "slice_blocks", False):
        for s, d, n in block_runs(src_ids, dst_ids):
            dst.data[:, d:d + n].copy_(src.data[:, s:s + n])
        return
    s_idx = torch.tensor(src_ids, device=src.device)
    d_idx = torch.tensor(dst_ids, device=dst.device)
    for layer in range(src.spec.num_layers):
        dst.write(layer, d_idx, src.read(layer, s_idx).to(dst.device))


class Copy:
    """One queued copy: blocks src_ids of `src` to dst_ids of `dst`, every layer. `events[l]` is a
    CUDA event (or an EmulatedEvent); `staged[l]` the pinned host buffer of layer l: the one a
    device -> host layer lands in before it is written into `dst`, or the one a host -> device layer
    is read from; None for the emulator."""

    __slots__ = ("src", "src_ids", "dst", "dst_ids", "events", "staged", "emulated", "_landed")

    def __init__(self, src, src_ids: list[int], dst, dst_ids: list[int], emulated: bool):
        self.src, self.src_ids, self.dst, self.dst_ids = src, list(src_ids), dst, list(dst_ids)
        self.emulated = emulated
        self.events: list = []
        self.staged: list[torch.Tensor | None] = []
        self._landed = [False] * src.spec.num_layers

    def touches(self, pool, blocks) -> set[int]:
        """The blocks of `blocks` (of `pool`) this copy reads or writes."""
        out = set()
        if pool is self.src:
            out |= set(blocks).intersection(self.src_ids)
        if pool is self.dst:
            out |= set(blocks).intersection(self.dst_ids)
        return out

    def _write(self, layer: int, blocks: torch.Tensor) -> None:
        self.dst.write(layer, torch.tensor(self.dst_ids, device=self.dst.device), blocks)

    def land(self, layer: int) -> None:
        """Layer `layer` is in `dst` when this returns (waits on its event; emulated: performs it)."""
        if self._landed[layer]:
            return
        if self.emulated:
            self._write(layer, self.src.read(layer, torch.tensor(self.src_ids, device=self.src.device))
                        .to(self.dst.device))
        else:
            self.events[layer].synchronize()
            if self.dst.device.type == "cpu":      # device -> host: the host-side write, after the event
                self._write(layer, self.staged[layer])
            self.staged[layer] = None              # the pinned buffer may be reused from now on
        self._landed[layer] = True

    def poll(self, wait: bool) -> bool:
        """True when every layer has landed; lands those whose event completed (all, if `wait`)."""
        for layer, done in enumerate(self._landed):
            if not done:
                if not wait and (self.emulated or not self.events[layer].query()):
                    return False
                self.land(layer)
        return True


class EmulatedEvent:
    """Stands for the CUDA event recorded after layer `layer` of `copy`."""

    __slots__ = ("copy", "layer")

    def __init__(self, copy: Copy, layer: int):
        self.copy, self.layer = copy, layer

    def query(self) -> bool:
        return self.copy._landed[self.layer]

    def synchronize(self) -> None:
        self.copy.land(self.layer)


def wait_event(event, device: torch.device) -> None:
    """Make the current stream of `device` wait for `event` (emulated: perform that layer now)."""
    if isinstance(event, EmulatedEvent):
        event.synchronize()
    else:
        torch.cuda.current_stream(device).wait_event(event)


class Transfer:
    """Owns the copy stream, the copies in flight and the blocks held back for them (rule 3).
    Contract: called with the store lock held (an internal lock covers `synchronize` from outside
    it); it changes free lists only through `BlockPool.give_back`, never chunk tables."""

    def __init__(self, device_pool, emulate: bool = False):
        self.device_pool = device_pool
        self.device = device_pool.device
        self.emulate = bool(emulate)
        self.lazy_free = True       # rule 3; False only to show the emulator catching its absence
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and not emulate else None
        self._pending: list[Copy] = []                                 # copies not known to have landed
        self._deferred: list[tuple[Copy, object, list[int]]] = []     # (copy, pool, blocks) held back
        self._last: Copy | None = None                                 # the latest swap-in
        self._lock = threading.RLock()

    # ---- copies ---------------------------------------------------------------------------------

    def copy(self, src: BlockPool, src_ids: list[int], dst: BlockPool, dst_ids: list[int]) -> list | None:
        """Blocks src_ids of `src` to dst_ids of `dst`, every layer; per-layer events (CUDA or
        emulated), or None when the copy is done on return (CPU pools)."""
        if not src_ids:
            return None
        with self._lock:
            self._reap(wait=False)
            self.settle(src)                         # rule 5: read the source once it has landed
            asynchronous = self.device_pool in (src, dst) and (self.emulate or self.stream is not None)
            if not asynchronous:
                copy_now(src, src_ids, dst, dst_ids)
                return None
            c = Copy(src, src_ids, dst, dst_ids, emulated=self.emulate)
            if self.emulate:
                _poison(dst, c.dst_ids)                  # reads NaN until it lands
                c.events = [EmulatedEvent(c, layer) for layer in range(src.spec.num_layers)]
                c.staged = [None] * len(c.events)
            else:
                self._launch(c)
            self._pending.append(c)
            if dst is self.device_pool:
                self._last = c
            return c.events

    def _launch(self, c: Copy) -> None:
        """CUDA: queue every layer of `c` on the copy stream, an event after each."""
        src, dst = c.src, c.dst
        self.stream.wait_stream(torch.cuda.current_stream(self.device))   # rule 1
        with torch.cuda.stream(self.stream):     # everything made here belongs to the copy stream
            s_idx = torch.tensor(c.src_ids, device=src.device)
            d_idx = torch.tensor(c.dst_ids, device=dst.device)
            for layer in range(src.spec.num_layers):
                part = src.read(layer, s_idx)            # [n, 2, block, H, D]; a gather on the copy stream
                if dst.device.type == "cpu":             # device -> host: into pinned staging (rules 2, 4)
                    stage = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
                    stage.copy_(part, non_blocking=True)
                else:                                    # host -> device: from pinned staging (rule 4)
                    stage = part.pin_memory() if part.device.type == "cpu" else None
                    dst.write(layer, d_idx, (part if stage is None else stage).to(dst.device, non_blocking=True))
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

    def release(self, pool, blocks: list[int]) -> list[int]:
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
                    _poison(pool, sorted(b for c, ids in held.items() for b in ids
                                         if pool is self._pending[c].src))
                return blocks
            if getattr(pool, "virtual", False):
                for i in held:
                    self._pending[i].poll(wait=True)
                return blocks
            for i, ids in held.items():
                self._deferred.append((self._pending[i], pool, ids))
            return [b for b in blocks if b in rest]

    def deferred_ids(self, pool) -> list[int]:
        """Blocks of `pool` held back for copies in flight (free once those land)."""
        with self._lock:
            return [b for _, p, blocks in self._deferred if p is pool for b in blocks]

    def reclaim(self, pool) -> None:
        """Wait for the copies holding blocks of `pool` and give those blocks back."""
        with self._lock:
            self._reap(wait=True, pool=pool)
