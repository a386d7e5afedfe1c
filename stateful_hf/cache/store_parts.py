"""The store's configuration and the assembly of its parts: `StoreConfig` (every option of `KVStore`,
checked once) and `assemble(spec, config)`, which opens the pools (`open_pools`) and builds each part
with its collaborators, in dependency order (docs/store.md), into one frozen `StoreParts`.

The one module that builds the feature packages' parts (`disk/`, `hidden/`, `layerwise/`,
`virtual/`): a feature that is off has no part (None) and the core skips it, so with the default
options none of their code runs; the core imports them for annotations only.

Owns nothing after it returns: the parts own their state, the facade (`kv_store.py`) holds the
parts. If a part refuses the configuration, the disk tier opened before it is closed and the error
propagates (nothing else holds an OS resource yet).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..kernels import KernelState
from .capacity import Capacity
from .disk.state import DiskState
from .disk.tier import DiskTier
from .errors import StoreError
from .hidden.states import HiddenSpec, Projector
from .hidden.tier import HiddenTier, open_hidden_tier
from .history import History
from .layerwise.chunks import LayeredChunks
from .layerwise.residues import ResidueTable
from .moves import MoveLedger
from .placement import Placement
from .policy import DEFAULT_POLICY, EvictionPolicy, make_policy
from .pool import BlockPool
from .prefix.sharing import PrefixSharing
from .relocation import Relocation
from .session_table import SessionTable
from .spec import KVSpec, capacity_in_blocks
from .stats import Counters
from .step_planner import StepPlanner
from .swap_in import SwapIn
from .tier_pools import TierPools
from .transfer import Transfer, emulate_from_env
from .virtual.mapper import PageMapper
from .virtual.pool import VirtualPool


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """`KVStore`'s options (its signature; the defaults are its defaults).

    device_capacity / host_capacity / disk_capacity: tokens (int) or sizes ("2GiB"); a host or
    disk tier exists only when given (the disk tier also needs `disk_dir`). `swap_out_threshold`:
    share of device blocks kept free or reclaimable by ahead-of-time swap-out after each turn.
    hidden_states ("auto" | "always" | "never"), hidden_spec, hidden_capacity (default: host_capacity),
    hidden_disk_capacity (the disk tier's hidden file; default: disk_capacity) and project (hidden ->
    K/V per layer): HCache's hidden-state tier, see `hidden/tier.py`.
    Virtual layout only: `keep_freed` (tokens or a size) of freed device pages stay committed for
    reuse (vAttention's deferred reclamation; `reclaim()` gives them back), and with `map_ahead` a
    background thread maps the block each stepping session grows into next.
    `clock`: seconds for sessions' last activity, which the policy's idle time T is measured with
    (default time.monotonic; a virtual clock makes eviction order reproducible in replays).
    `policy`: default `DEFAULT_POLICY` (policy.py) over a default Cost profile. It is told each
    returning session's idle gap when a lease starts, and sees all sessions before each ranking
    (`observe_return`, `prepare`).
    attn_backend: the concrete backend `KVStore` resolved with `kernels.select_backend` (from "auto" or a
    name, for the spec's device, dtype, head_dim, block size, layerwise_kv and layout).
    layerwise_kv: LayerKV's layer-wise allocation (`layerwise/chunks.py`): steps may fill chunks keeping only
    some layers on the device (residue blocks) and the rest on the host; needs a host tier, the paged
    layout and the torch backend.
    disk_fingerprint: identifies the model whose KV the disk tier holds (its config and weights); a
    disk_dir made with another is refused. The disk tier serves a chunk only if it proves it is the
    chunk it names, else recomputes it (`disk/tier.py`).
    emulate_async: run copies under the CPU async emulator (`transfer.py`); default: the environment
    variable STATEFUL_HF_EMULATE_ASYNC=1.
    prefix_sharing: full chunks of identical prefixes held once (`prefix/sharing.py`); None: on where
    it can be (paged layout, no layerwise_kv)."""

    device_capacity: int | str = 4096
    host_capacity: int | str | None = None
    disk_dir: str | os.PathLike | None = None
    disk_capacity: int | str | None = None
    policy: EvictionPolicy | None = None
    attn_backend: str = "torch"
    swap_out_threshold: float = 0.25
    hidden_states: str = "never"
    hidden_spec: HiddenSpec | None = None
    hidden_capacity: int | str | None = None
    project: Projector | None = None
    layout: str = "paged"
    max_context: int | None = None
    clock: Callable[[], float] = time.monotonic
    keep_freed: int | str = "64MiB"
    map_ahead: bool = True
    hidden_disk_capacity: int | str | None = None
    layerwise_kv: bool = False
    disk_fingerprint: str = ""
    emulate_async: bool | None = None
    prefix_sharing: bool | None = None

    def __post_init__(self):
        if not 0 <= self.swap_out_threshold < 1:
            raise ValueError(f"swap_out_threshold must be in [0, 1), got {self.swap_out_threshold}")
        if self.disk_capacity is not None and self.disk_dir is None:
            raise ValueError("disk_capacity needs a disk_dir")
        if self.layout not in ("paged", "virtual"):
            raise ValueError(f"unknown layout {self.layout!r}; choose 'paged' or 'virtual'")
        if self.layout == "virtual" and self.max_context is None:
            raise ValueError("layout='virtual' needs max_context (tokens per session slot)")
        if self.prefix_sharing and (self.layout != "paged" or self.layerwise_kv):
            raise ValueError("prefix_sharing needs layout='paged' and no layerwise_kv (a virtual layout keeps each "
                             "session's KV in its own slot; layer-wise KV splits blocks among sessions)")


@contextmanager
def _allocating(name: str, capacity, spec: KVSpec) -> Iterator[None]:
    """A pool allocation torch cannot make (out of memory) as a StoreError naming the option."""
    try:
        yield
    except RuntimeError as e:                 # torch.OutOfMemoryError is one too
        raise StoreError(f"cannot allocate the pool for {name}={capacity!r} on "
                         f"{'cpu' if name == 'host_capacity' else spec.device}: {e}; give a smaller {name}") from e


def open_pools(spec: KVSpec, device_capacity, host_capacity, disk_dir: str | os.PathLike | None, disk_capacity,
               layout: str, max_context: int | None, keep_freed, disk_fingerprint: str):
    """(device pool, host pool or None, disk tier or None) of a store (`KVStore` has the options)."""
    with _allocating("device_capacity", device_capacity, spec):
        if layout == "paged":
            device_pool = BlockPool(spec, capacity_in_blocks(device_capacity, spec))
        else:
            device_pool = VirtualPool(spec, capacity_in_blocks(device_capacity, spec), max_context,
                                      keep_bytes=0 if keep_freed in (0, "0") else
                                      capacity_in_blocks(keep_freed, spec) * spec.bytes_per_block)
    with _allocating("host_capacity", host_capacity, spec):
        host_pool = None if host_capacity is None else BlockPool(
            spec, capacity_in_blocks(host_capacity, spec), "cpu", pin_memory=spec.device.type == "cuda")
    disk_blocks = capacity_in_blocks(disk_capacity if disk_capacity is not None else "1GiB", spec)
    disk = None if disk_dir is None else DiskTier(spec, disk_dir, disk_blocks, disk_fingerprint)
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
    hidden: HiddenTier | None      # None: the store captures no hidden states (the default)
    disk_state: DiskState | None   # None: no disk tier (the default)
    tiers: TierPools
    placement: Placement
    swap_in: SwapIn
    layered: LayeredChunks | None  # None: no layerwise_kv (the default)
    relocation: Relocation
    planner: StepPlanner
    history: History
    capacity: Capacity


def assemble(spec: KVSpec, c: StoreConfig) -> StoreParts:
    """Open the pools and build every part; the disk tier's committed index is loaded last."""
    device_pool, host_pool, disk = open_pools(spec, c.device_capacity, c.host_capacity, c.disk_dir, c.disk_capacity,
                                              c.layout, c.max_context, c.keep_freed, c.disk_fingerprint)
    transfer = Transfer(device_pool, emulate_from_env() if c.emulate_async is None else c.emulate_async)
    counters, moves, sessions = Counters(), MoveLedger(), SessionTable(c.clock)
    sharing = PrefixSharing(spec.block_size, sessions.find,
                            c.prefix_sharing is not False and c.layout == "paged" and not c.layerwise_kv)
    try:
        hidden = None if c.hidden_states == "never" else open_hidden_tier(
            c.hidden_states, c.hidden_spec, c.project, spec, device_pool.num_blocks, c.hidden_capacity,
            c.host_capacity, disk, c.hidden_disk_capacity if c.hidden_disk_capacity is not None else c.disk_capacity)
        disk_state = None if disk is None else DiskState(sessions, disk, transfer, spec.block_size)
        tiers = TierPools(device_pool, host_pool, disk, hidden.pool if hidden is not None else None,
                          hidden.disk_pool if hidden is not None else None, disk_state, sharing,
                          ResidueTable() if c.layerwise_kv else None)
        for pool in (device_pool, host_pool, disk.pool if disk is not None else None):
            if pool is not None:
                pool.transfer = transfer
        placement = Placement(sessions, tiers, transfer, disk_state, hidden, c.policy or make_policy(DEFAULT_POLICY),
                              moves, counters, c.swap_out_threshold)
        swap_in = SwapIn(sessions, tiers, placement, transfer, hidden, disk_state, counters)
        layered = None if not c.layerwise_kv else LayeredChunks(
            tiers, placement, transfer, counters, layout=c.layout, attn_backend=c.attn_backend,
            capturing=hidden is not None)
        relocation = Relocation(tiers, placement, swap_in, hidden, layered, transfer)
        kernels = KernelState()
        planner = StepPlanner(sessions, tiers, placement, swap_in, hidden, layered, transfer, counters, kernels,
                              layout=c.layout, attn_backend=c.attn_backend,
                              page_mapper=PageMapper(device_pool) if c.layout == "virtual" and c.map_ahead else None)
        history = History(sessions, tiers, placement, disk_state, planner)
        capacity = Capacity(sessions, tiers, layered, c.layout)
    except BaseException:
        if disk is not None:
            disk.close()
        raise
    if disk_state is not None:
        disk_state.load(sharing)
    return StoreParts(kernels, transfer, counters, moves, sessions, sharing, hidden, disk_state, tiers, placement,
                      swap_in, layered, relocation, planner, history, capacity)
