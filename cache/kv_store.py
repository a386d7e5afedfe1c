"""The session store: owns the pools and the sessions; the one place session KV state changes.

Contract: every public method takes the store lock; chunk states, slot ownership and token ids
change only here. A method that raises leaves every session's token ids as they were and the
invariants of `check_integrity()` intact: every slot of every tier is free or owned by exactly one
chunk (device blocks: by a DEVICE chunk, or as the cached `shadow` of one HOST chunk).
"""

from __future__ import annotations

import operator
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

from ..kernels import KernelState
from .audit import AuditMixin
from .disk import DiskTier
from .disk_file import identity_tags
from .disk_state import DiskStateMixin
from .errors import SessionBusyError, StoreError, UnknownSessionError
from .hidden_states import HiddenSpec, Projector
from .hidden_tier import HiddenTierMixin
from .layerwise import LayerwiseMixin
from .moves import MoveLedger
from .planner import StepPlannerMixin
from .policy import DEFAULT_POLICY, EvictionPolicy, make_policy
from .pool import BlockPool
from .prefix_sharing import PrefixSharing
from .session import TIERS, ChunkState, Session
from .spec import KVSpec, capacity_in_blocks
from .stats import Counters
from .tenant import TenantUsage, tenant_of
from .tiering import DEVICE, DISK, DISK_HIDDEN, DROPPED, HIDDEN, HOST, ON_DISK, TieringMixin
from .transfer import Transfer, emulate_from_env
from .virtual import PageMapper, VirtualPool


@contextmanager
def _allocating(name: str, capacity, spec) -> Iterator[None]:
    """A pool allocation torch cannot make (out of memory) as a StoreError naming the option."""
    try:
        yield
    except RuntimeError as e:                 # torch.OutOfMemoryError is one too
        raise StoreError(f"cannot allocate the pool for {name}={capacity!r} on "
                         f"{'cpu' if name == 'host_capacity' else spec.device}: {e}; give a smaller {name}") from e


def _chunk_indices(chunks) -> list[int]:
    """`move`'s chunk argument: an iterable of int chunk indices (not bools, floats or strings)."""
    if isinstance(chunks, (str, bytes)) or not isinstance(chunks, Iterable):
        raise TypeError(f"chunks must be an iterable of chunk indices (ints), got {chunks!r}")
    out = []
    for k in chunks:
        try:
            if isinstance(k, bool):
                raise TypeError
            out.append(operator.index(k))       # ints, numpy / 0-d torch integers
        except TypeError:
            raise TypeError(f"chunk indices must be ints, got {k!r} ({type(k).__name__})") from None
    return out


class KVStore(StepPlannerMixin, AuditMixin, TieringMixin, HiddenTierMixin, LayerwiseMixin, DiskStateMixin):
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
    layerwise_kv: LayerKV's layer-wise allocation (`layerwise.py`): steps may fill chunks keeping only
    some layers on the device (shared blocks) and the rest on the host; needs a host tier, the paged
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
        self.spec = spec
        self.block_size = spec.block_size
        if layout not in ("paged", "virtual"):
            raise ValueError(f"unknown layout {layout!r}; choose 'paged' or 'virtual'")
        if prefix_sharing and (layout != "paged" or layerwise_kv):
            raise ValueError("prefix_sharing needs layout='paged' and no layerwise_kv (a virtual layout keeps each "
                             "session's KV in its own slot; layer-wise KV splits blocks among sessions)")
        if layout == "virtual" and max_context is None:
            raise ValueError("layout='virtual' needs max_context (tokens per session slot)")
        with _allocating("device_capacity", device_capacity, spec):
            if layout == "paged":
                self.device_pool = BlockPool(spec, capacity_in_blocks(device_capacity, spec))
            else:
                self.device_pool = VirtualPool(spec, capacity_in_blocks(device_capacity, spec), max_context,
                                               keep_bytes=0 if keep_freed in (0, "0") else
                                               capacity_in_blocks(keep_freed, spec) * spec.bytes_per_block)
        self.layout = layout
        self.page_mapper = PageMapper(self.device_pool) if layout == "virtual" and map_ahead else None
        with _allocating("host_capacity", host_capacity, spec):
            self.host_pool = None if host_capacity is None else BlockPool(
                spec, capacity_in_blocks(host_capacity, spec), "cpu", pin_memory=spec.device.type == "cuda")
        disk_blocks = capacity_in_blocks(disk_capacity if disk_capacity is not None else "1GiB", spec)
        self.disk = None if disk_dir is None else DiskTier(spec, disk_dir, disk_blocks, disk_fingerprint)
        self.policy = policy or make_policy(DEFAULT_POLICY)
        self.clock = clock
        self.attn_backend = attn_backend
        self.kernels = KernelState()        # one FlashInfer workspace + wrapper per store, planned per step
        self.swap_out_threshold = swap_out_threshold
        self.transfer = Transfer(self.device_pool, emulate_from_env() if emulate_async is None else emulate_async)
        for pool in (self.device_pool, self.host_pool, self.disk.pool if self.disk is not None else None):
            if pool is not None:
                pool.transfer = self.transfer
        self.counters = Counters()
        self.moves = MoveLedger()           # chunk moves between tiers (moves.py)
        self._move_reason = "explicit"
        self._sessions: dict[str, Session] = {}
        self.sharing = PrefixSharing(spec.block_size, self._sessions.get,
                                     prefix_sharing is not False and layout == "paged" and not layerwise_kv)
        self._lock = threading.RLock()
        self._disk_dirty = False
        try:
            self._init_hidden(hidden_states, hidden_spec, hidden_capacity, host_capacity, project,
                              hidden_disk_capacity if hidden_disk_capacity is not None else disk_capacity)
            self._init_layerwise(layerwise_kv)
        except BaseException:
            if self.disk is not None:
                self.disk.close()
            raise
        if self.disk is not None:
            self._load_disk_sessions()

    @property
    def emulate_async(self) -> bool:
        """True when copies run under the CPU async emulator (transfer.py; STATEFUL_HF_EMULATE_ASYNC=1)."""
        return self.transfer.emulate

    # ---- sessions -------------------------------------------------------------------------------

    def session(self, session_id: str) -> Session:
        with self._lock:
            try:
                return self._sessions[session_id]
            except KeyError:
                raise UnknownSessionError(session_id) from None

    def open(self, session_id: str) -> Session:
        """Return the session, creating an empty one if it does not exist."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session id must be a non-empty string, got {session_id!r}")
        with self._lock:
            if session_id not in self._sessions:
                self._sessions[session_id] = Session(session_id, last_active=self.clock())
            return self._sessions[session_id]

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def session_ids(self) -> list[str]:
        """Ids of the sessions (not of those deleted and retained for their shared prefix)."""
        with self._lock:
            return [sid for sid, s in self._sessions.items() if not s.retained]

    def tenant_usage(self) -> dict[str, TenantUsage]:
        """Per tenant (`tenant.py`: the tenant is part of the session key): sessions, history tokens,
        and tokens whose KV is stored in some tier."""
        with self._lock:
            acc: dict[str, list[int]] = {}
            for sid, s in self._sessions.items():
                if s.retained:                   # a retained prefix is a cache, not a session
                    continue
                a = acc.setdefault(tenant_of(sid), [0, 0, 0])
                a[0] += 1
                a[1] += s.num_tokens
                a[2] += s.num_tokens - s.tokens_in(DROPPED, self.block_size)
            return {t: TenantUsage(*a) for t, a in acc.items()}

    def delete(self, session_id: str, keep_shared: bool = False) -> None:
        """Forget the session and free what only it holds. `keep_shared` (the engine's throwaway
        sessions): if it alone holds indexed chunks of a shared prefix, they stay in the store, held
        by the session, now `retained` (its id is no longer listed; it takes no turns), until the
        policy drops them, so that the next turn with that prefix reuses them (prefix_sharing.py)."""
        with self._lock:
            s = self.session(session_id)
            if s.busy:
                raise SessionBusyError(session_id)
            keep = self.sharing.retainable(s) if keep_shared else 0
            if keep:
                self.truncate(session_id, keep * self.block_size)
                s.retained = True
                return
            for k in range(len(s.chunks)):
                self._release(s, k)
            del self._sessions[session_id]
            self._sync_disk()

    def _collect_retained(self) -> None:
        """Retained sessions none of whose chunks can be found any more are deleted."""
        for sid in [sid for sid, s in self._sessions.items() if s.retained and not s.busy
                    and not self.sharing.findable(s)]:
            self.delete(sid)

    @contextmanager
    def lease(self, session_id: str) -> Iterator[Session]:
        """Mark the session busy for one turn; a second lease raises SessionBusyError. When the turn
        ends, chunks move down ahead of time if free device blocks fell under the threshold."""
        with self._lock:
            s = self.session(session_id)
            if s.busy:
                raise SessionBusyError(session_id)
            if s.token_ids:          # a conversation with history is back: the policy sees the gap
                self.policy.observe_return(self.clock() - s.last_active)
            s.busy = s.turn_started = True
        try:
            yield s
        finally:
            with self._lock:
                s.busy = s.turn_started = False
                s.last_active = self.clock()
                self._settle_layered(s)
                self._swap_out_ahead()
                self._collect_retained()
                self._sync_disk()

    # ---- history --------------------------------------------------------------------------------

    def adopt_prefix(self, session_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Before a turn whose prompt is `token_ids`: the session takes the indexed chunks of the
        longest shared prefix of the prompt (its tenant's and `cache_salt`'s, verified id by id, at
        least one token short of the prompt) in place of its dropped chunks and past its history, if
        its history is a prefix of the prompt. Returns the tokens it gained (`prefix_sharing.py`)."""
        with self._lock:
            s = self.session(session_id)
            if s.busy and not s.turn_started:
                raise SessionBusyError(session_id)
            got = self.sharing.adopt(s, token_ids, cache_salt, self._release)
            s.last_active = self.clock()
            return got

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
        with self._lock:
            s = self.session(session_id)
            cut = max(len(s.token_ids) - length, 0)
            if cut:
                keep = -(-length // self.block_size)
                for k in range(keep, len(s.chunks)):
                    self._release(s, k)
                del s.chunks[keep:]
                if length % self.block_size and not self.sharing.privatize(s, keep - 1):
                    self._release(s, keep - 1)    # a shared chunk is immutable: its kept tokens are recomputed
                cut_inside = bool(s.chunks) and s.chunks[-1].state in ON_DISK and length % self.block_size
                old_tag = identity_tags(s.token_ids[: keep * self.block_size], self.block_size)[-1] \
                    if cut_inside else None
                del s.token_ids[length:]
                if cut_inside:       # its checksum named the longer prefix
                    self._disk_cut(s, keep - 1, old_tag)
                self._sync_disk()
            return cut

    def missing_positions(self, session_id: str, cut: int | None = None) -> list[int]:
        """History positions whose KV is stored nowhere (DROPPED): a step must recompute them.
        Host and disk chunks are not missing: `plan_step` copies them up. `cut`: as they will be
        after `truncate(session_id, cut)` (positions < cut only): a cut inside a chunk other sessions
        share drops the session's copy of it (shared chunks are immutable), its kept positions too."""
        with self._lock:
            s, bs = self.session(session_id), self.block_size
            self._verify_disk(s)        # disk chunks that are not what they name are missing too
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
        with self._lock:
            return self.session(session_id).residency(self.block_size)

    # ---- movement -------------------------------------------------------------------------------

    def move(self, session_id: str, chunks: Iterable[int], tier: str, reason: str = "explicit") -> None:
        """Move chosen chunks of an idle session to `tier` ("device", "host", "hidden", "disk",
        "dropped"). An operator and test hook; making room moves other idle sessions' chunks down by
        the policy. Dropped chunks cannot move up (only their ids remain: the next turn recomputes
        them). Only device chunks whose hidden states were captured become "hidden"; hidden chunks
        move to the device (K/V rebuilt by projection), to "disk" (where they stay hidden states,
        DISK_HIDDEN, and come back with "hidden" or "device") or are dropped. `reason` labels the
        moves in `self.moves` (moves.REASONS)."""
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; choose from {TIERS}")
        target = ChunkState(tier)
        chunks = _chunk_indices(chunks)
        with self._lock, self._moving(reason):
            s = self.session(session_id)
            if s.busy:
                raise SessionBusyError(session_id)
            self._settle_layered(s)
            ks = sorted(set(chunks))
            if any(not 0 <= k < len(s.chunks) for k in ks):
                raise IndexError(f"session {session_id!r} has chunks 0..{len(s.chunks) - 1}, got {ks}")
            for k in ks:                          # a shared chunk moves for every holder: none may be busy
                for h in self.sharing.holders(s, k):
                    if h.busy:
                        raise SessionBusyError(h.session_id)
            self._check_hidden_move(s, ks, target)
            if target is not DROPPED and self._pool(target) is None:
                raise ValueError(f"this store has no {tier} tier")
            order = list(ChunkState)
            reads = [k for k in ks if s.chunks[k].state in ON_DISK and
                     order.index(s.chunks[k].state) > order.index(target)]
            if self._verify_disk(s, reads):    # chunks that failed their checksum are dropped, not moved
                ks = [k for k in ks if k not in reads or s.chunks[k].state is not DROPPED]
            dest = {k: self._hidden_target(s.chunks[k].state, target) for k in ks}
            ks = [k for k in ks if s.chunks[k].state is not dest[k]]
            if target is not DROPPED and any(s.chunks[k].state is DROPPED for k in ks):
                raise ValueError(f"session {session_id!r}: dropped chunks keep only token ids and cannot move "
                                 f"to {tier}; the next turn recomputes them")
            up = [k for k in ks if order.index(s.chunks[k].state) > order.index(dest[k])]
            down = [k for k in ks if k not in up]
            excl = {session_id}
            groups = {state: [(s, k) for k in down if s.chunks[k].state is state]     # before any moves
                      for state in (DEVICE, HOST, HIDDEN, DISK, DISK_HIDDEN)}
            for state, items in groups.items():
                if items:
                    self._move_down(items, state, excl, target=dest[items[0][1]], strict=True)
            if up:
                restore = self._new_restore()
                self._move_up([(s, k) for k in up], target, excl, restore=restore)
                if restore is not None:
                    restore.finish(self.device_pool)
                    self._settle_restore(restore, ok=True)
                self.transfer.synchronize()
            self._sync_disk()

    def evict(self, session_id: str) -> int:
        """Move the session's device chunks one tier down (host if present, else dropped); returns
        the device blocks freed. Allowed on a busy session: the engine suspends a running request
        this way when decoding runs out of blocks, keeping the session's lease."""
        with self._lock, self._moving("evict"):
            s = self.session(session_id)
            freed = self._settle_layered(s)           # layer-wise chunks: kept layers to the host
            items = [(s, k) for k, c in enumerate(s.chunks) if c.state is DEVICE     # not what others run on
                     and all(h is s or not h.busy for h in self.sharing.holders(s, k))]
            self._move_down(items, DEVICE, {session_id})
            for k, c in enumerate(s.chunks):          # cached shadows of host chunks go too
                if c.shadow is not None:
                    self.device_pool.free([c.shadow])
                    c.shadow = None
                    items.append((s, k))
            self._sync_disk()
            return len(items) + freed

    def available_blocks(self) -> int:
        """Device blocks a step could get now: free, cached shadows of idle sessions, and device
        chunks of idle sessions (which `plan_step` moves down). Busy sessions' blocks do not count."""
        with self._lock:
            idle = sum(1 for s, _, c in self.sharing.physical(self._sessions.values())
                       if (c.state is DEVICE or c.shadow is not None) and not s.busy
                       and self.sharing.free_to_move(c, set()))
            return self.device_pool.num_free + idle

    def available_host_blocks(self) -> int:
        """Host slots a step could get now: free, plus idle sessions' host chunks (which move down to
        disk or are dropped to make room). 0 without a host tier."""
        if self.host_pool is None:
            return 0
        with self._lock:
            idle = sum(1 for s, _, c in self.sharing.physical(self._sessions.values())
                       if c.state is HOST and not s.busy and self.sharing.free_to_move(c, set()))
            return self.host_pool.num_free + idle

    def available_slots(self) -> int | None:
        """Virtual layout: device slots that busy sessions could still get, the free ones plus those
        held by idle sessions (which a step takes by moving them down). None for the paged layout,
        where only blocks count. Admitting a turn costs one: its session either claims a slot or
        keeps the one it holds out of reach."""
        if self.layout != "virtual":
            return None
        with self._lock:
            pool = self.device_pool
            idle = sum(1 for s in self._sessions.values() if not s.busy and pool.slot_of(s.session_id) is not None)
            return pool.free_slots + idle

    def reclaim(self) -> int:
        """Virtual layout: give back the committed pages of free device blocks now (they are kept for
        reuse up to `keep_freed` otherwise). Returns the bytes given back (0 for a paged pool)."""
        with self._lock:
            return self.device_pool.reclaim() if self.layout == "virtual" else 0

    def maintain(self) -> None:
        """Run ahead-of-time swap-out now (it also runs whenever a lease ends)."""
        with self._lock:
            self._swap_out_ahead()
            self._collect_retained()
            self._sync_disk()

    # ---- disk persistence (disk_state.py) ---------------------------------------------------------

    def close(self) -> None:
        """Land every copy, write the disk index and release the disk tier's lock (device and host
        contents are lost)."""
        self.transfer.synchronize()
        if self.page_mapper is not None:
            self.page_mapper.close()
            self.page_mapper = None
        with self._lock:
            if self.disk is not None:
                self._sync_disk(force=True)      # best effort: the last committed index stays true
                self.disk.close()
