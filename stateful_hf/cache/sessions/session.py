"""Sessions: a conversation's token ids and chunk table (`Session`, `Chunk`) and the table of every
session (`SessionTable`, with who holds what, ordered by `tier_index.TierOrder`, and tokens per tier and
tenant, `tier_index.TierUsage`); whose a session is lives in `tenant.py`.

Owns: the `{session id: Session}` map, the store's one re-entrant lock and the clock sessions'
activity is measured with. Mutates only the map (`open`, `add`, `remove`) and a session's lease
fields (`busy`, `turn_started`, `last_active` in `acquire`/`release`). A session's token ids and
chunks are changed by the other parts (`kv_store.py` lists who may change what), always with
`lock` held.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...kernels.blocks import blocks_for
from ..audit.stats import TurnStats
from ..errors import SessionBusyError, UnknownSessionError
from .expectations import Expectations
from .tenant import tenant_of

if TYPE_CHECKING:     # annotations only: the prefix package's modules import this one
    from ..prefix.index import PrefixEntry, PrefixScope


class ChunkState(enum.Enum):
    DEVICE = "device"    # KV in a block of the device pool
    LAYERED = "layered"  # KV per layer: a host slot, plus (maybe) a residue of a device block (LayerKV)
    HOST = "host"        # KV in a slot of the host pool (maybe still cached in a device block: `shadow`)
    HIDDEN = "hidden"    # per-layer hidden states (+ KV of the layers the plan keeps as KV) in the host hidden pool
    DISK = "disk"        # KV in a slot of the disk tier
    DISK_HIDDEN = "disk_hidden"   # a HIDDEN chunk's contents (same split) in a slot of the disk tier's hidden file
    DROPPED = "dropped"  # only the token ids remain; recomputed when needed


TIERS = ("device", "host", "hidden", "disk", "dropped")
SHADOWED = (ChunkState.HOST, ChunkState.HIDDEN)          # states whose chunks may keep a device shadow
ON_DISK = (ChunkState.DISK, ChunkState.DISK_HIDDEN)      # states whose slot is in the disk tier
HIDDEN_FORMS = (ChunkState.HIDDEN, ChunkState.DISK_HIDDEN)  # states holding hidden states (HCache)
# states whose holders `SessionTable.holding` walks in order (every chunk holding a device block: `device_chunks`)
INDEXED = (ChunkState.DEVICE, ChunkState.HOST, ChunkState.HIDDEN, ChunkState.DISK, ChunkState.DISK_HIDDEN)


@dataclass(slots=True)
class Chunk:
    """`block_size` consecutive tokens of a session; its KV lives in exactly one place.

    loc:    block of the device pool (DEVICE), slot of the host pool (HOST), of the hidden pool
            (HIDDEN), of the disk tier (DISK) or of its hidden file (DISK_HIDDEN); None when DROPPED.
    shadow: HOST / HIDDEN only: a device block still holding the same KV (Pensieve's lazy
            reclamation). A returning session takes it back without a copy; the store reclaims it
            when it needs blocks.
    source: DEVICE only, while a step is in flight: (HIDDEN or DISK_HIDDEN, slot), the hidden form
            this block's KV is being rebuilt from layer by layer. Freed when the step commits; on abort
            of an unfinished rebuild the chunk returns to that state at that slot.
    entry:  the prefix index entry of a shared chunk (`prefix/sharing.py`): then this one object is
            chunk k of every holder, full and immutable, and its state changes in place (`assign`)
            for all of them. None: private to one session.
    residue_block: LAYERED only: (device block, factor f >= 2, residue r < f) when layers l with
            l % f == r live in that device block (up to f chunks of distinct residues share one);
            every other layer lives in the host slot `loc`. None: every layer is in the host slot.
            Only a busy session (a running request) has LAYERED chunks: they become HOST when its
            turn ends (`layerwise/chunks.py`).
    """

    state: ChunkState = ChunkState.DROPPED
    loc: int | None = None
    shadow: int | None = None
    source: tuple[ChunkState, int] | None = None
    residue_block: tuple[int, int, int] | None = None
    entry: PrefixEntry | None = None

    def assign(self, state: ChunkState, loc: int | None = None, shadow: int | None = None,
               source: tuple[ChunkState, int] | None = None) -> None:
        """Change this chunk's place in place (for every holder of a shared chunk); `entry` is kept.
        The caller has freed what the old place held."""
        self.state, self.loc, self.shadow, self.source, self.residue_block = state, loc, shadow, source, None

    @property
    def holds_device(self) -> bool:
        """Whether it holds a device block: DEVICE, a LAYERED chunk's residue, or a cached shadow."""
        return self.state is ChunkState.DEVICE or self.shadow is not None or self.residue_block is not None

    @property
    def shared(self) -> bool:
        """Whether 2+ sessions hold it (one object in each holder's table, `prefix/sharing.py`)."""
        return self.entry is not None and len(self.entry.holders) > 1

    def on_device(self, layer: int) -> bool:
        """Whether this chunk's KV of `layer` is in a device block (DEVICE, or a kept layer of LAYERED)."""
        if self.state is ChunkState.DEVICE:
            return True
        return self.residue_block is not None and layer % self.residue_block[1] == self.residue_block[2]

    @property
    def table_block(self) -> int:
        """The device block a step's block table names for this context chunk: its block (DEVICE),
        its residue block (LAYERED with one) or 0 (LAYERED without: every layer comes from the host)."""
        if self.state is ChunkState.LAYERED:
            return self.residue_block[0] if self.residue_block is not None else 0
        return self.loc

    @property
    def block(self) -> int | None:
        """The device block this chunk's KV can be read from now, if any."""
        return self.loc if self.state is ChunkState.DEVICE else None


@dataclass(slots=True)
class Session:
    """Invariant: len(chunks) == ceil(len(token_ids) / block_size); chunk k holds the KV of
    token_ids[k * block_size : (k + 1) * block_size]. `token_ids` is the raw history whose KV
    (present or dropped) the session stands for; it is what makes recomputation possible."""

    session_id: str
    token_ids: array = field(default_factory=lambda: array("i"))     # int32: 4 bytes a token (list(...) for a copy)
    chunks: list[Chunk] = field(default_factory=list)
    last_active: float = field(default_factory=time.monotonic)
    busy: bool = False
    turn_started: bool = False    # set by a lease, cleared by the turn's first step (for hit counting)
    in_turn: bool = False         # set by begin_turn, cleared when the lease ends: commits count in last_turn
    last_turn: TurnStats = field(default_factory=TurnStats)
    scope: PrefixScope | None = None    # whose prefixes it shares (prefix/sharing.py), set at its first turn
    retained: bool = False              # deleted, kept only to hold its shared prefix (KVStore.delete)
    # (epoch, n): as of the sharing's epoch `epoch`, chunks [0, n) are indexed (entries in the index);
    # written only by PrefixSharing (its `register` starts at chunk n while the epoch is unchanged)
    index_cursor: tuple[int, int] = (-1, 0)
    seq: int = 0                        # the table's order (`SessionTable` numbers sessions as they join)
    expected_at: float = 0.0            # clock time its next turn is expected by (a tool pause); 0: none
    # as last counted by the table's `tier_index.TierUsage` (its one writer): (retained, state index, tokens, ...)
    counted: tuple = ()

    def next_use(self, now: float) -> float:
        """When its next turn is estimated: the expected time while that is ahead, else as far from now as
        its last activity is (LRU's guess). Eviction takes the furthest first (`policy.py`)."""
        return self.expected_at if self.expected_at > now else 2 * now - self.last_active

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def chunk_len(self, k: int, block_size: int) -> int:
        return max(min(block_size, len(self.token_ids) - k * block_size), 0)

    def chunk_range(self, k: int, block_size: int) -> range:
        return range(k * block_size, k * block_size + self.chunk_len(k, block_size))

    def tokens_by_state(self, block_size: int) -> dict[ChunkState, int]:
        """Its tokens per chunk state (states it has none in left out). O(its chunks)."""
        out: dict[ChunkState, int] = {}
        for k, c in enumerate(self.chunks):
            out[c.state] = out.get(c.state, 0) + self.chunk_len(k, block_size)
        return out

    def tokens_in(self, state: ChunkState, block_size: int) -> int:
        return sum(self.chunk_len(k, block_size) for k, c in enumerate(self.chunks) if c.state is state)

    def residency(self, block_size: int, upto: int | None = None) -> dict[str, int]:
        """Tokens per chunk state (of the first `upto`; None: all), e.g. {"device": 64, "host": 32, ...}."""
        n = len(self.token_ids) if upto is None else min(upto, len(self.token_ids))
        out = {st.value: 0 for st in ChunkState}
        for k, c in enumerate(self.chunks[: blocks_for(n, block_size)]):
            out[c.state.value] += min(block_size, n - k * block_size)
        return out


class SessionTable:
    def __init__(self, clock: Callable[[], float], tiers: Any, usage: Any):
        self.clock = clock
        self.lock = threading.RLock()          # every store method that reads or changes sessions holds it
        self._sessions: dict[str, Session] = {}
        self._seq = itertools.count()
        # Who holds device blocks (`device_chunks` prunes both): a turn's and a step's device work touches
        # these, never the idle sessions held in lower tiers. A superset of the sessions holding one in a
        # chunk of their own, and of the shared chunks holding one (id -> (chunk, a holder, k)): a chunk
        # every session shares (a system prompt) is one entry, not one per holder.
        self._device: set[str] = set()
        self._device_shared: dict[int, tuple[Chunk, str, int]] = {}
        self._shadows: dict[int, tuple[Chunk, str, int]] = {}   # a superset of the chunks keeping a device shadow
        self._retained: set[str] = set()       # exactly the sessions with `retained` set
        self._busy: set[str] = set()           # exactly the sessions with `busy` set (`acquire` / `release`)
        self._idle: OrderedDict[str, None] = OrderedDict()   # idle, not retained, least recently released first
        self._tiers = tiers                    # `tier_index.TierOrder`: who holds chunks in each tier, in order
        self._tenants: Counter[str] = Counter()     # sessions per tenant
        self._counts = usage                   # `tier_index.TierUsage`: tokens per (tier, tenant)
        self.on_change: Callable[[Iterable[str]], None] = lambda ids: None   # marked, removed: the disk index's
        self.expectations = Expectations()     # (expected_at, id) of each expectation set: `due`

    def get(self, session_id: str) -> Session:
        """The session; UnknownSessionError if there is none."""
        try:
            return self._sessions[session_id]
        except KeyError:
            raise UnknownSessionError(session_id) from None

    def find(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def open(self, session_id: str) -> Session:
        """The session, created empty if new. Mutates: the map."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session id must be a non-empty string, got {session_id!r}")
        s = self._sessions.get(session_id)
        if s is None:
            s = self._sessions[session_id] = Session(session_id, last_active=self.clock(), seq=next(self._seq))
            self._idle[session_id] = None
            self._count_tenant(session_id, 1)
            self._counts.stale.add(session_id)
        return s

    def add(self, s: Session) -> None:
        """Put a session made elsewhere (the disk index's, at startup). Mutates: the map, `s.seq`."""
        s.seq = next(self._seq)
        self._sessions[s.session_id] = s
        if s.retained:
            self._retained.add(s.session_id)
        elif not s.busy:
            self._idle[s.session_id] = None
        if s.busy:
            self._busy.add(s.session_id)
        self._note_device(s)
        self._tiers.mark(s, self._sessions)
        self._count_tenant(s.session_id, 1)
        self._counts.stale.add(s.session_id)

    def remove(self, session_id: str) -> None:
        """Forget a session (its chunks must have been released). Mutates: the map."""
        self._counts.drop(self._sessions.pop(session_id))
        self._count_tenant(session_id, -1)
        self._tiers.forget(session_id, self._sessions)
        self.on_change((session_id,))
        self._device.discard(session_id)
        self._retained.discard(session_id)
        self._busy.discard(session_id)
        self._idle.pop(session_id, None)

    def _count_tenant(self, session_id: str, d: int) -> None:
        t = tenant_of(session_id)
        self._tenants[t] += d
        if not self._tenants[t]:
            del self._tenants[t]

    @property
    def tenants(self) -> int:
        """How many tenants hold sessions."""
        return len(self._tenants)

    # ---- tokens per tier and tenant, counted incrementally ---------------------------------------

    def recount(self, session_id: str) -> None:
        """The session's chunks, token ids or retained flag may have changed: counted again at the next
        read of `usage` / `live_usage`. O(1)."""
        self._counts.stale.add(session_id)

    def recount_chunk(self, c: Chunk) -> None:
        """A chunk with a prefix entry moved, or its entry or holders changed (for every holder): counted
        again at the next read, once. O(1)."""
        self._counts.stale_chunks[id(c)] = c

    def usage(self) -> Mapping[tuple[ChunkState, str], int]:
        """Tokens per (chunk state, tenant) of every session (retained ones too), each holder of a shared
        chunk counting it (`FairSharePolicy`'s usage). O(sessions changed since the last read)."""
        return self._counts.usage(self._sessions, self._retained)

    def totals(self) -> Mapping[ChunkState, int]:
        """`usage` summed over tenants: tokens per chunk state (`stats()`). O(sessions changed since)."""
        return self._counts.totals(self._sessions, self._retained)

    def shared_tokens(self) -> tuple[Mapping[ChunkState, int], int]:
        """(per chunk state, the tokens `totals` counts for a shared chunk's extra holders; the tokens of the
        shared chunks, each once) (`stats()`). O(sessions and chunks changed since the last read)."""
        return self._counts.physical(self._sessions, self._retained)

    def live_usage(self) -> Mapping[tuple[ChunkState, str], int]:
        """`usage` of the sessions not retained (`History.tenant_usage`)."""
        return self._counts.live(self._sessions, self._retained)

    def live_sessions_per_tenant(self) -> Counter[str]:
        """Sessions not retained, per tenant. O(tenants + retained sessions)."""
        out = Counter(self._tenants)
        out.subtract(tenant_of(sid) for sid in self._retained)
        return +out

    # ---- who holds what: device blocks, lower tiers, retained sessions ---------------------------

    def mark(self, session_id: str) -> None:
        """The session's chunks may be in new places: called once they are (a step's entries, a move up or
        down, adopting a shared chunk, the other holders of a shared chunk that moved, the end of a lease);
        walks prune what no longer holds. O(its chunks + log held). Mutates: marks."""
        s = self._sessions.get(session_id)
        if s is not None:
            self._note_device(s)
            self._tiers.mark(s, self._sessions)
        self._counts.stale.add(session_id)
        self.on_change((session_id,))

    def holding(self, state: ChunkState, now: float, tenant: str | None = None) -> Iterator[tuple[Session, list[int]]]:
        """(session, its chunks a walk takes there) of the sessions listed in `state` (one of INDEXED; of
        `tenant`, None: any), furthest next use first (ties by id): each holds them, and a chunk shared by
        several is named at its most valuable holders only (`TierOrder`). The marks must not change while it
        runs. Mutates: the marks (pruning), lapsed `expected_at`s."""
        return self._tiers.walk(state, self._sessions, now, tenant)

    def mark_moved(self, items: Iterable[tuple[Session, int]], also: Iterable[str] = (), rows: bool = True) -> None:
        """These chunks moved (in place: for every holder of a shared one). The sessions they are named by, and
        `also`, are marked; a chunk with a prefix entry is counted again once (`TierUsage`), its place kept per
        chunk (its tops listed in its new tier, the device's and the shadows' maps), and, if `rows` (the move may
        have changed what the disk index names the chunk by: onto or off disk), its other holders are told to
        the disk index: a chunk 10^4 sessions share costs O(1), or O(holders) set updates with `rows`, not a
        mark each. Mutates: the marks."""
        named, others = set(also), set()
        for s, k in items:
            named.add(s.session_id)
            c = s.chunks[k]
            if c.entry is not None:
                self._counts.stale_chunks[id(c)] = c
            if not c.shared:
                continue
            if rows:
                others.update(c.entry.holders)
            self._tiers.moved(c, k, self._sessions)
            self._note(s, k, c)
        for sid in named:
            self.mark(sid)
        others -= named
        if others:
            self.on_change(others)

    def let_go(self, s: Session, c: Chunk) -> None:
        """`s` let go of chunk `c` (`TierPools.release`): if `c` was shared and `s` topped it in its tier's order,
        another holder does now (none, when `c` was freed); a last holder holds `c` as its own. O(1), or
        O(c's holders) when `s` topped it. Mutates: the marks."""
        self._tiers.let_go(s.session_id, c, self._sessions)
        if c.entry is not None and len(c.entry.holders) == 1:
            self.mark(next(iter(c.entry.holders)))

    def regroup(self, per_tenant: bool) -> None:
        """The tier order lists sessions per tenant (a fair-share policy's walks) or all together."""
        self._tiers.regroup(per_tenant, self._sessions)

    def _note_device(self, s: Session) -> None:
        """`s` may hold device blocks now: it, or the shared chunk holding one, joins the marks."""
        own = False
        for k, c in enumerate(s.chunks):
            own |= self._note(s, k, c)
        if own:
            self._device.add(s.session_id)

    def _note(self, s: Session, k: int, c: Chunk) -> bool:
        """Chunk k of `s` may keep a shadow or, shared, hold a device block: it joins those maps, named by
        `s`. True when it is a device block of `s`'s own (the caller marks `s`)."""
        if c.shadow is not None:
            self._shadows[id(c)] = (c, s.session_id, k)
        if c.holds_device and c.shared:
            self._device_shared[id(c)] = (c, s.session_id, k)
            return False
        return c.holds_device

    def _holder(self, c: Chunk, sid: str, k: int) -> Session | None:
        """A session holding `c` as its chunk k: `sid`'s, else (it let go) another holder's; None if none."""
        s = self._sessions.get(sid)
        if s is not None and k < len(s.chunks) and s.chunks[k] is c:
            return s
        return next((self._sessions[h] for h in (c.entry.holders if c.entry is not None else ())
                     if h in self._sessions), None)

    def shadow_chunks(self) -> list[tuple[Session, int]]:
        """Every HOST / HIDDEN chunk keeping a device shadow, once: (a session holding it, k), in no particular
        order. O(them) (a shadow is made only by `Placement.swap_out_ahead`, which marks its holders).
        Mutates: the marks only (`check_integrity` proves the result)."""
        out: list[tuple[Session, int]] = []
        for cid, (c, sid, k) in list(self._shadows.items()):
            s = self._holder(c, sid, k) if c.shadow is not None else None
            if s is None:
                del self._shadows[cid]
                continue
            self._shadows[cid] = (c, s.session_id, k)
            out.append((s, k))
        return out

    def device_chunks(self) -> list[tuple[Session, int]]:
        """Every chunk holding a device block (DEVICE, a residue, a shadow), once: (a session holding it, k),
        in no particular order. O(the sessions holding one in a chunk of their own, their chunks, and the
        shared chunks holding one), whatever the number of sessions held or sharing: marks that hold no
        block any more are forgotten here. Mutates: the marks only (`check_integrity` proves the result
        is every chunk holding a block)."""
        out: list[tuple[Session, int]] = []
        for cid, (c, sid, k) in list(self._device_shared.items()):
            if not c.holds_device or not c.shared:
                del self._device_shared[cid]       # off the device, or private now: its holder's own (marked)
                if c.holds_device and c.entry is not None:
                    self._device.update(c.entry.holders)
                continue
            s = self._holder(c, sid, k)
            if s is None:
                continue
            self._device_shared[cid] = (c, s.session_id, k)
            out.append((s, k))
        keep: set[str] = set()
        for sid in self._device:
            s = self._sessions.get(sid)
            if s is None:
                continue
            for k, c in enumerate(s.chunks):
                if c.holds_device:
                    if c.shared:
                        if id(c) not in self._device_shared:
                            self._device_shared[id(c)] = (c, sid, k)
                            out.append((s, k))
                    else:
                        out.append((s, k))
                        keep.add(sid)
        if len(keep) < len(self._device):    # a new set: one that shrank by discards is iterated at its peak size
            self._device = keep
        return out

    @property
    def tiers(self) -> Any:
        """Each lower tier's holders (read by `check_integrity` only)."""
        return self._tiers

    def retain(self, s: Session, retained: bool) -> None:
        """Set `s.retained` (History: deleted but kept for its shared prefix, or revived). Mutates: that flag."""
        s.retained = retained
        self._counts.stale.add(s.session_id)
        self.on_change((s.session_id,))
        if retained:
            self._retained.add(s.session_id)
            self._idle.pop(s.session_id, None)
        else:
            self._retained.discard(s.session_id)
            if not s.busy:
                self._idle[s.session_id] = None

    def retained(self) -> list[Session]:
        """The retained sessions, in table order."""
        return sorted((self._sessions[sid] for sid in self._retained), key=lambda s: s.seq)

    @property
    def live(self) -> int:
        """Sessions held, retained ones aside."""
        return len(self._sessions) - len(self._retained)

    def busy(self) -> list[Session]:
        """The leased sessions (`busy` set), in table order; O(them), whatever the number of sessions held."""
        return sorted((self._sessions[sid] for sid in self._busy), key=lambda s: s.seq)

    def idle_ids(self) -> list[str]:
        """The idle sessions that are not retained, least recently released first."""
        return list(self._idle)

    def oldest_idle(self) -> Session | None:
        """The least recently released idle session that is not retained; O(1)."""
        return self._sessions[next(iter(self._idle))] if self._idle else None

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(self._sessions.values())

    def acquire(self, session_id: str) -> tuple[Session, float | None]:
        """Lease the session for one turn: it becomes busy. Returns it and, when it has history (a
        returning conversation), the idle gap since its last activity. SessionBusyError if leased.
        Mutates: `busy`, `turn_started`."""
        s = self.get(session_id)
        if s.busy:
            raise SessionBusyError(session_id)
        gap = self.clock() - s.last_active if s.token_ids else None
        s.busy = s.turn_started = True
        s.expected_at = 0.0                    # it came back
        self._busy.add(session_id)
        self._idle.pop(session_id, None)
        return s, gap

    def release(self, s: Session) -> None:
        """End a lease. Mutates: `busy`, `turn_started`, `in_turn`, `last_active`."""
        s.busy = s.turn_started = s.in_turn = False
        self._busy.discard(s.session_id)
        s.last_active = self.clock()
        self.mark(s.session_id)
        if not s.retained:
            self._idle[s.session_id] = None
            self._idle.move_to_end(s.session_id)

    def expect(self, s: Session, at: float) -> None:
        """The session's next turn is expected by clock time `at` (`Session.next_use`). Mutates: `expected_at`."""
        s.expected_at = at
        self.expectations.push(at, s.session_id)
        self.mark(s.session_id)

    def due(self, until: float) -> list[str]:
        """Idle sessions whose expected turn comes by `until`, each expectation once, soonest first.
        Mutates: `expectations`."""
        out = []
        for at, sid in self.expectations.pop_due(until):
            s = self._sessions.get(sid)
            if s is not None and s.expected_at == at and not s.busy and s.last_active < at:
                out.append(sid)
        return out

    def touch(self, s: Session, now: float) -> None:
        """The session was active at `now` (a step committed). Mutates: `last_active`; an idle session's tier entry
        (a step run outside a lease, as the store's own tests do; a busy one is re-keyed when its lease ends)."""
        s.last_active = now
        if not s.busy:
            self.mark(s.session_id)
