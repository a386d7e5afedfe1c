"""The KV store: the facade over the store's parts; the one place session KV state changes.

Contract: every public method takes the store lock; chunk states, slot ownership and token ids
change only inside it, through the parts. A method that raises leaves every session's token ids as
they were and the invariants of `check_integrity()` intact: every slot of every tier is free or
owned by exactly one chunk (device blocks: by a DEVICE chunk, as the cached `shadow` of one
HOST/HIDDEN chunk, or split by residue among LAYERED chunks).

The parts (docs/store.md), each built here with its collaborators, in this order:
    SessionTable   sessions by id, the lock, leases               session_table.py
    PrefixSharing  shared full chunks of identical prefixes        prefix_sharing.py
    HiddenTier     hidden pools and capture (HCache)               hidden_tier.py
    DiskState      the disk index: stale?, proofs, sync            disk_state.py
    TierPools      pool per chunk state, below(), release()        tier_pools.py
    Placement      moving down, making room, the policy            placement.py
    SwapIn         moving up, settling hidden rebuilds             swap_in.py
    LayeredChunks  LayerKV's LAYERED chunks and residue blocks     layered_chunks.py
    Relocation     `move`: chosen chunks to a named tier           relocation.py
    StepPlanner    plan/commit/abort, needs, last_turn             step_planner.py
plus the transfer engine (transfer.py), integrity.py and store_stats.py (read-only).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

from ..kernels import KernelState
from .disk import DiskTier
from .disk_file import identity_tags
from .disk_state import DiskState
from .errors import SessionBusyError, StoreError
from .hidden_states import HiddenSpec, Projector
from .hidden_tier import HiddenTier
from .integrity import check_integrity
from .layered_chunks import LayeredChunks
from .moves import MoveLedger
from .placement import Placement
from .policy import DEFAULT_POLICY, EvictionPolicy, make_policy
from .pool import BlockPool
from .prefix_sharing import PrefixSharing
from .relocation import Relocation, chunk_indices, target_state
from .residue_blocks import ResidueTable, blocks_at_most
from .session import ON_DISK, ChunkState, Session, TurnStats
from .session_table import SessionTable
from .spec import KVSpec
from .stats import Counters, SessionStats, StoreStats, summary
from .step import StepBatch
from .step_planner import ChunkNeeds, StepPlanner
from .store_stats import session_stats, store_stats
from .swap_in import SwapIn
from .tenant import TenantUsage, tenant_of
from .tier_pools import TierPools, open_pools
from .transfer import Transfer, emulate_from_env
from .virtual import PageMapper

DEVICE, HOST, HIDDEN, DISK = ChunkState.DEVICE, ChunkState.HOST, ChunkState.HIDDEN, ChunkState.DISK
DISK_HIDDEN, DROPPED = ChunkState.DISK_HIDDEN, ChunkState.DROPPED


class KVStore:
    """device_capacity / host_capacity / disk_capacity: tokens (int) or sizes ("2GiB"); a host or
    disk tier exists only when given (the disk tier also needs `disk_dir`). `swap_out_threshold`:
    share of device blocks kept free or reclaimable by ahead-of-time swap-out after each turn.
    hidden_states ("auto" | "always" | "never"), hidden_spec, hidden_capacity (default: host_capacity),
    hidden_disk_capacity (the disk tier's hidden file; default: disk_capacity) and project (hidden ->
    K/V per layer): HCache's hidden-state tier, see `hidden_tier.py`.
    Virtual layout only: `keep_freed` (tokens or a size) of freed device pages stay committed for
    reuse (vAttention's deferred reclamation; `reclaim()` gives them back), and with `map_ahead` a
    background thread maps the block each stepping session grows into next.
    `clock`: seconds for sessions' last activity, which the policy's idle time T is measured with
    (default time.monotonic; a virtual clock makes eviction order reproducible in replays).
    `policy`: default `DEFAULT_POLICY` (policy.py) over a default Cost profile. It is told each
    returning session's idle gap when a lease starts, and sees all sessions before each ranking
    (`observe_return`, `prepare`).
    layerwise_kv: LayerKV's layer-wise allocation (`layered_chunks.py`): steps may fill chunks keeping only
    some layers on the device (residue blocks) and the rest on the host; needs a host tier, the paged
    layout and the torch backend.
    disk_fingerprint: identifies the model whose KV the disk tier holds (its config and weights); a
    disk_dir made with another is refused. The disk tier serves a chunk only if it proves it is the
    chunk it names, else recomputes it (`disk.py`).
    emulate_async: run copies under the CPU async emulator (`transfer.py`); default: the environment
    variable STATEFUL_HF_EMULATE_ASYNC=1.
    prefix_sharing: full chunks of identical prefixes held once (`prefix_sharing.py`); None: on where
    it can be (paged layout, no layerwise_kv)."""

    def __init__(self, spec: KVSpec, device_capacity: int | str = 4096, *, host_capacity: int | str | None = None,
                 disk_dir: str | os.PathLike | None = None, disk_capacity: int | str | None = None,
                 policy: EvictionPolicy | None = None, attn_backend: str = "torch",
                 swap_out_threshold: float = 0.25, hidden_states: str = "never",
                 hidden_spec: HiddenSpec | None = None, hidden_capacity: int | str | None = None,
                 project: Projector | None = None, layout: str = "paged", max_context: int | None = None,
                 clock: Callable[[], float] = time.monotonic, keep_freed: int | str = "64MiB",
                 map_ahead: bool = True, hidden_disk_capacity: int | str | None = None,
                 layerwise_kv: bool = False, disk_fingerprint: str = "", emulate_async: bool | None = None,
                 prefix_sharing: bool | None = None):
        if not 0 <= swap_out_threshold < 1:
            raise ValueError(f"swap_out_threshold must be in [0, 1), got {swap_out_threshold}")
        if disk_capacity is not None and disk_dir is None:
            raise ValueError("disk_capacity needs a disk_dir")
        if layout not in ("paged", "virtual"):
            raise ValueError(f"unknown layout {layout!r}; choose 'paged' or 'virtual'")
        if layout == "virtual" and max_context is None:
            raise ValueError("layout='virtual' needs max_context (tokens per session slot)")
        if prefix_sharing and (layout != "paged" or layerwise_kv):
            raise ValueError("prefix_sharing needs layout='paged' and no layerwise_kv (a virtual layout keeps each "
                             "session's KV in its own slot; layer-wise KV splits blocks among sessions)")
        self.spec, self.block_size, self.layout, self.attn_backend = spec, spec.block_size, layout, attn_backend
        device_pool, host_pool, disk = open_pools(spec, device_capacity, host_capacity, disk_dir, disk_capacity,
                                                  layout, max_context, keep_freed, disk_fingerprint)
        self.kernels = KernelState()        # one FlashInfer workspace + wrapper per store, planned per step
        self.transfer = Transfer(device_pool, emulate_from_env() if emulate_async is None else emulate_async)
        self.counters = Counters()          # written by placement, swap-in, the planner and hidden restores
        self.moves = MoveLedger()           # chunk moves between tiers (moves.py)
        self.sessions = SessionTable(clock)
        self._lock = self.lock = self.sessions.lock
        self.sharing = PrefixSharing(spec.block_size, self.sessions.find,
                                     prefix_sharing is not False and layout == "paged" and not layerwise_kv)
        try:
            self.hidden = HiddenTier(hidden_states, hidden_spec, project, spec, device_pool.num_blocks,
                                     hidden_capacity, host_capacity, disk,
                                     hidden_disk_capacity if hidden_disk_capacity is not None else disk_capacity)
            self.disk_state = DiskState(self.sessions, disk, self.transfer, spec.block_size)
            self.tiers = TierPools(device_pool, host_pool, disk, self.hidden.pool, self.hidden.disk_pool,
                                   self.disk_state, self.sharing)
            for pool in (device_pool, host_pool, disk.pool if disk is not None else None):
                if pool is not None:
                    pool.transfer = self.transfer
            self.placement = Placement(self.sessions, self.tiers, self.transfer, self.disk_state, self.hidden,
                                       policy or make_policy(DEFAULT_POLICY), self.moves, self.counters,
                                       swap_out_threshold)
            self.swap_in = SwapIn(self.sessions, self.tiers, self.placement, self.transfer, self.hidden,
                                  self.disk_state, self.counters)
            self.layered = LayeredChunks(layerwise_kv, self.tiers, self.placement, self.transfer, self.counters,
                                         layout=layout, attn_backend=attn_backend,
                                         capturing=self.hidden.capture is not None)
            self.relocation = Relocation(self.tiers, self.placement, self.swap_in, self.hidden, self.layered,
                                         self.transfer)
            self.planner = StepPlanner(self.sessions, self.tiers, self.placement, self.swap_in, self.hidden,
                                       self.layered, self.transfer, self.counters, self.kernels, layout=layout,
                                       attn_backend=attn_backend,
                                       page_mapper=PageMapper(device_pool) if layout == "virtual" and map_ahead
                                       else None)
        except BaseException:
            if disk is not None:
                disk.close()
            raise
        if disk is not None:
            self.disk_state.load(self.sharing)

    # ---- the parts' objects, for callers that read them ------------------------------------------

    @property
    def device_pool(self):
        return self.tiers.device

    @property
    def host_pool(self) -> BlockPool | None:
        return self.tiers.host

    @property
    def disk(self) -> DiskTier | None:
        return self.tiers.disk

    @property
    def hidden_pool(self):
        return self.tiers.hidden

    @property
    def disk_hidden_pool(self):
        return self.tiers.disk_hidden

    @property
    def capture(self):
        return self.hidden.capture

    @property
    def hidden_spec(self) -> HiddenSpec | None:
        return self.hidden.spec

    @property
    def project(self) -> Projector | None:
        return self.hidden.project

    @property
    def residues(self) -> ResidueTable:
        """LayerKV's residue blocks (read-only here; the pools own the table)."""
        return self.tiers.residues

    @property
    def page_mapper(self) -> PageMapper | None:
        return self.planner.page_mapper

    @property
    def layerwise(self) -> bool:
        return self.layered.enabled

    @property
    def layerwise_stage(self) -> bool | None:
        return self.layered.stage

    @layerwise_stage.setter
    def layerwise_stage(self, stage: bool | None) -> None:
        self.layered.stage = stage

    @property
    def policy(self) -> EvictionPolicy:
        return self.placement.policy

    @policy.setter
    def policy(self, policy: EvictionPolicy) -> None:
        with self.lock:
            self.placement.policy = policy

    @property
    def swap_out_threshold(self) -> float:
        return self.placement.swap_out_threshold

    @property
    def clock(self) -> Callable[[], float]:
        return self.sessions.clock

    @property
    def emulate_async(self) -> bool:
        """True when copies run under the CPU async emulator (transfer.py; STATEFUL_HF_EMULATE_ASYNC=1)."""
        return self.transfer.emulate

    # ---- sessions -------------------------------------------------------------------------------

    def session(self, session_id: str) -> Session:
        with self.lock:
            return self.sessions.get(session_id)

    def open(self, session_id: str) -> Session:
        """Return the session, creating an empty one if it does not exist."""
        with self.lock:
            return self.sessions.open(session_id)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.sessions

    def session_ids(self) -> list[str]:
        """Ids of the sessions (not of those deleted and retained for their shared prefix)."""
        with self.lock:
            return [s.session_id for s in self.sessions if not s.retained]

    def tenant_usage(self) -> dict[str, TenantUsage]:
        """Per tenant (`tenant.py`: the tenant is part of the session key): sessions, history tokens,
        and tokens whose KV is stored in some tier."""
        with self.lock:
            acc: dict[str, list[int]] = {}
            for s in self.sessions:
                if s.retained:                   # a retained prefix is a cache, not a session
                    continue
                a = acc.setdefault(tenant_of(s.session_id), [0, 0, 0])
                a[0] += 1
                a[1] += s.num_tokens
                a[2] += s.num_tokens - s.tokens_in(DROPPED, self.block_size)
            return {t: TenantUsage(*a) for t, a in acc.items()}

    def delete(self, session_id: str, keep_shared: bool = False) -> None:
        """Forget the session and free what only it holds. `keep_shared` (the engine's throwaway
        sessions): if it alone holds indexed chunks of a shared prefix, they stay in the store, held
        by the session, now `retained` (its id is no longer listed; it takes no turns), until the
        policy drops them, so that the next turn with that prefix reuses them (prefix_sharing.py)."""
        with self.lock:
            s = self.sessions.get(session_id)
            if s.busy:
                raise SessionBusyError(session_id)
            keep = self.sharing.retainable(s) if keep_shared else 0
            if keep:
                self.truncate(session_id, keep * self.block_size)
                s.retained = True
                return
            for k in range(len(s.chunks)):
                self.tiers.release(s, k)
            self.sessions.remove(session_id)
            self.disk_state.sync()

    def _collect_retained(self) -> None:
        """Retained sessions none of whose chunks can be found any more are deleted."""
        for s in [s for s in self.sessions if s.retained and not s.busy and not self.sharing.findable(s)]:
            self.delete(s.session_id)

    @contextmanager
    def lease(self, session_id: str) -> Iterator[Session]:
        """Mark the session busy for one turn; a second lease raises SessionBusyError. When the turn
        ends, chunks move down ahead of time if free device blocks fell under the threshold."""
        with self.lock:
            s, gap = self.sessions.acquire(session_id)
            if gap is not None:      # a conversation with history is back: the policy sees the gap
                self.placement.policy.observe_return(gap)
        try:
            yield s
        finally:
            with self.lock:
                self.sessions.release(s)
                self.layered.settle(s)
                self.placement.swap_out_ahead()
                self._collect_retained()
                self.disk_state.sync()

    # ---- turns ----------------------------------------------------------------------------------

    def begin_turn(self, session_id: str, prompt: Sequence[int], cache_salt: str | None = None) -> TurnStats:
        """A turn of the leased session starts with `prompt` (the whole conversation's ids): it
        adopts the shared chunks of the prompt's prefix (`adopt_prefix`, scoped by its tenant and
        `cache_salt`), its history is cut to the longest common prefix (at least one token short of
        the prompt, so the turn computes logits), its disk chunks are proven, and its `last_turn`
        restarts with what each tier holds for it (reused_device / swapped_in_host / swapped_in_disk /
        restored_hidden).
        Every step committed during the lease adds its rows (computed_tokens, recomputed_tokens);
        `add_generated` sets generated_tokens. The store is the one writer of last_turn."""
        with self.lock:
            if not self.sessions.get(session_id).busy:
                raise StoreError(f"begin_turn: session {session_id!r} is not leased (use store.lease first)")
            self.sharing.adopt(self.sessions.get(session_id), prompt, cache_salt, self.tiers.release)
            keep = min(self.match_prefix(session_id, prompt), len(prompt) - 1)
            truncated = self.truncate(session_id, max(keep, 0))
            s = self.sessions.get(session_id)
            self.placement.prove(s)         # disk chunks that fail count as dropped: recomputed
            turn = self.planner.begin_turn(s, truncated)
            self.disk_state.sync()
            return turn

    def add_generated(self, session_id: str, n: int) -> None:
        """The session's turn generated `n` tokens (its last_turn's generated_tokens)."""
        with self.lock:
            self.planner.add_generated(self.sessions.get(session_id), n)

    # ---- history --------------------------------------------------------------------------------

    def adopt_prefix(self, session_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Before a turn whose prompt is `token_ids` (the engine's scheduler, to size the turn before
        its lease; `begin_turn` does it too): the idle session takes the indexed chunks of the longest
        shared prefix of the prompt (its tenant's and `cache_salt`'s, verified id by id, at least one
        token short of the prompt) in place of its dropped chunks and past its history, if its history
        is a prefix of the prompt. Returns the tokens it gained (`prefix_sharing.py`). ValueError: a
        `cache_salt` other than the one the session was opened with."""
        with self.lock:
            s = self.sessions.get(session_id)
            if s.busy:
                raise SessionBusyError(session_id)
            return self.sharing.adopt(s, token_ids, cache_salt, self.tiers.release)

    def match_prefix(self, session_id: str, token_ids: Sequence[int]) -> int:
        """Length of the longest common prefix of the session's history and `token_ids`."""
        s = self.session(session_id)
        n = 0
        for a, b in zip(s.token_ids, token_ids):
            if a != b:
                break
            n += 1
        return n

    def truncate(self, session_id: str, length: int) -> int:
        """Cut the session's history to its first `length` tokens; returns how many were cut."""
        if length < 0:
            raise ValueError(f"cannot truncate to {length} tokens")
        with self.lock:
            s, bs = self.sessions.get(session_id), self.block_size
            cut = max(len(s.token_ids) - length, 0)
            if cut:
                keep = -(-length // bs)
                for k in range(keep, len(s.chunks)):
                    self.tiers.release(s, k)
                del s.chunks[keep:]
                if length % bs and not self.sharing.privatize(s, keep - 1):
                    self.tiers.release(s, keep - 1)   # a shared chunk is immutable: its kept tokens are recomputed
                cut_inside = bool(s.chunks) and s.chunks[-1].state in ON_DISK and length % bs
                old_tag = identity_tags(s.token_ids[: keep * bs], bs)[-1] if cut_inside else None
                del s.token_ids[length:]
                # its checksum named the longer prefix: retag it, or drop it if it does not hold what it should
                if cut_inside and not self.disk_state.cut(s, keep - 1, old_tag):
                    self.placement.drop(s, keep - 1)
                self.disk_state.sync()
            return cut

    def missing_positions(self, session_id: str, cut: int | None = None) -> list[int]:
        """History positions whose KV is stored nowhere (DROPPED): a step must recompute them.
        Host and disk chunks are not missing: `plan_step` copies them up. `cut`: as they will be
        after `truncate(session_id, cut)` (positions < cut only): a cut inside a chunk other sessions
        share drops the session's copy of it (shared chunks are immutable), its kept positions too."""
        with self.lock:
            s, bs = self.sessions.get(session_id), self.block_size
            self.placement.prove(s)        # disk chunks that are not what they name are missing too
            out = [p for k, c in enumerate(s.chunks) if c.state is DROPPED for p in s.chunk_range(k, bs)]
            if cut is None:
                return out
            k = cut // bs
            if cut < s.num_tokens and cut % bs and s.chunks[k].state is not DROPPED \
                    and s.chunks[k].entry is not None and s.chunks[k].entry.holders != {session_id}:
                out = sorted(set(out) | set(range(k * bs, cut)))
            return [p for p in out if p < cut]

    def residency(self, session_id: str) -> dict[str, int]:
        """Tokens of the session per tier."""
        with self.lock:
            return self.sessions.get(session_id).residency(self.block_size)

    # ---- steps (step_planner.py) ----------------------------------------------------------------

    def plan_step(self, requests: Sequence[tuple[str, Sequence[int], Sequence[int]]],
                  factors: Sequence[int] | None = None) -> StepBatch:
        """Reserve device blocks for one forward step and describe it.

        `requests`: (session_id, token_ids, positions) per session, at most one per session. A
        position < the session's length recomputes that history token (its id must match); positions
        >= length append new tokens and must continue the history without gaps. Host and disk chunks
        of the context are copied up (layer by layer; on CUDA the step carries per-layer events);
        dropped chunks of the context must be among the rows. The new tokens join the session's
        history now; `commit` makes them permanent, `abort` takes them back.

        `factors` (layerwise_kv stores only; default 1 each): per entry, the keep factor of the chunks
        it fills: 1 all layers on the device, 0 none (host only), f >= 2 layers l % f == r in a
        residue block (`layered_chunks.py`). An entry with factor != 1 also reads its HOST context in place.
        """
        with self.lock:
            step = self.planner.plan(requests, factors)
            self.disk_state.sync()
            return step

    def commit(self, step: StepBatch) -> None:
        """Make a planned step permanent; a leased session's last_turn counts its rows."""
        with self.lock:
            self.planner.commit(step)

    def abort(self, step: StepBatch) -> None:
        """Undo `plan_step`: new tokens leave the history, chunks filled in the step are dropped again
        (chunks it copied up stay on the device: their KV is valid; chunks whose K/V was being
        rebuilt from hidden states stay on the device only if every layer was rebuilt)."""
        with self.lock:
            self.planner.abort(step)

    def chunk_needs(self, session_id: str, end: int, *, length: int | None = None, factor: int = 1) -> ChunkNeeds:
        """What a step of the session whose rows reach position `end` - 1 must do with each chunk
        below it, for the history cut to `length` tokens (default: as it is), its dropped chunks
        recomputed whole: `ChunkNeeds(fills, copies, in_place)` (chunk indices, `step_planner.py`)."""
        with self.lock:
            s = self.sessions.get(session_id)
            return self.planner.needs(s, end, s.num_tokens if length is None else length, factor)

    def blocks_needed(self, session_id: str, end: int, *, length: int | None = None, factor: int = 1) -> int:
        """Device blocks such a step takes at most (the engine scheduler's question): a block per
        chunk it fills or copies up at factor 1; at keep factor f != 1, ceil(fills / f) residue
        blocks (none at 0) plus the copies (HOST chunks are read in place)."""
        fills, copies, _ = self.chunk_needs(session_id, end, length=length, factor=factor)
        return blocks_at_most(factor, len(fills)) + len(copies)

    def residue_blocks_needed(self, factor: int, n_chunks: int) -> int:
        """Device blocks n_chunks new chunks of keep factor `factor` take now: n for 1, 0 for 0, about n / f else."""
        with self.lock:
            return self.layered.blocks_needed(factor, n_chunks)

    def offload_layers(self, session_id: str, full: bool = False) -> int:
        """LayerKV's push-down for a running request when projected free device blocks run short: its
        LAYERED chunks' kept layers go to their host slots (residues given back); with `full`, its
        DEVICE chunks too (their KV moves to host slots and later steps read it in place). Returns
        device blocks freed. A no-op on a store without layerwise_kv."""
        with self.lock:
            return self.layered.offload(self.sessions.get(session_id), full)

    # ---- movement -------------------------------------------------------------------------------

    def move(self, session_id: str, chunks: Iterable[int], tier: str, reason: str = "explicit") -> None:
        """Move chosen chunks of an idle session to `tier` ("device", "host", "hidden", "disk",
        "dropped"). An operator and test hook; making room moves other idle sessions' chunks down by
        the policy. Dropped chunks cannot move up (only their ids remain: the next turn recomputes
        them). Only device chunks whose hidden states were captured become "hidden"; hidden chunks
        move to the device (K/V rebuilt by projection), to "disk" (where they stay hidden states,
        DISK_HIDDEN, and come back with "hidden" or "device") or are dropped. `reason` labels the
        moves in `self.moves` (moves.REASONS)."""
        target = target_state(tier)
        chunks = chunk_indices(chunks)
        with self.lock, self.placement.moving(reason):
            self.relocation.move(self.sessions.get(session_id), chunks, target)
            self.disk_state.sync()

    def evict(self, session_id: str) -> int:
        """Move the session's device chunks one tier down (host if present, else dropped); returns
        the device blocks freed. Allowed on a busy session: the engine suspends a running request
        this way when decoding runs out of blocks, keeping the session's lease."""
        with self.lock, self.placement.moving("evict"):
            s = self.sessions.get(session_id)
            freed = self.layered.settle(s)           # layer-wise chunks: kept layers to the host
            items = [(s, k) for k, c in enumerate(s.chunks) if c.state is DEVICE     # not what others run on
                     and all(h is s or not h.busy for h in self.sharing.holders(s, k))]
            self.placement.move_down(items, DEVICE, {session_id})
            freed += self.placement.drop_shadows(s)  # cached shadows of host chunks go too
            self.disk_state.sync()
            return len(items) + freed

    def available_blocks(self) -> int:
        """Device blocks a step could get now: free, cached shadows of idle sessions, and device
        chunks of idle sessions (which `plan_step` moves down). Busy sessions' blocks do not count."""
        with self.lock:           # a shared chunk once, and only if none of its holders is busy
            idle = sum(1 for s, _, c in self.sharing.physical(self.sessions)
                       if (c.state is DEVICE or c.shadow is not None) and not s.busy
                       and self.sharing.free_to_move(c, set()))
            return self.tiers.device.num_free + idle

    def available_host_blocks(self) -> int:
        """Host slots a step could get now: free, plus idle sessions' host chunks (which move down to
        disk or are dropped to make room). 0 without a host tier."""
        if self.tiers.host is None:
            return 0
        with self.lock:
            idle = sum(1 for s, _, c in self.sharing.physical(self.sessions)
                       if c.state is HOST and not s.busy and self.sharing.free_to_move(c, set()))
            return self.tiers.host.num_free + idle

    def available_slots(self) -> int | None:
        """Virtual layout: device slots that busy sessions could still get, the free ones plus those
        held by idle sessions (which a step takes by moving them down). None for the paged layout,
        where only blocks count. Admitting a turn costs one: its session either claims a slot or
        keeps the one it holds out of reach."""
        if self.layout != "virtual":
            return None
        with self.lock:
            pool = self.tiers.device
            idle = sum(1 for s in self.sessions if not s.busy and pool.slot_of(s.session_id) is not None)
            return pool.free_slots + idle

    def reclaim(self) -> int:
        """Virtual layout: give back the committed pages of free device blocks now (they are kept for
        reuse up to `keep_freed` otherwise). Returns the bytes given back (0 for a paged pool)."""
        with self.lock:
            return self.tiers.device.reclaim() if self.layout == "virtual" else 0

    def maintain(self) -> None:
        """Run ahead-of-time swap-out now (it also runs whenever a lease ends)."""
        with self.lock:
            self.placement.swap_out_ahead()
            self._collect_retained()
            self.disk_state.sync()

    # ---- integrity and statistics ---------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless every slot of every tier is free or owned by exactly one chunk
        (`integrity.py` has the full list)."""
        with self.lock:
            check_integrity(self.sessions, self.tiers, self.block_size)   # slots, disk rows, shared chunks

    def stats(self, session_id: str | None = None) -> StoreStats | SessionStats:
        with self.lock:
            if session_id is not None:
                return session_stats(self.sessions.get(session_id), self.block_size)
            return store_stats(self.sessions, self.tiers, self.counters)

    def summary(self) -> str:
        """The store's tiers and traffic, for a person."""
        return summary(self.stats())

    def close(self) -> None:
        """Land every copy, write the disk index and release the disk tier's lock and mappings
        (device and host contents are lost)."""
        self.transfer.synchronize()
        self.planner.stop_mapping()
        with self.lock:
            if self.tiers.disk is not None:
                self.disk_state.sync(force=True)      # best effort: the last committed index stays true
                self.tiers.disk.close()
