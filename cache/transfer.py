"""Copies of chunks between pools, layer by layer.

On CUDA the copies run on a side stream and record one event per layer; the attention of layer l
waits on event l only (Pensieve's pipelined swap-in: the batch starts before the swap-in ends).
Elsewhere the same code runs synchronously and returns no events.

Async emulator (STATEFUL_HF_EMULATE_ASYNC=1 or SessionStore(..., emulate_async=True)): on any
device, a copy to or from the device pool is only recorded; layer l of it is performed when its
event l is waited on (`wait_event`, `EmulatedEvent.synchronize`), all of it at the end of the step
(`end_step`) or on `synchronize`. Its destination blocks read NaN until then, and a source block
returned to its free list while the copy is pending is overwritten with NaN (what the compute
stream may do to a reused block on a GPU). Copies between two CPU pools stay synchronous.
"""

from __future__ import annotations

import os
import threading

import torch

from .pool import BlockPool

ENV = "STATEFUL_HF_EMULATE_ASYNC"


def emulate_from_env() -> bool:
    return os.environ.get(ENV, "") == "1"


def _poison(pool, ids: list[int]) -> None:
    """Every layer of blocks `ids` of `pool` reads NaN."""
    idx = torch.tensor(ids, device=pool.device)
    for layer in range(pool.spec.num_layers):
        blocks = pool.read(layer, idx)
        pool.write(layer, idx, torch.full_like(blocks, float("nan")))


class Copy:
    """One queued copy: blocks src_ids of `src` to dst_ids of `dst`, every layer."""

    __slots__ = ("src", "src_ids", "dst", "dst_ids", "events", "_landed")

    def __init__(self, src, src_ids: list[int], dst, dst_ids: list[int]):
        self.src, self.src_ids, self.dst, self.dst_ids = src, list(src_ids), dst, list(dst_ids)
        self.events: list = []
        self._landed = [False] * src.spec.num_layers

    def touches(self, pool, blocks: set[int]) -> set[int]:
        """The blocks of `blocks` (of `pool`) this copy reads or writes."""
        out = set()
        if pool is self.src:
            out |= blocks.intersection(self.src_ids)
        if pool is self.dst:
            out |= blocks.intersection(self.dst_ids)
        return out

    def land(self, layer: int) -> None:
        """Emulator: perform layer `layer` now (reading the source as it is now)."""
        if not self._landed[layer]:
            self._landed[layer] = True
            s_idx = torch.tensor(self.src_ids, device=self.src.device)
            d_idx = torch.tensor(self.dst_ids, device=self.dst.device)
            self.dst.write(layer, d_idx, self.src.read(layer, s_idx).to(self.dst.device))

    @property
    def done(self) -> bool:
        return all(self._landed)


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
    """Owns the copy stream. Contract: `copy` may be called with the store lock held; it never
    touches free lists or chunk tables (the store does)."""

    def __init__(self, device_pool, emulate: bool = False):
        self.device_pool = device_pool
        self.device = device_pool.device
        self.emulate = bool(emulate)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and not emulate else None
        self._last: list = []   # events of the latest swap-in, to keep swap-out behind it
        self._pending: list[Copy] = []     # emulator: copies recorded, not all landed
        self._lock = threading.RLock()

    def copy(self, src: BlockPool, src_ids: list[int], dst: BlockPool, dst_ids: list[int]) -> list | None:
        """Blocks src_ids of `src` to dst_ids of `dst`, every layer; per-layer CUDA events, or None when done."""
        if not src_ids:
            return None
        with self._lock:
            if self.emulate and self.device_pool in (src, dst):
                return self._record(src, src_ids, dst, dst_ids)
            return self._copy(src, src_ids, dst, dst_ids)

    def _record(self, src, src_ids, dst, dst_ids) -> list:
        c = Copy(src, src_ids, dst, dst_ids)
        _poison(dst, c.dst_ids)                      # not landed yet
        c.events = [EmulatedEvent(c, layer) for layer in range(src.spec.num_layers)]
        self._pending.append(c)
        if dst is self.device_pool:
            self._last = c.events
        return c.events

    def _copy(self, src, src_ids, dst, dst_ids) -> list | None:
        layers = src.spec.num_layers
        s_idx = torch.tensor(src_ids, device=src.device)
        d_idx = torch.tensor(dst_ids, device=dst.device)
        if self.stream is None or (src.device.type != "cuda" and dst.device.type != "cuda"):
            for layer in range(layers):
                dst.write(layer, d_idx, src.read(layer, s_idx).to(dst.device))
            return None
        events = []
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for layer in range(layers):
                part = src.read(layer, s_idx)
                if part.device.type == "cpu":
                    part = part.pin_memory()
                dst.write(layer, d_idx, part.to(dst.device, non_blocking=True))
                ev = torch.cuda.Event()
                ev.record(self.stream)
                events.append(ev)
        if dst.device.type == "cuda":
            self._last = events
        return events

    def release(self, pool, blocks: list[int]) -> list[int]:
        """Blocks of `pool` about to return to its free list (called by the pool's `free`)."""
        with self._lock:
            if self.emulate and self._pending:
                early = set()
                for c in self._pending:
                    if pool is c.src and not c.done:
                        early |= set(blocks).intersection(c.src_ids)
                if early:
                    _poison(pool, sorted(early))
            return blocks

    def swap_in_pending(self) -> bool:
        """True while a swap-in copy is in flight (swap-out waits: concurrent copies lose bandwidth)."""
        return any(not ev.query() for ev in self._last)

    def end_step(self) -> None:
        """The step's forward is over: emulated copies land (on a GPU they would have by now)."""
        with self._lock:
            for c in self._pending:
                for layer in range(len(c.events)):
                    c.land(layer)
            self._pending.clear()

    def synchronize(self) -> None:
        self.end_step()
        if self.stream is not None:
            self.stream.synchronize()
