"""HCache storage: chunks kept as per-layer hidden states, and their layer-by-layer restore to KV.

A HIDDEN chunk stores, for layers [0, L_H), the hidden state entering the layer (the residual
stream, `hidden_size` values per token) and, for layers [L_H, num_layers), plain K/V: the layer
split chosen by HCache's bubble-free planner (`hidden/partition.py`). K/V of a hidden layer are rebuilt by
`project(layer, hidden [n, D], positions [n]) -> (K, V) [n, kv_heads, head_dim]`, a callable the
integration builds from the model's own modules (this package never imports transformers).

Hidden states are captured while tokens are computed: the step's `before_layer` (run by a forward
pre-hook of each decoder layer) hands the step's rows to `StepHidden.capture`, which writes them
into `HiddenCapture` at the step's slots (same addressing as the device pool), then rebuilds the
layer of the context's hidden chunks (`HiddenRestore.run`). No second forward pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..pools.pool import BlockPool, block_runs, host_zeros, resident_bytes, write_kv
from ..pools.tier import LazyFree, TierPool
from ..spec import KVSpec

# (layer, hidden [n, D], positions [n]) -> (K, V), each [n, kv_heads, head_dim], on the hidden's device
Projector = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class HiddenSpec:
    """Geometry of a hidden chunk: layers [0, hidden_layers) as hidden states, the rest as K/V."""

    kv: KVSpec
    hidden_size: int
    hidden_layers: int

    def __post_init__(self) -> None:
        if self.hidden_size <= 0:
            raise ValueError(f"hidden_size must be positive, got {self.hidden_size}")
        if not 0 <= self.hidden_layers <= self.kv.num_layers:
            raise ValueError(f"hidden_layers must be in [0, {self.kv.num_layers}], got {self.hidden_layers}")

    @property
    def kv_layers(self) -> int:
        return self.kv.num_layers - self.hidden_layers

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.kv.dtype).element_size()
        per_kv_layer = 2 * self.kv.num_kv_heads * self.kv.head_dim
        return (self.hidden_layers * self.hidden_size + self.kv_layers * per_kv_layer) * itemsize

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.kv.block_size


class HiddenPool(BlockPool):
    """Slots of hidden chunks; the free list is BlockPool's.

    hidden: [hidden_layers, num_blocks, block_size, hidden_size]
    kv:     [kv_layers, num_blocks, 2, block_size, kv_heads, head_dim]  (layer i is model layer L_H + i)
    """

    slice_blocks = False     # a slot is hidden[:, b] and kv[:, b]: copied slot-wise (`copy_slots`, `store_from`)

    def __init__(self, spec: HiddenSpec, num_blocks: int, device: torch.device | str = "cpu", *,
                 pin_memory: bool = False, data: tuple[torch.Tensor, torch.Tensor] | None = None,
                 transfer: LazyFree | None = None):
        kv, bs = spec.kv, spec.kv.block_size
        shapes = ((spec.hidden_layers, num_blocks, bs, spec.hidden_size),
                  (spec.kv_layers, num_blocks, 2, bs, kv.num_kv_heads, kv.head_dim))
        mems: tuple = (None, None)
        if data is None:                  # lazily committed in unpinned CPU memory (pool.host_zeros)
            made = [host_zeros(sh, kv.dtype, device, pin_memory) for sh in shapes]
            data, mems = tuple(t for t, _ in made), tuple(m for _, m in made)
        elif tuple(tuple(t.shape) for t in data) != shapes or any(t.dtype != kv.dtype for t in data):
            raise ValueError(f"hidden pool data must be {shapes} {kv.dtype}")
        self._mems = mems
        self._mem = mems[1]
        self.spec, self.hidden_spec, self.num_blocks = kv, spec, num_blocks
        self.hidden, self.kv = data
        self.data = self.kv          # BlockPool.device reads it; `bytes` is overridden below
        self.transfer, self.device_tier = transfer, False
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def device(self) -> torch.device:
        return self.hidden.device if self.hidden.numel() else self.kv.device

    @property
    def bytes_per_slot(self) -> int:
        return self.hidden_spec.bytes_per_block

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.hidden_spec.bytes_per_block

    def committed_bytes(self) -> int:
        return sum(resident_bytes(t) if m is not None else t.numel() * t.element_size()
                   for t, m in zip((self.hidden, self.kv), self._mems, strict=True))

    def layer(self, layer: int):
        raise TypeError("a hidden pool has no K/V view per layer; restore it through HiddenRestore")

    def store_from(self, capture: HiddenCapture, device_pool: TierPool, blocks: list[int], slots: list[int]) -> None:
        """Keep device blocks' chunks here: hidden layers from the capture, KV layers from the pool
        (issued by `Transfer.store_hidden`). Mutates: slots `slots`."""
        src = torch.tensor(blocks, dtype=torch.long)
        dst = torch.tensor(slots, dtype=torch.long, device=self.device)
        for layer in range(self.hidden_spec.hidden_layers):
            self.hidden[layer].index_copy_(0, dst, capture.data[layer].index_select(0, src).to(self.device))
        src_dev = src.to(device_pool.device)
        for i in range(self.hidden_spec.kv_layers):
            part = device_pool.read(self.hidden_spec.hidden_layers + i, src_dev)
            self.kv[i].index_copy_(0, dst, part.to(self.device))

    def copy_slots(self, src_ids: list[int], dst: HiddenPool, dst_ids: list[int]) -> None:
        """dst[:, dst_ids] = self[:, src_ids] (hidden <-> hidden tiers, e.g. host and disk; in a store,
        issued by `Transfer.copy_hidden`). Mutates: `dst`'s slots `dst_ids`."""
        runs = block_runs(src_ids, dst_ids)      # one slice copy per run of consecutive slots
        for part, a in enumerate((self.hidden, self.kv)):
            for s, d, n in runs:
                dst.put(part, d, a[:, s:s + n])

    def put(self, part: int, start: int, rows: torch.Tensor) -> None:
        """rows [layers, n, ...] into slots start.. of part 0 (hidden) or 1 (K/V). Mutates: those slots."""
        (self.hidden, self.kv)[part][:, start:start + rows.shape[1]].copy_(rows)


class HiddenCapture:
    """Hidden states of the device-resident tokens for layers [0, L_H), addressed like the device
    pool: data [hidden_layers, device_blocks, block_size, hidden_size], kept in host memory.

    `valid[b]` is True when every token of device block b was computed (or rebuilt from hidden
    states) while capturing, so the block's chunk can become HIDDEN; blocks filled by a KV swap-in
    are not valid (their hidden states were never seen)."""

    def __init__(self, spec: HiddenSpec, device_blocks: int):
        self.spec = spec
        self.data, self._mem = host_zeros((spec.hidden_layers, device_blocks, spec.kv.block_size, spec.hidden_size),
                                          spec.kv.dtype, "cpu", pin_memory=spec.kv.device.type == "cuda")
        self.valid = [False] * device_blocks
        self.stream = None        # CUDA: the side stream captures are copied on (StepHidden)

    def write(self, layer: int, slots_cpu: torch.Tensor, hidden: torch.Tensor) -> None:
        """hidden [T, D] of the rows at slots [T] (block * block_size + offset)."""
        if layer < self.spec.hidden_layers:
            flat = self.data[layer].view(-1, self.spec.hidden_size)
            flat.index_copy_(0, slots_cpu, hidden.detach().to("cpu", flat.dtype))


@dataclass(slots=True)
class _Group:
    pool: HiddenPool
    src: list[int]           # slots in `pool`
    dst: list[int]           # device blocks
    first_pos: list[int]     # absolute position of each chunk's first token
    rows: list[int]          # tokens of each chunk (the last one of a session may be partial)


class HiddenRestore:
    """Device blocks to rebuild from hidden chunks, one layer at a time (HCache's layer-wise restore).

    `run(layer, device_pool)` is called before that layer runs (`StepBatch.before_layer`, after the
    layer's capture): hidden layers are projected to K/V by the model's modules, KV layers are read
    from the chunk; both are written through the one K/V writer (`pool.write_kv`). Each layer
    runs once; `finish` runs whatever a forward did not reach."""

    def __init__(self, capture: HiddenCapture, project: Projector, counters=None):
        self.capture, self.project, self.counters = capture, project, counters
        self.groups: list[_Group] = []
        self.chunks: list[tuple[object, int]] = []   # (the caller's tag, device block) per planned chunk
        self.done: set[int] = set()

    def add(self, pool: HiddenPool, src: int, block: int, first_pos: int, rows: int, tag=None) -> None:
        """Plan one chunk of `rows` tokens: slot `src` of `pool` (host memory or the disk tier's
        mapped file; read layer by layer in `run`) to device `block`. `tag` is the caller's, kept
        in `chunks` with the block."""
        g = next((g for g in self.groups if g.pool is pool), None)
        if g is None:
            g = _Group(pool, [], [], [], [])
            self.groups.append(g)
        g.src.append(src)
        g.dst.append(block)
        g.first_pos.append(first_pos)
        g.rows.append(rows)
        self.chunks.append((tag, block))

    @property
    def complete(self) -> bool:
        return len(self.done) == self.capture.spec.kv.num_layers

    @torch.no_grad()
    def run(self, layer: int, pool: BlockPool) -> None:
        """Rebuild `layer` of the planned blocks in the device pool (every row of each block, K and V).
        Mutates that layer of the pool, the capture buffer (hidden layers) and `done`."""
        if layer in self.done or not self.groups:
            self.done.add(layer)
            return
        t0 = time.perf_counter()
        spec = self.capture.spec
        bs, hkv, hd, dev = spec.kv.block_size, spec.kv.num_kv_heads, spec.kv.head_dim, pool.device
        key_cache, value_cache = pool.layer(layer)                                 # [blocks, bs, Hkv, hd] views
        for g in self.groups:
            src = torch.tensor(g.src, device=g.pool.device)
            dst = torch.tensor(g.dst, device=dev)
            if layer < spec.hidden_layers:
                h = g.pool.hidden[layer].index_select(0, src)                       # [n, bs, D]
                self._recapture(layer, g, h)
                pos = (torch.tensor(g.first_pos)[:, None] + torch.arange(bs)).reshape(-1).to(dev)   # [n * bs]
                k, v = self.project(layer, h.reshape(-1, spec.hidden_size).to(dev), pos)     # [n * bs, Hkv, hd]
                shape = (len(g.dst), bs, hkv, hd)
                write_kv(key_cache, value_cache, k.reshape(shape), v.reshape(shape), dst)
            else:                                                                   # the chunk's own K/V
                kv = g.pool.kv[layer - spec.hidden_layers].index_select(0, src).to(dev)    # [n, 2, bs, Hkv, hd]
                write_kv(key_cache, value_cache, kv[:, 0], kv[:, 1], dst)
        self.done.add(layer)
        if self.complete:
            for g in self.groups:
                for b in g.dst:
                    self.capture.valid[b] = True
        if self.counters is not None:
            self.counters.restore_seconds += time.perf_counter() - t0

    def _recapture(self, layer: int, g: _Group, h: torch.Tensor) -> None:
        """The capture buffer gets the chunks' hidden states h [n, bs, D] of `layer` back (so the
        rebuilt blocks can become hidden again); rows past a partial chunk's tokens are left alone:
        the step's capture of the layer, just before in `before_layer`, wrote its new rows there."""
        full = [i for i, n in enumerate(g.rows) if n == h.shape[1]]
        if full:
            idx = torch.tensor(full)
            self.capture.data[layer].index_copy_(0, torch.tensor(g.dst)[idx], h.index_select(0, idx.to(h.device)).cpu())
        for i, n in enumerate(g.rows):
            if n != h.shape[1]:
                self.capture.data[layer, g.dst[i], :n] = h[i, :n].cpu()

    def finish(self, device_pool: BlockPool) -> None:
        """Run every layer not run yet (a restore outside a forward, or a forward that skipped some)."""
        for layer in range(device_pool.spec.num_layers):
            if layer not in self.done:
                self.run(layer, device_pool)


class StepHidden:
    """The hidden-state side of one step: capture of its rows and restore of its context.

    On CUDA a layer's rows are copied on a side stream into a pinned host buffer (no device sync per
    layer); `flush` (the step's commit or abort) waits on each copy's event and writes the rows
    into the capture buffer. Elsewhere `capture` writes them at once."""

    def __init__(self, capture: HiddenCapture | None, slots_cpu: torch.Tensor, restore: HiddenRestore | None):
        self.capture_buf, self.slots_cpu, self.restore = capture, slots_cpu, restore
        self._pending: list[tuple[int, torch.Tensor, object]] = []    # (layer, pinned rows [T, D], event)

    def capture(self, layer: int, hidden: torch.Tensor) -> None:
        """hidden: [1, T, D] or [T, D], the input of decoder layer `layer` for the step's rows."""
        buf = self.capture_buf
        if buf is None or layer >= buf.spec.hidden_layers:
            return
        rows = hidden.detach().reshape(-1, hidden.shape[-1])
        if rows.device.type != "cuda":
            buf.write(layer, self.slots_cpu, rows)
            return
        if buf.stream is None:
            buf.stream = torch.cuda.Stream(rows.device)
        rows = rows.clone()              # on the compute stream: later in-place kernels cannot change it
        buf.stream.wait_stream(torch.cuda.current_stream(rows.device))    # the rows exist before the copy
        with torch.cuda.stream(buf.stream):
            stage = torch.empty(rows.shape, dtype=buf.data.dtype, pin_memory=True)   # owned until its event
            stage.copy_(rows, non_blocking=True)
            rows.record_stream(buf.stream)       # the compute stream may not reuse rows' memory before
            event = torch.cuda.Event()
            event.record(buf.stream)
        self._pending.append((layer, stage, event))

    def flush(self) -> None:
        """Every captured layer is in the capture buffer when this returns."""
        for layer, stage, event in self._pending:
            event.synchronize()
            self.capture_buf.write(layer, self.slots_cpu, stage)
        self._pending.clear()
