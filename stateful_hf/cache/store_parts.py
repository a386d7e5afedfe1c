"""The assembly of the store's parts: `assemble(spec, config)` (`KVStore`'s options, `StoreConfig`, declared
in `stateful_hf/options/store.py`) opens the pools (`open_pools`) and builds each part with its
collaborators, in dependency order (docs/store.md), into one frozen `StoreParts`.

The one module that builds the feature packages' parts (`disk/`, `hidden/`, `layerwise/`,
`virtual/`) and registers them (`StoreParts.features`, the `StoreFeature` hooks the core calls in a
loop). A feature that is off has no part: nothing is registered for it, and where the core needs one
of its answers it gets the null part of `feature.py` (`NoDisk`, `NoHiddenStates`, `NoLayers`), so with
the default options none of the feature packages' code runs; the core imports them for annotations only.

Owns nothing after it returns: the parts own their state, the facade (`kv_store.py`) holds the
parts. If a part refuses the configuration, the disk tier opened before it is closed and the error
propagates (nothing else holds an OS resource yet).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..kernels import KernelState
from ..options import HiddenStates, Layout, StoreConfig
from ..options.store import DiskWrite
from .audit.stats import Counters
from .disk.state import DiskState
from .disk.tier import DiskTier
from .disk.writer import DiskWriter
from .errors import StoreError
from .eviction.policy import DEFAULT_POLICY, EvictionPolicy, make_policy
from .feature import NoDisk, NoHiddenStates, NoLayers, StoreFeature
from .hidden.tier import HiddenSteps, HiddenTier, open_hidden_tier
from .layerwise.chunks import LayeredChunks
from .layerwise.residues import ResidueTable
from .movement.moves import MoveLedger
from .movement.placement import Placement
from .movement.relocation import Relocation
from .movement.swap_in import SwapIn
from .movement.transfer import Transfer, emulate_from_env
from .pools.pool import BlockPool
from .pools.tier_pools import Capacity, TierPools
from .prefix.sharing import PrefixSharing
from .sessions.history import History
from .sessions.session import INDEXED, SessionTable
from .sessions.tier_index import TierOrder, TierUsage
from .spec import KVSpec, capacity_in_blocks
from .step_planner import StepPlanner
from .virtual.mapper import PageMapper
from .virtual.pool import VirtualPool


@contextmanager
def _allocating(name: str, capacity, spec: KVSpec) -> Iterator[None]:
    """A pool allocation torch cannot make (out of memory) as a StoreError naming the option."""
    try:
        yield
    except RuntimeError as e:                 # torch.OutOfMemoryError is one too
        raise StoreError(f"cannot allocate the pool for {name}={capacity!r} on "
                         f"{'cpu' if name == 'host_capacity' else spec.device}: {e}; give a smaller {name}") from e


def open_pools(spec: KVSpec, transfer: Transfer, device_capacity, host_capacity, disk_dir: str | os.PathLike | None,
               disk_capacity, layout: Layout, max_context: int | None, keep_freed, disk_fingerprint: str):
    """(device pool, host pool or None, disk tier or None) of a store (`KVStore` has the options), each
    pool given the store's `transfer` (made first: every free passes through it)."""
    with _allocating("device_capacity", device_capacity, spec):
        if layout is Layout.PAGED:
            device_pool = BlockPool(spec, capacity_in_blocks(device_capacity, spec), transfer=transfer,
                                    device_tier=True)
        else:
            device_pool = VirtualPool(spec, capacity_in_blocks(device_capacity, spec), max_context,
                                      keep_bytes=0 if keep_freed in (0, "0") else
                                      capacity_in_blocks(keep_freed, spec) * spec.bytes_per_block, transfer=transfer)
    with _allocating("host_capacity", host_capacity, spec):
        host_pool = None if host_capacity is None else BlockPool(
            spec, capacity_in_blocks(host_capacity, spec), "cpu", pin_memory=spec.device.type == "cuda",
            transfer=transfer)
    disk_blocks = capacity_in_blocks(disk_capacity if disk_capacity is not None else "1GiB", spec)
    disk = None if disk_dir is None else DiskTier(spec, disk_dir, disk_blocks, disk_fingerprint, transfer)
    return device_pool, host_pool, disk


@dataclass(frozen=True, slots=True)
class StoreParts:
    """One store's parts, in the order they are built (each is given only parts above it)."""

    kernels: KernelState           # one FlashInfer workspace + wrapper per store, planned per step
    transfer: Transfer
    counters: Counters             # each field written by the part `stats.py` names
    moves: MoveLedger              # chunk moves between tiers (moves.py)
    sessions: SessionTable
    sharing: PrefixSharing
    hidden: HiddenTier | NoHiddenStates      # NoHiddenStates: the store captures none (the default)
    disk_state: DiskState | NoDisk           # NoDisk: no disk tier (the default)
    tiers: TierPools
    placement: Placement
    swap_in: SwapIn
    layered: LayeredChunks | NoLayers        # NoLayers: no layerwise_kv (the default)
    relocation: Relocation
    planner: StepPlanner
    history: History
    capacity: Capacity
    writer: DiskWriter | None      # None: no disk tier; else the flush on close and (disk_write=behind) write-behind
    features: tuple[StoreFeature, ...]   # the registered features, in build order; () for a default store


def _policy(c: StoreConfig) -> EvictionPolicy:
    """The config's policy: an EvictionPolicy as given, a name (None: DEFAULT_POLICY) over its cost profile."""
    return c.policy if isinstance(c.policy, EvictionPolicy) else make_policy(c.policy or DEFAULT_POLICY, c.cost_profile)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Loading a large disk index makes about ten objects a chunk: the cyclic collector would walk the
    growing heap again and again (about a third of a restart with 5x10^4 sessions). Nothing made here
    is cyclic garbage."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def assemble(spec: KVSpec, c: StoreConfig) -> StoreParts:
    """Make the transfer engine, open the pools (each given it) and build every part; the disk tier's
    committed index is loaded last."""
    with _collector_paused():
        return _assemble(spec, c)


def _assemble(spec: KVSpec, c: StoreConfig) -> StoreParts:
    transfer = Transfer(spec.device, emulate_from_env() if c.emulate_async is None else c.emulate_async)
    device_pool, host_pool, disk = open_pools(spec, transfer, c.device_capacity, c.host_capacity, c.disk_dir,
                                              c.disk_capacity, c.layout, c.max_context, c.keep_freed,
                                              c.disk_fingerprint)
    counters, moves = Counters(), MoveLedger()
    sessions = SessionTable(c.clock, TierOrder(INDEXED), TierUsage(spec.block_size))
    sharing = PrefixSharing(spec.block_size, sessions.find,
                            c.prefix_sharing is not False and c.layout is Layout.PAGED and not c.layerwise_kv,
                            sessions.recount, sessions.recount_chunk)
    try:
        hidden_tier = None if c.hidden_states is HiddenStates.NEVER else open_hidden_tier(
            c.hidden_states, c.hidden_spec, c.project, spec, device_pool.num_blocks, c.hidden_capacity,
            c.host_capacity, disk, c.hidden_disk_capacity if c.hidden_disk_capacity is not None else c.disk_capacity,
            transfer)
        hidden = NoHiddenStates() if hidden_tier is None else hidden_tier
        disk_state = NoDisk() if disk is None else DiskState(sessions, disk, transfer, spec.block_size)
        tiers = TierPools(device_pool, host_pool, disk, hidden.pool,
                          None if hidden_tier is None else hidden_tier.disk_pool, disk_state, sharing,
                          ResidueTable() if c.layerwise_kv else None, sessions.let_go, sessions.recount)
        placement = Placement(sessions, tiers, transfer, disk_state, hidden, _policy(c),
                              moves, counters, c.swap_out_threshold)
        swap_in = SwapIn(sessions, tiers, placement, transfer, hidden, disk_state, counters)
        layered = NoLayers() if not c.layerwise_kv else LayeredChunks(
            tiers, placement, transfer, counters, layout=c.layout, attn_backend=c.attn_backend,
            capturing=hidden_tier is not None)
        relocation = Relocation(tiers, placement, swap_in, hidden, transfer)
        kernels = KernelState(c.step_backends.short_rows)
        planner = StepPlanner(sessions, tiers, placement, swap_in, hidden, layered, transfer, counters, kernels,
                              layout=c.layout, backends=c.step_backends)
        history = History(sessions, tiers, placement, disk_state, planner)
        capacity = Capacity(sessions, tiers, c.layout)
        writer = None if disk is None else DiskWriter(
            sessions.lock, sessions, tiers, disk_state, c.disk_write is DiskWrite.BEHIND, c.write_behind_delay,
            capacity_in_blocks(c.write_behind_queue, spec))
    except BaseException:
        if disk is not None:
            disk.close()
        raise
    if writer is not None:
        sessions.on_change = disk_state.mark_changed     # who the table marks or removes: rows to commit
        disk_state.load(sharing)
    features: list[StoreFeature] = []        # the order the core calls them in (commit: hidden rows first)
    if hidden_tier is not None:
        features.append(HiddenSteps(swap_in.settle))
    if isinstance(layered, LayeredChunks):
        features.append(layered)
    if c.layout is Layout.VIRTUAL and c.map_ahead:
        features.append(PageMapper(device_pool, sessions))    # its thread starts here, once nothing can fail
    if writer is not None:
        features.append(writer)
    planner.features = relocation.features = tuple(features)
    planner.layer_features = tuple(f for f in features if f.per_layer)
    return StoreParts(kernels, transfer, counters, moves, sessions, sharing, hidden, disk_state, tiers, placement,
                      swap_in, layered, relocation, planner, history, capacity, writer, tuple(features))
