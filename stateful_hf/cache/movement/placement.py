"""Placement: where chunks go down when a tier needs room, chosen by the eviction policy.

Making room in a tier moves its lowest-value idle chunks one tier down: device -> host -> disk ->
dropped (an absent tier is skipped). With hidden states in use, device chunks whose hidden states
were captured go down to HIDDEN instead of HOST, hidden chunks go to the disk tier's hidden file
(DISK_HIDDEN) if there is one, and from there (or without one) are dropped. After a turn,
Pensieve's ahead-of-time swap-out copies idle device chunks to the host and keeps their blocks as
`shadow`s, reclaimed without a copy when blocks are needed.

Owns: the eviction policy (`policy`, replaceable) and the reason of the moves under way (`moving`).
What moves down is chosen in one place, `victims` (by the policy's key), for making room and for the
ahead-of-time swap-out alike; copies are issued through the transfer engine, one method per kind.
Collaborators: the session table (read: idle sessions), the pools (`tier_pools.py`: allocation and
release), the transfer engine (copies), the disk state (durability before a chunk counts as on
disk; `feature.NoDisk` without a disk tier), the hidden tier (capture; `feature.NoHiddenStates` when
the store captures nothing), the move ledger and the counters (written: swapped_out_*, dropped). A
disk or hidden state as source or target implies that feature is on.
Mutates: chunks of idle sessions outside `exclude` (state, loc, shadow) and the slots of the pools.
Invariant kept: a chunk's KV lives in exactly one place (plus, for HOST/HIDDEN chunks, an optional
device `shadow`). Every method runs with the store lock held.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..audit.stats import Counters
from ..errors import CapacityError, StoreError
from ..eviction.fair_walk import fair_victims, tier_victims
from ..eviction.policy import EvictionPolicy, FairSharePolicy
from ..pools.tier_pools import TierPools
from ..sessions.session import ON_DISK, SHADOWED, Chunk, ChunkState, Session, SessionTable
from .moves import REASONS, MoveBatch, MoveLedger
from .transfer import Transfer

if TYPE_CHECKING:
    from ..disk.state import DiskState
    from ..feature import NoDisk, NoHiddenStates
    from ..hidden.tier import HiddenTier

DEVICE, HOST, DROPPED = ChunkState.DEVICE, ChunkState.HOST, ChunkState.DROPPED
HIDDEN, DISK, DISK_HIDDEN = ChunkState.HIDDEN, ChunkState.DISK, ChunkState.DISK_HIDDEN

Items = list[tuple[Session, int]]       # (session, chunk index) pairs


class Placement:
    def __init__(self, sessions: SessionTable, tiers: TierPools, transfer: Transfer, disk_state: DiskState | NoDisk,
                 hidden: HiddenTier | NoHiddenStates, policy: EvictionPolicy, moves: MoveLedger, counters: Counters,
                 swap_out_threshold: float):
        self.sessions, self.tiers, self.transfer, self.disk_state = sessions, tiers, transfer, disk_state
        self.hidden, self.policy, self.moves, self.counters = hidden, policy, moves, counters
        self.swap_out_threshold = swap_out_threshold
        self.block_size = tiers.device.spec.block_size
        self._reason = "explicit"

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: EvictionPolicy) -> None:
        self._policy = policy
        self.sessions.regroup(isinstance(policy, FairSharePolicy))    # its walks are per tenant

    # ---- accounting ------------------------------------------------------------------------------

    @contextmanager
    def moving(self, reason: str):
        """Moves inside are recorded with `reason` (the innermost wins: room made during a step is "pressure")."""
        if reason not in REASONS:
            raise ValueError(f"unknown move reason {reason!r}; choose from {REASONS}")
        prev, self._reason = self._reason, reason
        try:
            yield
        finally:
            self._reason = prev

    def record(self, src: ChunkState, dst: ChunkState, items: Items, t0: float, landed: bool = True) -> None:
        """Account one move batch (items: the chunks moved, in any state now); t0: perf_counter at its start;
        `landed`: its copy had landed by now (`MoveBatch.landed`)."""
        if not items:
            return
        for s, k in items:                     # their tokens per tier change: a shared chunk's once, for all holders
            c = s.chunks[k]
            if c.entry is None:
                self.sessions.recount(s.session_id)
            else:
                self.sessions.recount_chunk(c)
        pool = None if dst is DROPPED else self.tiers.pool(dst)
        per_slot = 0 if pool is None else pool.bytes_per_slot
        per_session: dict[str, int] = {}
        bs = self.block_size
        for s, k in items:
            per_session[s.session_id] = per_session.get(s.session_id, 0) + s.chunk_len(k, bs)
        self.moves.record(MoveBatch(src.value, dst.value, self._reason, len(items), sum(per_session.values()),
                                    per_slot * len(items), time.perf_counter() - t0, tuple(per_session.items()),
                                    landed))

    def copy_on_write(self, s: Session, k: int, kept: int) -> bool:
        """Chunk k of `s`, shared with other sessions, becomes a private copy in a new device block, so
        that a cut inside it keeps its kept tokens' KV (a shared chunk is immutable: `s` lets go of it, the
        others keep it); `kept`: its tokens the cut keeps (counted). Its captured hidden states are copied
        too. False, and nothing changes, unless
        it is a DEVICE chunk with no rebuild in flight and the (paged) device pool has a free block now."""
        c, pool = s.chunks[k], self.tiers.device
        if c.state is not DEVICE or c.source is not None or c.entry is None or pool.virtual or pool.num_free < 1:
            return False
        old, [block] = c.loc, pool.allocate(1)
        self.transfer.duplicate(pool, old, block)
        self.hidden.copy_block(old, block)
        self.tiers.release(s, k)                   # the others keep the shared chunk and its block
        s.chunks[k] = Chunk(DEVICE, block)
        self.sessions.mark(s.session_id)
        self.counters.copied_on_write += kept
        return True

    def drop(self, s: Session, k: int) -> None:
        """Chunk k of `s` keeps only its token ids (recomputed when needed). Counts `dropped`."""
        self.counters.dropped += s.chunk_len(k, self.block_size)
        self.tiers.release(s, k)

    def prove(self, s: Session, ks=None) -> int:
        """Prove the session's disk chunks (of `ks`, default all) before they are read; drop those
        that fail (their token ids stay: recomputed; a shared one leaves the prefix index and `s`
        lets go of it, its other holders fail it in turn). Returns the tokens dropped."""
        lost = 0
        for k in self.disk_state.failed(s, ks):
            lost += s.chunk_len(k, self.block_size)
            self.tiers.sharing.withdraw(s, k)     # no session adopts it; other holders prove it themselves
            self.drop(s, k)
        return lost

    # ---- making room ---------------------------------------------------------------------------

    def _ranking(self, now: float | None = None, ranked=None, policy: EvictionPolicy | None = None):
        """The key of (session, chunk) of `policy` (None: the store's) for one ranking at `now` (None: the
        clock's), smaller first (the policy is prepared with every session first, and `ranked`: the sessions
        holding every chunk of the state ranked). The one place `policy.key` is asked."""
        now, bs, policy = self.sessions.clock() if now is None else now, self.block_size, policy or self.policy
        if isinstance(policy, FairSharePolicy):
            policy.prepare(self.sessions, now, ranked)
        else:
            policy.prepare(self.sessions, now)
        return lambda s, k: policy.key(s, k, bs, now)

    def victims(self, state: ChunkState, n: int, exclude: set[str], shadowed: bool | None = None,
                scan: bool = False) -> Items:
        """The n lowest-value chunks (fewer if there are fewer) in `state` of idle sessions outside
        `exclude`, lowest first: (session, chunk) pairs, one per physical chunk; `shadowed` True /
        False: only chunks with / without a device shadow. A shared chunk is a victim only if every
        holder is idle and outside `exclude`, ranked by its most valuable holder (`prefix/sharing.py`:
        its value counts every holder). Every choice of what moves down is made here. In every tier, a
        policy with a floor (`by_session`) walks the tier's holders best first (`tier_index.TierOrder`;
        the fair share among tenants over one: a walk per tenant, `fair_walk.py`), another ranks every
        chunk of them; shadows rank those of the sessions holding them (the fair share: with one tenant by
        its inner policy, whose order it is; with several by its walk per tenant of the tier); `scan` (the tests'
        oracle) ranks every chunk of every session. Reads only."""
        sharing = self.tiers.sharing
        if scan:
            return self._scan(self._chunks(self.sessions), state, n, exclude, shadowed)
        if shadowed:     # cached on the device: chunks holding device blocks, not the idle ones below
            if self.tiers.pool(state) is None:      # no such tier (no host tier: no shadows): read no session
                return []
            fair, policy = isinstance(self.policy, FairSharePolicy), None
            if fair and self.sessions.tenants > 1:      # several tenants: the fair share's walk per tenant of
                inner = self.policy.inner.by_session(1) if self.sessions.tiers.per_tenant else None   # the tier,
                if inner is not None:                   # its shadowed chunks taken
                    now = self.sessions.clock()
                    inner.prepare(self.sessions, now)
                    return fair_victims(self.sessions, sharing, self.policy, inner, state, n, exclude, shadowed,
                                        now, self.block_size)
            elif fair:                        # one tenant: the fair order is the inner policy's
                policy = self.policy.inner
            found = [(min(sharing.holders(s, k), key=lambda h: h.seq), k) for s, k in self.sessions.shadow_chunks()
                     if s.chunks[k].state is state]
            found.sort(key=lambda sk: (sk[0].seq, sk[1]))      # named and ordered as a scan of the table would
            return self._scan(found, state, n, exclude, shadowed, policy=policy)   # (else every session's usage)
        walker, now = self.policy.by_session(self.sessions.tenants), self.sessions.clock()
        inner = self.policy.inner.by_session(1) if isinstance(self.policy, FairSharePolicy) \
            and self.sessions.tiers.per_tenant else None
        if walker is not None or inner is not None:
            (walker or inner).prepare(self.sessions, now)
        if walker is None and inner is not None:        # fair share among tenants: one walk per tenant
            return fair_victims(self.sessions, self.tiers.sharing, self.policy, inner, state, n, exclude, shadowed,
                                now, self.block_size)
        if walker is None:
            listed = [s for s, _ in self.sessions.holding(state, now)]
            return self._scan(self._chunks(listed), state, n, exclude, shadowed, now, listed)
        return tier_victims(self.sessions, self.tiers.sharing, walker, state, n, exclude, shadowed, now,
                            self.block_size)

    @staticmethod
    def _chunks(sessions) -> Items:
        return [(s, k) for s in sessions for k in range(len(s.chunks))]

    def _scan(self, items: Items, state: ChunkState, n: int, exclude: set[str], shadowed: bool | None,
              now: float | None = None, ranked=None, policy: EvictionPolicy | None = None) -> Items:
        """`victims` by ranking every one of `items` in `state` (at `now`: the clock's; `ranked`: the sessions
        whose chunks the fair share counts, None: every session's; `policy`: None, the store's)."""
        sharing = self.tiers.sharing
        key = self._ranking(now, ranked, policy)
        found = sharing.unique((s, k) for s, k in items if not s.busy and s.session_id not in exclude
                               and (c := s.chunks[k]).state is state
                               and (shadowed is None or (c.shadow is not None) == shadowed)
                               and sharing.free_to_move(c, exclude))
        found.sort(key=lambda sk: max(key(h, sk[1]) for h in sharing.holders(*sk)))
        return found[:max(n, 0)]

    def take(self, state: ChunkState, n: int, exclude: set[str],
             owners: list[tuple[str, int]] | None = None) -> list[int]:
        """Allocate n slots of a tier, first making room by moving its lowest-value chunks down.
        `owners` ((session id, chunk) per slot) places device blocks in a virtual layout's slots."""
        pool = self.tiers.pool(state)
        if pool.virtual:
            with self.moving("slots"):
                self._free_slots(pool.slots_needed(owners), exclude)
        if n > pool.num_free and state in ON_DISK and pool.limbo:
            self.disk_state.sync(force=True)      # freed disk slots are reusable once the index forgets them
        if n > pool.num_free and state is DISK and len(self.disk_state.copies):
            self.disk_state.copies.release(n - pool.num_free)    # copies written behind are redundant: first out
            self.disk_state.sync(force=True)
        if n > pool.num_free:
            self.make_room(state, n - pool.num_free, exclude)
            if n > pool.num_free and state in ON_DISK:
                self.disk_state.sync(force=True)
        if n > pool.num_free:
            raise CapacityError(f"{state.value} tier: {n} blocks needed, {pool.num_free} free and no more "
                                "can be freed from idle sessions (the others are busy)")
        return pool.allocate(n, owners)

    def _free_slots(self, needed: int, exclude: set[str]) -> None:
        """Virtual layout: while fewer slots are free than `needed`, the idle session of lowest value
        holding a slot leaves the device (its chunks move down, its cached shadows are dropped)."""
        pool, key = self.tiers.device, self._ranking()
        while pool.free_slots < needed:
            holders = [s for s in self.sessions if not s.busy and s.session_id not in exclude
                       and pool.slot_of(s.session_id) is not None]
            if not holders:
                raise CapacityError(f"all {pool.num_slots} device slots are held by busy sessions; "
                                    "raise device_capacity or lower max_context")
            victim = min(holders, key=lambda s: min(key(s, k) for k in range(max(len(s.chunks), 1))))
            self.move_down([(victim, k) for k, c in enumerate(victim.chunks) if c.state is DEVICE], DEVICE, exclude)
            self.drop_shadows(victim)

    def drop_shadows(self, s: Session) -> int:
        """Free the device shadows of the session's HOST/HIDDEN chunks; returns how many."""
        n = 0
        for c in s.chunks:
            if c.shadow is not None:
                self.tiers.device.free([c.shadow])
                c.shadow = None
                n += 1
        return n

    def make_room(self, state: ChunkState, n: int, exclude: set[str]) -> None:
        """Free n slots of tier `state` by moving idle chunks outside `exclude` down (policy order)."""
        with self.moving("pressure"):
            if state is DEVICE:
                shadowed = (self.victims(HOST, n, exclude, shadowed=True)
                            + self.victims(HIDDEN, n, exclude, shadowed=True))
                for s, k in shadowed[:n]:   # lazy reclamation: no copy
                    self.tiers.device.free([s.chunks[k].shadow])
                    s.chunks[k].shadow = None
                    n -= 1
                if n > 0:
                    self.move_down(self.victims(DEVICE, n, exclude), DEVICE, exclude)
            elif state in SHADOWED:
                for s, k in self.victims(state, n, exclude, shadowed=True):   # still on device: revert
                    c = s.chunks[k]
                    self.tiers.pool(state).free([c.loc])
                    c.assign(DEVICE, c.shadow)
                    self.sessions.mark_moved([(s, k)])     # listed again among the device's holders, recounted
                    n -= 1
                if n > 0:
                    self.move_down(self.victims(state, n, exclude, shadowed=False), state, exclude)
            elif state in ON_DISK:
                self.move_down(self.victims(state, n, exclude), state, exclude)

    # ---- moving down ---------------------------------------------------------------------------

    def move_down(self, items: Items, state: ChunkState, exclude: set[str], target: ChunkState | None = None,
                  strict: bool = False) -> None:
        """Move chunks in `state` down to `target` (default: the next present tier). When the target
        has no room they are dropped instead, or, if `strict`, CapacityError is raised unchanged.
        A shared chunk moves once, in place, for every holder (to disk too: one slot, a row of each
        holder in the disk index); dropped, it is first made private to the session in `items`
        (`PrefixSharing.unshare`): every holder recomputes it."""
        items = self.tiers.sharing.unique(items)
        if not items:
            return
        if target is None and state is DEVICE:    # the policy keeps hidden states (captured blocks)
            captured = self.hidden.captured
            if hid := [(s, k) for s, k in items if captured(s.chunks[k].loc)]:
                items = [(s, k) for s, k in items if not captured(s.chunks[k].loc)]
                self.move_down(hid, DEVICE, exclude | {s.session_id for s, _ in items}, target=HIDDEN)
                if not items:
                    return
        target = target or self.tiers.below(state)
        exclude = exclude | {s.session_id for s, _ in items}
        if target is DISK and (copied := self.disk_state.copied(items)):   # already on disk behind: no write
            self._onto_copies(copied, state)
            done = {(id(s), k) for s, k in copied}
            items = [(s, k) for s, k in items if (id(s), k) not in done]
            if not items:
                return
        if target in ON_DISK and not self.disk_state.usable(strict):
            target = DROPPED
        if target is not DROPPED:
            try:
                slots = self.take(target, len(items), exclude)
            except CapacityError:
                if strict:
                    raise
                target, slots = DROPPED, []
        t0 = time.perf_counter()
        if target is DROPPED:                  # a shared chunk is never dropped shared: one holder drops it
            holders = self.disk_state.row_holders(items, self.tiers.sharing)
            items = self.tiers.sharing.unshare(items)
            for s, k in items:
                self.drop(s, k)
            self.record(state, DROPPED, items, t0)
            for sid in holders:                # the other holders' chunks are DROPPED too: their disk rows change
                self.sessions.mark(sid)
            return
        src = [s.chunks[k].loc for s, k in items]
        if target is HIDDEN:
            self.hidden.check_source(items, state)
            self.transfer.store_hidden(self.hidden.capture, self.tiers.device, src, self.hidden.pool, slots)
        elif target is DISK_HIDDEN:   # from HIDDEN: same split, a copy of slots
            self.transfer.copy_hidden(self.tiers.hidden, src, self.tiers.disk_hidden, slots)
        else:
            self.transfer.copy(self.tiers.pool(state), src, self.tiers.pool(target), slots)
        if target in ON_DISK and not self.disk_state.written(items, target, slots):   # not durable: not on disk
            if strict:
                raise StoreError(f"the disk tier {str(self.tiers.disk.dir)!r} could not flush its data file; nothing "
                                 "was moved and the tier is degraded")
            self.move_down(items, state, exclude, target=DROPPED)
            return
        self.record(state, target, items, t0)
        for (s, k), slot in zip(items, slots):
            self.tiers.vacate(s.chunks[k])
            s.chunks[k].assign(target, slot)
            self._count_out(target, s.chunk_len(k, self.block_size))
        self.sessions.mark_moved(items)         # in place: for every holder (the disk index's too)

    def _onto_copies(self, items: Items, state: ChunkState) -> None:
        """Chunks in `state` with a valid disk copy (`disk/copies.py`) become DISK chunks on their copy's slot:
        their place above is freed, nothing is written (the index row is the copy's already)."""
        t0 = time.perf_counter()
        for s, k in items:
            c = s.chunks[k]
            slot = self.disk_state.copies.take(c)
            self.tiers.vacate(c)
            c.assign(DISK, slot)
            self._count_out(DISK, s.chunk_len(k, self.block_size))
        self.record(state, DISK, items, t0)
        self.sessions.mark_moved(items)

    def _count_out(self, target: ChunkState, n: int) -> None:
        if target is HIDDEN:
            self.counters.swapped_out_hidden += n
        elif target is HOST:
            self.counters.swapped_out_host += n
        else:
            self.counters.swapped_out_disk += n

    def swap_out_ahead(self) -> None:
        """Pensieve's ahead-of-time swap-out: while fewer than `swap_out_threshold` of device blocks
        are free or reclaimable, copy the lowest-value idle device chunks to the host (or, captured,
        to the hidden pool) and keep their blocks as shadows."""
        pool = self.tiers.device
        if (self.tiers.host is None and self.tiers.hidden is None) or self.transfer.swap_in_pending() \
                or pool.virtual:   # a virtual layout frees slots on demand instead
            return
        floor = math.ceil(self.swap_out_threshold * pool.num_blocks)
        if pool.num_free >= floor:
            return
        shadows = len(self.sessions.shadow_chunks())
        want = floor - pool.num_free - shadows
        if want <= 0:
            return
        with self.moving("ahead"):
            items = self.victims(DEVICE, want, set())
            captured = [self.hidden.captured(s.chunks[k].loc) for s, k in items]
            hid = [sk for sk, cap in zip(items, captured) if cap]
            kv = [sk for sk, cap in zip(items, captured) if not cap]
            for group, target in ((hid, HIDDEN), (kv, HOST)):
                if not group or self.tiers.pool(target) is None:
                    continue
                try:
                    slots = self.take(target, len(group), {s.session_id for s, _ in items})
                except CapacityError:
                    continue
                blocks = [s.chunks[k].loc for s, k in group]
                t0 = time.perf_counter()
                if target is HIDDEN:
                    self.transfer.store_hidden(self.hidden.capture, pool, blocks, self.hidden.pool, slots)
                else:
                    self.transfer.copy(pool, blocks, self.tiers.host, slots)
                self.record(DEVICE, target, group, t0)
                for (s, k), slot in zip(group, slots):
                    s.chunks[k].assign(target, slot, shadow=s.chunks[k].loc)
                    self._count_out(target, s.chunk_len(k, self.block_size))
                self.sessions.mark_moved(group)
