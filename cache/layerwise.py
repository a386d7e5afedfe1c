"""Layer-wise KV allocation (LayerKV §3.1): the store's LAYERED chunks (a mixin of SessionStore).

A step entry planned with keep factor f != 1 fills its fresh chunks as LAYERED: each gets a host slot
(every layer it does not keep is written there as the layer is computed) and, for f >= 2, residue r
of a device block shared with up to f - 1 other chunks (layers l % f == r are written there). Such a
step also reads the entry's HOST context chunks in place (they become LAYERED with no share) instead
of copying them up. Attention reads every LAYERED chunk's layer from wherever it lives
(`layered_step.py`). Pushing kept layers down copies them to the host slot and gives the share back;
when the turn ends (lease released) every LAYERED chunk is pushed down and becomes HOST.

Every method runs with the store lock held, except the public `offload_layers`, which takes it.
"""

from __future__ import annotations

import time

import torch

from .errors import CapacityError
from .layered_step import LayeredStep
from .session import Chunk, ChunkState, Session
from .shares import ShareTable, check_factor, kept_layers

LAYERED, DEVICE, HOST = ChunkState.LAYERED, ChunkState.DEVICE, ChunkState.HOST


class LayerwiseMixin:
    # provided by SessionStore: device_pool, host_pool, spec, layout, attn_backend, capture, counters,
    # _lock, _sessions, session(), _take, _release

    def _init_layerwise(self, enabled: bool) -> None:
        self.layerwise = bool(enabled)
        # stage host-resident layers onto the device per layer (None: when the host pool is elsewhere,
        # i.e. on CUDA; True: on the CPU too, which is how tests cover the staging path)
        self.layerwise_stage: bool | None = None
        self.shares = ShareTable()
        if not enabled:
            return
        if self.host_pool is None:
            raise ValueError("layerwise_kv needs a host tier (host_capacity): the layers a chunk does not keep on "
                             "the device live there")
        if self.layout != "paged":
            raise ValueError(f"layerwise_kv works with layout='paged' only, not {self.layout!r} (the virtual "
                             "layout's dense kernels read one contiguous slot per session)")
        if self.attn_backend != "torch":
            raise ValueError(f"layerwise_kv needs attn_backend='torch' (the {self.attn_backend} backend cannot read "
                             "host-resident layers); other backends are not supported with it yet")
        if self.capture is not None:
            raise ValueError("layerwise_kv cannot be combined with hidden states (hidden_states='never' with it)")

    # ---- allocation -----------------------------------------------------------------------------

    def _fill_layered(self, owners: list[tuple[Session, int]], factor: int, exclude: set[str]) -> list[Chunk]:
        """LAYERED chunks for `owners` (chunks a step fills) at keep factor 0 or >= 2: a host slot each
        and, for factor >= 2, a residue of a shared device block. Allocates; does not assign."""
        if not owners:
            return []
        check_factor(factor, self.spec.num_layers)
        hosts = self._take(HOST, len(owners), exclude)
        placed: list[tuple[int, int] | None] = [None] * len(owners)
        if factor >= 2:
            try:
                new = self._take(DEVICE, self.shares.blocks_needed(factor, len(owners)), exclude)
            except CapacityError:
                self.host_pool.free(hosts)
                raise
            placed = self.shares.place(factor, [(s.session_id, k) for s, k in owners], new)
        return [Chunk(LAYERED, h, share=None if p is None else (p[0], factor, p[1])) for h, p in zip(hosts, placed)]

    def share_blocks_needed(self, factor: int, n_chunks: int) -> int:
        """Device blocks n_chunks new chunks of keep factor `factor` take: n for 1, 0 for 0, about n / f else."""
        with self._lock:
            check_factor(factor, self.spec.num_layers)
            return n_chunks if factor == 1 else self.shares.blocks_needed(factor, n_chunks)

    # ---- pushing kept layers down ---------------------------------------------------------------

    def _push_shares(self, items: list[tuple[Session, int]]) -> int:
        """Copy the kept layers of LAYERED chunks with a share to their host slots and give the shares
        back (they then read every layer from the host). Returns device blocks freed."""
        items = [(s, k) for s, k in items if s.chunks[k].state is LAYERED and s.chunks[k].share is not None]
        n_layers = self.spec.num_layers
        for layer in range(n_layers):       # one batched copy per layer
            moved = [s.chunks[k] for s, k in items if layer in kept_layers(n_layers, *s.chunks[k].share[1:])]
            if moved:
                dev = torch.tensor([c.share[0] for c in moved], device=self.device_pool.device)
                host = torch.tensor([c.loc for c in moved])
                self.host_pool.write(layer, host, self.device_pool.read(layer, dev).to(self.host_pool.device))
        freed = 0
        for s, k in items:
            c = s.chunks[k]
            block, _, residue = c.share
            c.share = None
            if self.shares.release(block, residue):
                self.device_pool.free([block])
                freed += 1
        return freed

    def _offload_device(self, s: Session, exclude: set[str]) -> int:
        """A busy session's DEVICE chunks to LAYERED without a share (every layer copied to a host
        slot; later steps read them in place). As many as the host tier has room for. Returns blocks freed."""
        ks = [k for k, c in enumerate(s.chunks) if c.state is DEVICE]
        if len(ks) > self.host_pool.num_free:     # idle sessions' host chunks move down (or drop)
            self._make_room(HOST, len(ks) - self.host_pool.num_free, exclude)
        ks = ks[:self.host_pool.num_free]
        if not ks:
            return 0
        hosts = self.host_pool.allocate(len(ks))
        blocks = [s.chunks[k].loc for k in ks]
        t0 = time.perf_counter()
        self.transfer.copy(self.device_pool, blocks, self.host_pool, hosts)
        with self._moving("pressure"):
            self._record_move(DEVICE, LAYERED, [(s, k) for k in ks], t0)
        self.device_pool.free(blocks)
        for k, h in zip(ks, hosts):
            s.chunks[k] = Chunk(LAYERED, h)
        self.counters.swapped_out_host += sum(s.chunk_len(k, self.block_size) for k in ks)
        return len(ks)

    def offload_layers(self, session_id: str, full: bool = False) -> int:
        """LayerKV's push-down for a running request when projected free device blocks run short: its
        LAYERED chunks' kept layers go to their host slots (shares given back); with `full`, its DEVICE
        chunks too (their KV moves to host slots and later steps read it in place). Returns device
        blocks freed. A no-op on a store without layerwise_kv."""
        with self._lock:
            if not self.layerwise:
                return 0
            s = self.session(session_id)
            freed = self._push_shares([(s, k) for k in range(len(s.chunks))])
            if full:
                freed += self._offload_device(s, {session_id})
            return freed

    def _settle_layered(self, s: Session) -> int:
        """End of a turn (or an eviction): LAYERED chunks become HOST (kept layers pushed down first).
        Returns device blocks freed."""
        freed = self._push_shares([(s, k) for k in range(len(s.chunks))])
        for k, c in enumerate(s.chunks):
            if c.state is LAYERED:
                s.chunks[k] = Chunk(HOST, c.loc)
        return freed

    def _release_share(self, c: Chunk) -> None:
        if c.share is not None and self.shares.release(c.share[0], c.share[2]):
            self.device_pool.free([c.share[0]])

    def _release_chunk(self, c: Chunk) -> None:
        """Free a LAYERED chunk made by `_fill_layered` but never assigned to a session."""
        self.host_pool.free([c.loc])
        self._release_share(c)

    @staticmethod
    def _table_block(c: Chunk) -> int:
        """The device block a step's block table names for a context chunk: its block (DEVICE), its
        shared block (LAYERED with a share) or 0 (LAYERED without: every layer comes from the host)."""
        if c.state is LAYERED:
            return c.share[0] if c.share is not None else 0
        return c.loc

    # ---- the step's per-layer map ---------------------------------------------------------------

    def _layered_step(self, entries, tables: list[list[int]]) -> LayeredStep | None:
        """The per-layer residency of a step's rows and context, or None when every chunk involved is
        DEVICE (then the step is exactly as without layerwise_kv)."""
        bs = self.block_size
        sessions = [self._sessions[e.session_id] for e in entries]
        if not any(c.state is LAYERED for s, t in zip(sessions, tables) for c in s.chunks[:len(t)]):
            return None
        self.transfer.settle(self.host_pool)     # host slots are read in place: copies into them land first

        def where(c: Chunk, off: int) -> tuple[int, int, int, int]:   # (device slot, host slot, factor, residue)
            if c.state is DEVICE:
                return c.loc * bs + off, -1, 1, 0
            if c.share is None:
                return -1, c.loc * bs + off, 0, 0
            return c.share[0] * bs + off, c.loc * bs + off, c.share[1], c.share[2]

        rows = [where(s.chunks[p // bs], p % bs) for s, e in zip(sessions, entries) for p in e.positions]
        width = max(map(len, tables))
        cells = [[where(c, 0) for c in s.chunks[:len(t)]] + [(-1, -1, 1, 0)] * (width - len(t))
                 for s, t in zip(sessions, tables)]
        return LayeredStep(self.host_pool, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                           [r[3] for r in rows], [[-1 if c[1] < 0 else c[1] // bs for c in row] for row in cells],
                           [[c[2] for c in row] for row in cells], [[c[3] for c in row] for row in cells],
                           stage=self.layerwise_stage)
