"""Layered chunks (LayerKV §3.1, layer-wise KV allocation): the store's LAYERED chunks.

A step entry planned with keep factor f != 1 fills its fresh chunks as LAYERED: each gets a host slot
(every layer it does not keep is written there as the layer is computed) and, for f >= 2, residue r
of a residue block: a device block split with up to f - 1 other chunks (layers l % f == r are
written there). Such a step also reads the entry's HOST context chunks in place (they become
LAYERED with no residue block) instead of copying them up. Attention reads every LAYERED chunk's
layer from wherever it lives (`layerwise/step.py`). Pushing kept layers down copies them to the host
slot and gives the residue back; when the turn ends (lease released) every LAYERED chunk is pushed
down and becomes HOST.

Owns: the staging choice (`stage`). Exists only in a store made with layerwise_kv=True.
Collaborators: the pools (their residue table: `place_residues` / `free_residue`), placement (slots,
room, move records), the transfer engine (every copy: `copy` and, for kept layers, `copy_layers`), the
counters (written: swapped_out_host).
Mutates: LAYERED chunks (created by `fill`, pushed down, settled to HOST), a busy session's DEVICE
chunks (`offload_device`), the host pool and the residue table. Store lock held throughout.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ...options import Layout
from ..audit.stats import Counters
from ..errors import CapacityError
from ..feature import StoreFeature
from ..movement.placement import Items, Placement
from ..movement.transfer import Transfer
from ..pools.tier_pools import TierPools
from ..sessions.session import Chunk, ChunkState, Session
from ..turn import check_factor
from .residues import kept_layers
from .step import LayeredStep

if TYPE_CHECKING:
    from ..step import StepBatch

LAYERED, DEVICE, HOST = ChunkState.LAYERED, ChunkState.DEVICE, ChunkState.HOST


class LayeredChunks(StoreFeature):
    """Built only for a store made with layerwise_kv=True (otherwise the store has `feature.NoLayers`);
    a registered feature: a step's staged layers are flushed at commit and dropped at abort, and a
    session's LAYERED chunks settle to HOST when it runs no turn (`settle`)."""

    def __init__(self, tiers: TierPools, placement: Placement, transfer: Transfer, counters: Counters, *,
                 layout: Layout, attn_backend: str, capturing: bool):
        # stage host-resident layers onto the device per layer (None: when the host pool is elsewhere,
        # i.e. on CUDA; True: on the CPU too, which is how tests cover the staging path)
        self.stage: bool | None = None
        self.tiers, self.placement, self.transfer, self.counters = tiers, placement, transfer, counters
        self.num_layers = tiers.device.spec.num_layers
        self.block_size = tiers.device.spec.block_size
        if tiers.host is None:
            raise ValueError("layerwise_kv needs a host tier (host_capacity): the layers a chunk does not keep on "
                             "the device live there")
        if layout is not Layout.PAGED:
            raise ValueError(f"layerwise_kv works with layout='paged' only, not {layout!r} (the virtual "
                             "layout's dense kernels read one contiguous slot per session)")
        if attn_backend != "torch":
            raise ValueError(f"layerwise_kv needs attn_backend='torch' (the {attn_backend} backend cannot read "
                             "host-resident layers); other backends are not supported with it yet")
        if capturing:
            raise ValueError("layerwise_kv cannot be combined with hidden states (hidden_states='never' with it)")

    @staticmethod
    def check_factors(factors: list[int]) -> None:
        """Every keep factor is allowed here (`turn.check_factor` checked each)."""

    def commit(self, step: StepBatch) -> None:
        if step.layered is not None:
            step.layered.flush()                 # staged mode: rows of host layers reach the host now

    def abort(self, step: StepBatch) -> None:
        if step.layered is not None:
            step.layered.discard()

    def blocks_needed(self, factor: int, n_chunks: int) -> int:
        """Device blocks n_chunks new chunks of keep factor `factor` take now: n for 1, 0 for 0, about
        n / f else (fewer when open residue blocks of that factor have free residues)."""
        check_factor(factor, self.num_layers)
        return n_chunks if factor == 1 else self.tiers.residues.blocks_needed(factor, n_chunks)

    def fill(self, owners: Items, factor: int, exclude: set[str]) -> list[Chunk]:
        """LAYERED chunks for `owners` (chunks a step fills) at keep factor 0 or >= 2: a host slot each
        and, for factor >= 2, a residue of a residue block. Allocates; does not assign."""
        if not owners:
            return []
        check_factor(factor, self.num_layers)
        hosts = self.placement.take(HOST, len(owners), exclude)
        placed: list[tuple[int, int] | None] = [None] * len(owners)
        if factor >= 2:
            try:
                new = self.placement.take(DEVICE, self.tiers.residues.blocks_needed(factor, len(owners)), exclude)
            except CapacityError:
                self.tiers.host.free(hosts)
                raise
            placed = self.tiers.place_residues(factor, [(s.session_id, k) for s, k in owners], new)
        return [Chunk(LAYERED, h, residue_block=None if p is None else (p[0], factor, p[1]))
                for h, p in zip(hosts, placed)]

    def discard(self, c: Chunk) -> None:
        """Free a LAYERED chunk made by `fill` but never assigned to a session."""
        self.tiers.host.free([c.loc])
        if c.residue_block is not None:
            self.tiers.free_residue(c)

    def push_residues(self, items: Items) -> int:
        """Copy the kept layers of LAYERED chunks with a residue block to their host slots and give the
        residues back (they then read every layer from the host). Returns device blocks freed."""
        items = [(s, k) for s, k in items if s.chunks[k].state is LAYERED and s.chunks[k].residue_block is not None]
        moves = []                                 # one batched copy per layer
        for layer in range(self.num_layers):
            moved = [s.chunks[k] for s, k in items
                     if layer in kept_layers(self.num_layers, *s.chunks[k].residue_block[1:])]
            moves.append((layer, [c.residue_block[0] for c in moved], [c.loc for c in moved]))
        self.transfer.copy_layers(self.tiers.device, self.tiers.host, moves)
        freed = 0
        for s, k in items:
            c = s.chunks[k]
            freed += self.tiers.free_residue(c)
            c.residue_block = None
        return freed

    def offload_device(self, s: Session, exclude: set[str]) -> int:
        """A busy session's DEVICE chunks to LAYERED without a residue block (every layer copied to a
        host slot; later steps read them in place). As many as the host tier has room for. Returns
        blocks freed."""
        host = self.tiers.host
        ks = [k for k, c in enumerate(s.chunks) if c.state is DEVICE]
        if len(ks) > host.num_free:     # idle sessions' host chunks move down (or drop)
            self.placement.make_room(HOST, len(ks) - host.num_free, exclude)
        ks = ks[:host.num_free]
        if not ks:
            return 0
        hosts = host.allocate(len(ks))
        blocks = [s.chunks[k].loc for k in ks]
        t0 = time.perf_counter()
        self.transfer.copy(self.tiers.device, blocks, host, hosts)
        with self.placement.moving("pressure"):
            self.placement.record(DEVICE, LAYERED, [(s, k) for k in ks], t0)
        self.tiers.device.free(blocks)
        for k, h in zip(ks, hosts):
            s.chunks[k] = Chunk(LAYERED, h)
        self.counters.swapped_out_host += sum(s.chunk_len(k, self.block_size) for k in ks)
        return len(ks)

    def offload(self, s: Session, full: bool) -> int:
        """LayerKV's push-down for a running request: its LAYERED chunks' kept layers to their host
        slots; with `full`, its DEVICE chunks too. Returns device blocks freed."""
        freed = self.push_residues([(s, k) for k in range(len(s.chunks))])
        if full:
            freed += self.offload_device(s, {s.session_id})
        return freed

    def settle(self, s: Session) -> int:
        """End of a turn (or an eviction): LAYERED chunks become HOST (kept layers pushed down first).
        Returns device blocks freed."""
        freed = self.push_residues([(s, k) for k in range(len(s.chunks))])
        for k, c in enumerate(s.chunks):
            if c.state is LAYERED:
                s.chunks[k] = Chunk(HOST, c.loc)
        self.tiers.recount(s.session_id)
        return freed

    def step_map(self, sessions: list[Session], positions: list[tuple[int, ...]],
                 tables: list[list[int]]) -> LayeredStep | None:
        """The per-layer residency of a step's rows (`positions` per entry) and context, or None when
        every chunk involved is DEVICE (then the step is exactly as without layerwise_kv)."""
        bs = self.block_size
        if not any(c.state is LAYERED for s, t in zip(sessions, tables) for c in s.chunks[:len(t)]):
            return None
        self.transfer.settle(self.tiers.host)     # host slots are read in place: copies into them land first

        def where(c: Chunk, off: int) -> tuple[int, int, int, int]:   # (device slot, host slot, factor, residue)
            if c.state is DEVICE:
                return c.loc * bs + off, -1, 1, 0
            if c.residue_block is None:
                return -1, c.loc * bs + off, 0, 0
            return c.residue_block[0] * bs + off, c.loc * bs + off, c.residue_block[1], c.residue_block[2]

        rows = [where(s.chunks[p // bs], p % bs) for s, pos in zip(sessions, positions) for p in pos]
        width = max(map(len, tables))
        cells = [[where(c, 0) for c in s.chunks[:len(t)]] + [(-1, -1, 1, 0)] * (width - len(t))
                 for s, t in zip(sessions, tables)]
        return LayeredStep(self.tiers.host, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                           [r[3] for r in rows], [[-1 if c[1] < 0 else c[1] // bs for c in row] for row in cells],
                           [[c[2] for c in row] for row in cells], [[c[3] for c in row] for row in cells],
                           stage=self.stage)
