"""Per-layer residency of one step (LayerKV's per-layer block table): where each row's K/V is
written and which context blocks attention reads from the host, layer by layer.

Built once per step by the store when any row or context chunk is LAYERED; every layer's attention
reaches it through `StepBatch.write_rows`, which hands it the layer's rows. Every row it places goes
through the one K/V writer (`pool.write_kv`): device blocks, the host pool, staged buffers.
A chunk's layer l is on the device when the chunk is DEVICE (factor 1) or LAYERED with a share
(factor f >= 2) and l % f == its residue; otherwise it is in the chunk's host slot. Layers with the
same on-device pattern share one placement (made once).

On the CPU the host pool's layer view is read and written in place (zero copy): the "overlay" of
the kernel points at it directly. Where the host pool is not on the pool's device (CUDA: pinned CPU
memory), a layer's host-resident context blocks are staged: copied to the device into a buffer of
just those blocks, with the overlay's table renumbered to it. Layer l+1's buffer is copied while
layer l computes (CUDA: a side stream, pinned source, one event that layer l+1 waits on), so it
lacks the rows this step writes at layer l+1: those are written into the buffer too, as well as
down to the host pool. `stage=True` forces staging on the CPU (copies made ahead synchronously), so
the path, including that patch, is tested here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels import Overlay
from ..pools.pool import BlockPool, write_kv


@dataclass(frozen=True, slots=True)
class LayerPlacement:
    dev_rows: torch.Tensor       # [n_d] long: packed rows whose K/V this layer writes to the device pool
    dev_slots: torch.Tensor      # [n_d] long: block * block_size + offset in the device pool
    host_rows: torch.Tensor      # [n_h] long: packed rows written to the host pool at this layer
    host_slots: torch.Tensor     # [n_h] long: host slot * block_size + offset
    host_table: torch.Tensor | None   # [S, M] int32: host slot of context block (i, j) read from the host, else -1
    staged_ids: torch.Tensor | None   # [n] long: the distinct host slots host_table names, ascending
    staged_table: torch.Tensor | None  # [S, M] int32: host_table renumbered into staged_ids (-1 kept)
    staged_rows: torch.Tensor | None   # [n_s] long: of host_rows, those whose host block is staged
    staged_slots: torch.Tensor | None  # [n_s] long: their slots in the staged buffer (index * block_size + offset)


class LayeredStep:
    """rows_*: [T] per packed row; table_*: [S, M] per context block of each sub-request.
    factor 1 = on the device at every layer (residue 0), 0 = at no layer, f >= 2 = at l % f == residue.
    host ids are -1 where a row / block has no host slot (DEVICE chunks, table padding)."""

    def __init__(self, host_pool: BlockPool, rows_dev: list[int], rows_host: list[int], rows_factor: list[int],
                 rows_residue: list[int], table_host: list[list[int]], table_factor: list[list[int]],
                 table_residue: list[list[int]], stage: bool | None = None):
        self.host_pool = host_pool
        self.stage = stage             # None: stage when the host pool is on another device than the pool
        self._ahead: dict[int, tuple] = {}     # layer -> (K, V, event or None) staged ahead of use
        self._pending: list[tuple] = []        # staged mode: (layer, event or None, K, V, host slots) to flush
        self._stream = None
        self._moved: dict[tuple[int, torch.device], torch.Tensor] = {}   # placement tensors on a device
        long = lambda xs: torch.tensor(xs, dtype=torch.long)
        self.rows_dev, self.rows_host = long(rows_dev), long(rows_host)                  # [T]
        self.rows_factor, self.rows_residue = long(rows_factor), long(rows_residue)      # [T]
        self.table_host = long(table_host)                                                # [S, M]
        self.table_factor, self.table_residue = long(table_factor), long(table_residue)  # [S, M]
        pairs = {(f, r) for f, r in zip(rows_factor, rows_residue) if f >= 2}
        pairs |= {(f, r) for fs, rs in zip(table_factor, table_residue) for f, r in zip(fs, rs) if f >= 2}
        self.pairs = sorted(pairs)     # the (factor, residue) classes whose residency varies by layer
        self._placements: dict[tuple[bool, ...], LayerPlacement] = {}

    @staticmethod
    def _on_device(layer: int, factor: torch.Tensor, residue: torch.Tensor) -> torch.Tensor:
        return (factor > 0) & (torch.remainder(torch.full_like(factor, layer), factor.clamp(min=1)) == residue)

    def placement(self, layer: int) -> LayerPlacement:
        key = tuple(layer % f == r for f, r in self.pairs)
        if key not in self._placements:
            dev = self._on_device(layer, self.rows_factor, self.rows_residue)                 # [T] bool
            dev_rows = dev.nonzero().squeeze(1)
            host_rows = (~dev).nonzero().squeeze(1)
            on_dev = self._on_device(layer, self.table_factor, self.table_residue)           # [S, M] bool
            table = torch.where(on_dev, torch.full_like(self.table_host, -1), self.table_host)
            host_slots = self.rows_host[host_rows]
            host_table = staged_ids = staged_table = staged_rows = staged_slots = None
            if bool((table >= 0).any()):
                bs = self.host_pool.spec.block_size
                host_table = table.to(torch.int32)
                staged_ids = table[table >= 0].unique()                                      # sorted
                staged_table = torch.where(table >= 0, torch.searchsorted(staged_ids, table.clamp(min=0)),
                                           table).to(torch.int32)
                blocks = host_slots // bs
                hit = torch.isin(blocks, staged_ids)
                staged_rows = host_rows[hit]
                staged_slots = torch.searchsorted(staged_ids, blocks[hit]) * bs + host_slots[hit] % bs
            self._placements[key] = LayerPlacement(dev_rows, self.rows_dev[dev_rows], host_rows, host_slots,
                                                   host_table, staged_ids, staged_table, staged_rows, staged_slots)
        return self._placements[key]

    def write_and_overlay(self, layer: int, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          key: torch.Tensor, value: torch.Tensor) -> Overlay | None:
        """Write the rows' K/V of `layer` ([T, Hkv, D]) where that layer of their chunk lives; return the
        overlay attention reads the host-resident context blocks of this layer through (None: none)."""
        p = self.placement(layer)
        hk, hv = self.host_pool.layer(layer)              # [host blocks, block_size, Hkv, D] views
        device = key_cache.device
        if p.dev_rows.numel():
            rows = self._on(p.dev_rows, key.device)
            write_kv(key_cache, value_cache, key[rows], value[rows], self._on(p.dev_slots, device))
        stage = self.stage if self.stage is not None else hk.device != device
        if p.host_rows.numel():
            rows = self._on(p.host_rows, key.device)
            if stage:                                  # down to the host after the forward (flush)
                self._defer(layer, key[rows], value[rows], p.host_slots)
            else:                                      # the host pool is here: in place
                write_kv(hk, hv, key[rows], value[rows], p.host_slots)
        if stage:
            self._prefetch(layer + 1, device)          # copies while this layer computes
        if p.host_table is None:
            return None
        if not stage:
            return Overlay(p.host_table, hk, hv)
        sk, sv = self._staged(layer, device)
        if p.staged_rows.numel():                      # this step's rows of staged blocks: not in the copy
            rows = self._on(p.staged_rows, key.device)
            write_kv(sk, sv, key[rows], value[rows], self._on(p.staged_slots, device))
        return Overlay(self._on(p.staged_table, device), sk, sv)

    def _on(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A placement's small index tensor on `device`, moved once per step. The copy lives as long as
        the step: layers with one residency pattern pass the same tensor, which the torch backend
        keys its per-overlay work on (by identity)."""
        if t.device == device:
            return t
        key = (id(t), device)        # t is held by a placement for the whole step, so its id is stable
        if key not in self._moved:
            self._moved[key] = t.to(device)
        return self._moved[key]

    def _defer(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Queue rows [n, Hkv, D] for the host pool; on CUDA copy them to pinned memory on the side stream now."""
        if k.device.type != "cuda":
            self._pending.append((layer, None, k, v, slots))
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(k.device)
        self._stream.wait_stream(torch.cuda.current_stream(k.device))    # k, v are made on the compute stream
        with torch.cuda.stream(self._stream):
            kh = torch.empty(k.shape, dtype=k.dtype, pin_memory=True).copy_(k, non_blocking=True)
            vh = torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        k.record_stream(self._stream)
        v.record_stream(self._stream)
        self._pending.append((layer, event, kh, vh, slots))

    def flush(self) -> None:
        """Write the rows staged mode queued into the host pool (the store's commit calls this; nothing
        in the step reads them from the host: attention saw them in the staged buffers)."""
        for layer, event, k, v, slots in self._pending:
            if event is not None:
                event.synchronize()
            hk, hv = self.host_pool.layer(layer)
            write_kv(hk, hv, k.to(hk.device), v.to(hk.device), slots)
        self._pending.clear()

    def discard(self) -> None:
        """Drop queued host rows (an aborted step's new tokens leave the history)."""
        self._pending.clear()

    def _copy(self, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, block_size, Hkv, D] K and V of the layer's staged host blocks, on `device`."""
        hk, hv = self.host_pool.layer(layer)
        ids = self.placement(layer).staged_ids
        if device.type != "cuda":
            return hk.index_select(0, ids).to(device), hv.index_select(0, ids).to(device)
        return (hk.index_select(0, ids).pin_memory().to(device, non_blocking=True),
                hv.index_select(0, ids).pin_memory().to(device, non_blocking=True))

    def _prefetch(self, layer: int, device: torch.device) -> None:
        if layer >= self.host_pool.spec.num_layers or layer in self._ahead or self.placement(layer).host_table is None:
            return
        if device.type != "cuda":
            self._ahead[layer] = (*self._copy(layer, device), None)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self._stream):
            k, v = self._copy(layer, device)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._ahead[layer] = (k, v, event)

    def _staged(self, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self._ahead:
            return self._copy(layer, device)
        k, v, event = self._ahead.pop(layer)
        if event is not None:                  # made on the side stream: wait for it, keep it alive here
            stream = torch.cuda.current_stream(device)
            stream.wait_event(event)
            k.record_stream(stream)
            v.record_stream(stream)
        return k, v
