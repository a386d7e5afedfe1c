"""The session table's indexes per tier: who holds chunks in each tier (the device's included), in the
session-ordered policies' order (`TierOrder`), and how many tokens each tenant has in each tier
(`TierUsage`). Both are kept by `SessionTable` (`session.py`), which tells them what changed."""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet

from sortedcontainers import SortedList

from .session import Chunk, ChunkState, Session
from .tenant import tenant_of

Entry = tuple[float, str]      # (last_active, id) in `order`; (-expected_at, id) in `ahead`


class Tops:
    """A shared chunk's most valuable holders in `TierOrder`'s order, one per list kind: the entry of its
    holder listed last in `order` (latest activity) and in `ahead` (soonest expected turn), or None."""

    __slots__ = ("chunk", "k", "state", "top")

    def __init__(self, chunk: Chunk, k: int):
        self.chunk, self.k, self.state = chunk, k, chunk.state      # (the tier its tops are listed in)
        self.top: list[Entry | None] = [None, None]       # [in `order`, in `ahead`]: indexed by expected?

    def names(self, session_id: str) -> bool:
        return any(e is not None and e[1] == session_id for e in self.top)

    @property
    def count(self) -> int:
        """Its entries a walk of every holder reads (1 or 2): the walk takes it at the last of them."""
        return sum(e is not None for e in self.top)


class TierOrder:
    """Per tier (`session.INDEXED`; and per tenant when `per_tenant`), the sessions that may hold a chunk
    there, in the session-ordered policies' order (`EvictionPolicy.by_session`: furthest
    `Session.next_use` first, ties by id), so that a walk for victims (`Placement.victims`) visits only
    the sessions it takes from and the busy or excluded ones ahead of them: O(those + log held), never
    every session held. Two sorted lists per (tier, group), merged by a walk: sessions with no turn
    expected, by last activity (their order never changes), and sessions with one, by expected time
    (lapsed when it passes, at the next walk). A group is a tenant when `per_tenant` (the fair share's
    per-tenant walks; a list costs ~0.5 KiB, so only a fair-share store groups: `regroup`), else one
    group "" for all. A walk covers one tenant or all, merged.

    A chunk that 2+ sessions share (a chat template's system prompt: held by every session) is listed once,
    at its most valuable holders (`Tops`: where a walk of every holder would read it last, which is where
    its key, the max over its holders, puts it), not by every holder: a session is listed in a tier for its
    own chunks there and the shared ones it tops, so the thousands of sessions whose only device chunk is
    the shared one cost a walk nothing. Kept on each mark in O(1) a shared chunk (a holder more valuable
    than its top takes its place); read anew from its holders (O(holders)) only when a top lets go of it,
    leaves, or falls behind (an expected turn that lapsed). Its holders are all of one tenant (sharing is
    scoped by tenant: `prefix/index.py`), so with `per_tenant` its tops are listed in that tenant's lists,
    where the fair share's walk of the tenant ranks all its holders' copies at once (`fair_walk.py`).

    Written only by `SessionTable` (`mark`: wherever a session may gain a chunk in a tier, or change its
    last activity or expected time; `moved`: a shared chunk moved; `let_go`: a session let go of a chunk;
    `forget`); a walk drops who holds nothing it lists there any more (each mark pays for one).
    `check_integrity` compares every top with its holders'."""

    __slots__ = ("order", "ahead", "key", "per_tenant", "soonest", "tops", "topping")

    def __init__(self, states: tuple[ChunkState, ...], per_tenant: bool = False):
        self.order: dict[ChunkState, dict[str, SortedList]] = {st: {} for st in states}   # no turn expected
        self.ahead: dict[ChunkState, dict[str, SortedList]] = {st: {} for st in states}   # latest expected first
        self.key: dict[str, tuple[bool, Entry]] = {}   # id -> (expected?, its entry in those lists)
        self.per_tenant = per_tenant
        self.soonest = math.inf     # <= every expected time listed in `ahead`: no lapse is due before it
        self.tops: dict[int, Tops] = {}          # id(shared chunk in an indexed state) -> its tops
        self.topping: dict[str, set[int]] = {}   # session id -> ids of the chunks whose `Tops` name it

    def group(self, session_id: str) -> str:
        """The group a session's entries are listed under: its tenant when `per_tenant`, else ""."""
        return tenant_of(session_id) if self.per_tenant else ""

    def regroup(self, per_tenant: bool, sessions: Mapping[str, Session]) -> None:
        """List every session per tenant or all together from now on: listed anew. O(sessions), once
        (a policy change)."""
        if per_tenant == self.per_tenant:
            return
        self.per_tenant = per_tenant
        for by in (self.order, self.ahead):
            for per in by.values():
                per.clear()
        self.key.clear()
        self.tops.clear()
        self.topping.clear()
        self.soonest = math.inf
        for s in sessions.values():
            self.mark(s, sessions)

    @staticmethod
    def entry(s: Session) -> tuple[bool, Entry]:
        if s.expected_at > s.last_active:
            return True, (-s.expected_at, s.session_id)
        return False, (s.last_active, s.session_id)

    def lists(self, state: ChunkState, tenant: str | None = None) -> list[tuple[SortedList, bool]]:
        """(list, expected?) of `state` for `tenant` (None: every tenant's; a tenant needs `per_tenant`)."""
        if tenant is not None and not self.per_tenant:
            raise ValueError("TierOrder: a walk of one tenant needs per_tenant lists (regroup(True))")
        out = []
        for expected, by in ((False, self.order), (True, self.ahead)):
            per = by[state]
            out += [(lst, expected) for t, lst in per.items() if tenant is None or t == tenant]
        return out

    def listed(self, state: ChunkState, entry: Entry, expected: bool) -> bool:
        lst = (self.ahead if expected else self.order)[state].get(self.group(entry[1]))
        return lst is not None and entry in lst

    def taken_at(self, s: Session, state: ChunkState) -> list[int]:
        """The chunks in `state` a walk takes at `s` (listed under its current key): its own, and the
        shared ones it tops. O(its chunks)."""
        kept = self.key.get(s.session_id)
        out = []
        for k, c in enumerate(s.chunks):
            if c.state is not state:
                continue
            if not c.shared:
                out.append(k)
            else:
                t = self.tops.get(id(c))
                if t is not None and kept is not None and t.top[kept[0]] == kept[1]:
                    out.append(k)
        return out

    def entries(self, c: Chunk) -> int:
        """How many entries of `c` (one with a prefix entry) a walk of its tier's holders reads."""
        if not c.shared:
            return len(c.entry.holders)
        t = self.tops.get(id(c))
        return 0 if t is None else t.count

    def mark(self, s: Session, sessions: Mapping[str, Session]) -> None:
        """`s` may hold chunks in tiers it is not listed in yet, may have let go of shared chunks it topped,
        or has a new key. O(its chunks + log held), and O(holders) for a shared chunk whose top it was and
        whose top it is no more."""
        sid, want = s.session_id, self.entry(s)
        kept = self.key.get(sid)
        if kept is not None and kept != want:
            self._unlist(sid)
        for cid in list(self.topping.get(sid, ())):      # the shared chunks it tops: still held, still topped?
            t = self.tops.get(cid)
            if t is None:
                self.topping[sid].discard(cid)
            elif not (t.k < len(s.chunks) and s.chunks[t.k] is t.chunk) or (
                    t.top[not want[0]] is not None and t.top[not want[0]][1] == sid) or (
                    t.top[want[0]] is not None and t.top[want[0]][1] == sid and want[1] < t.top[want[0]]):
                self._retop(t.chunk, t.k, sessions)     # it let go, changed list or fell behind: read anew
        states = set()
        for k, c in enumerate(s.chunks):
            if c.state not in self.order or not c.shared:
                if id(c) in self.tops:          # in no indexed tier, or shared no more (its holder lists it)
                    self._drop_tops(id(c))
                if c.state in self.order:
                    states.add(c.state)
            else:
                t = self.tops.get(id(c))
                if t is None or t.state is not c.state:     # new, or moved: its tops are listed in its tier
                    t = self._retop(c, k, sessions)
                else:
                    self._offer(t, sid, want)
                if t is not None and t.names(sid):
                    states.add(c.state)
        if states:
            self._list(sid, want, states)

    def _offer(self, t: Tops, sid: str, want: tuple[bool, Entry]) -> None:
        """`sid`, a holder of `t.chunk` keyed `want`, tops it in its list if no holder there is more valuable."""
        cur = t.top[want[0]]
        if cur is None or want[1] >= cur:
            if cur is not None and cur[1] != sid:
                self._untop(cur[1], id(t.chunk))
            t.top[want[0]] = want[1]
            self.topping.setdefault(sid, set()).add(id(t.chunk))

    def _retop(self, c: Chunk, k: int, sessions: Mapping[str, Session]) -> Tops | None:
        """`c`'s tops read anew from its holders (their listed keys; O(holders)) and listed in its tier;
        none when it is shared no more (its one holder, if any, listed as holding it)."""
        self._drop_tops(id(c))
        if c.state not in self.order or c.entry is None:
            return None
        if not c.shared:
            for h in c.entry.holders:
                hs = sessions.get(h)
                if hs is not None and k < len(hs.chunks) and hs.chunks[k] is c:
                    self._list(h, self.key.get(h) or self.entry(hs), {c.state})
            return None
        t = self.tops[id(c)] = Tops(c, k)
        for h in c.entry.holders:
            hs = sessions.get(h)
            if hs is not None:
                kept = self.key.get(h) or self.entry(hs)
                if t.top[kept[0]] is None or kept[1] > t.top[kept[0]]:
                    t.top[kept[0]] = kept[1]
        for expected, e in enumerate(t.top):
            if e is not None:
                self.topping.setdefault(e[1], set()).add(id(c))
                self._list(e[1], (bool(expected), e), {c.state})
        return t

    def _drop_tops(self, cid: int) -> None:
        t = self.tops.pop(cid, None)
        if t is not None:
            for e in t.top:
                if e is not None:
                    self._untop(e[1], cid)

    def _untop(self, sid: str, cid: int) -> None:
        mine = self.topping.get(sid)
        if mine is not None:
            mine.discard(cid)
            if not mine:
                del self.topping[sid]

    def _list(self, sid: str, kept: tuple[bool, Entry], states) -> None:
        """List `sid` under `kept` (its key from now on) in `states`."""
        if self.key.get(sid, kept) != kept:
            self._unlist(sid)
        self.key[sid] = kept
        by, t = (self.ahead if kept[0] else self.order), self.group(sid)
        if kept[0]:
            self.soonest = min(self.soonest, -kept[1][0])
        for st in states:
            lst = by[st].get(t)
            if lst is None:
                lst = by[st][t] = SortedList()
            if kept[1] not in lst:
                lst.add(kept[1])

    def moved(self, c: Chunk, k: int, sessions: Mapping[str, Session]) -> None:
        """Shared chunk `c` (chunk k of its holders) moved to another tier, in place: its tops (unchanged: a
        move changes no holder's key) are listed there. O(1); O(holders) if it had none."""
        t = self.tops.get(id(c))
        if t is None or c.state not in self.order or not c.shared:
            self._retop(c, k, sessions)
        elif t.state is not c.state:
            t.state = c.state
            for expected, e in enumerate(t.top):
                if e is not None:
                    self._list(e[1], (bool(expected), e), {c.state})

    def let_go(self, session_id: str, c: Chunk, sessions: Mapping[str, Session]) -> None:
        """`session_id` holds chunk `c` no more: if it topped `c` (or `c` is shared no more, or freed: then
        nobody tops it), `c`'s tops are read anew."""
        t = self.tops.get(id(c))
        if t is not None and (t.names(session_id) or not c.shared):
            self._retop(c, t.k, sessions)

    def forget(self, session_id: str, sessions: Mapping[str, Session]) -> None:
        """The session leaves every tier's order (it is removed): the shared chunks it topped are read anew."""
        self._unlist(session_id)
        for cid in list(self.topping.pop(session_id, ())):
            t = self.tops.get(cid)
            if t is not None:
                self._retop(t.chunk, t.k, sessions)

    def _unlist(self, session_id: str) -> None:
        kept = self.key.pop(session_id, None)
        if kept is not None:
            self._discard(kept[0], kept[1], self.order)

    def _discard(self, expected: bool, entry: Entry, states) -> None:
        t = self.group(entry[1])
        for st in states:
            per = (self.ahead if expected else self.order)[st]
            lst = per.get(t)
            if lst is not None:
                lst.discard(entry)
                if not lst:
                    del per[t]

    def walk(self, state: ChunkState, sessions: Mapping[str, Session], now: float,
             tenant: str | None = None) -> Iterator[tuple[Session, list[int]]]:
        """(session, the chunks a walk takes at it: `taken_at`) of the sessions listed in `state` (of
        `tenant`; None: every tenant), in `by_session` order at `now`; the lists must not change meanwhile.
        Expected times that passed lapse first (`lapse`); who has nothing to take there leaves the list."""
        if now >= self.soonest:
            self.lapse(sessions, now)
        stale: list[tuple[SortedList, Entry]] = []
        try:
            for _, lst, e in self._merged(state, tenant, now):
                s = sessions.get(e[1])
                ks = [] if s is None else self.taken_at(s, state)
                if not ks:
                    stale.append((lst, e))
                    continue
                yield s, ks
        finally:
            for lst, e in stale:
                lst.discard(e)
                kept = self.key.get(e[1])
                if kept is not None and kept[1] == e and not any(self.listed(st, e, kept[0]) for st in self.order):
                    self.key.pop(e[1], None)
            for by in (self.order, self.ahead):
                per = by[state]
                for t in [t for t, lst in per.items() if not lst]:
                    del per[t]

    def lapse(self, sessions: Mapping[str, Session], now: float) -> None:
        """Expected times at or before `now` lapse (`expected_at` = 0: no turn expected now), the sessions
        re-listed by last activity. O(the lists + those lapsing); a walk runs it only once one is due.
        Passes repeat while one finds a lapse due (a shared chunk's new top may be listed by another's)."""
        again = True
        while again:
            again = False
            for per in self.ahead.values():
                for t, lst in list(per.items()):
                    while lst and -lst[-1][0] <= now:
                        again = True
                        e = lst[-1]
                        s = sessions.get(e[1])
                        if s is None:
                            self.forget(e[1], sessions)
                        else:
                            s.expected_at = 0.0
                            self.mark(s, sessions)
                        lst.discard(e)
                    if not lst and per.get(t) is lst:    # (a re-keyed one's `_unlist` may have taken it out)
                        del per[t]
        self.soonest = min((-lst[-1][0] for per in self.ahead.values() for lst in per.values() if lst),
                           default=math.inf)

    def _merged(self, state: ChunkState, tenant: str | None, now: float) -> Iterator[tuple[Entry, SortedList, Entry]]:
        """(sort key, list, entry) of every entry of `state`'s lists (of `tenant`), ascending by (now - next
        use, id) as the policies' keys: an expected one at now - expected_at, another at last_active - now."""
        def run(lst: SortedList, expected: bool):
            for e in lst:
                yield (now + e[0] if expected else e[0] - now, e[1]), lst, e
        runs = [run(lst, expected) for lst, expected in self.lists(state, tenant)]
        return runs[0] if len(runs) == 1 else heapq.merge(*runs, key=lambda x: x[0])


STATES = tuple(ChunkState)          # a state's index in `Session.counted`


class TierUsage:
    """Tokens per (chunk state, tenant), every holder of a shared chunk counting it: of every session
    (`usage`) and of those not retained (`live`). A session's own chunks are counted per session, as of its
    last count (`Session.counted`: (retained, state index, tokens, ...), written only here; a flat tuple,
    ~64 bytes a session); a chunk with a prefix entry (shared, or indexed to be) once, as its tokens times its
    holders (`_chunks`), so a move of a chunk 10^4 sessions share is one recount, not 10^4. `stale`: sessions
    to count again at the next read (`SessionTable.recount`: wherever a session's chunks, token ids or
    retained flag may have changed), each re-marking its entry chunks; `stale_chunks`: chunks whose place,
    entry or holders changed (`SessionTable.recount_chunk`: a move, the prefix sharing's changes of holders).
    A removed session is subtracted at once (`drop`). A read costs O(the stale sessions' chunks + the stale
    chunks + the retained sessions per stale chunk); `check_integrity` compares a full count."""

    __slots__ = ("block_size", "stale", "stale_chunks", "_chunks", "_usage", "_retained", "_totals", "_extra",
                 "_shared")

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.stale: set[str] = set()
        self.stale_chunks: dict[int, Chunk] = {}                      # id -> chunk, to count again
        # id -> (entry chunk, tenant, (state index, tokens) of its holders not retained, of the retained ones,
        # its tokens x (holders - 1), its tokens if 2+ sessions hold it else 0)
        self._chunks: dict[int, tuple[Chunk, str, tuple, tuple, int, int]] = {}
        self._usage: Counter[tuple[ChunkState, str]] = Counter()      # every session
        self._retained: Counter[tuple[ChunkState, str]] = Counter()   # of which retained ones (few)
        self._totals: Counter[ChunkState] = Counter()                  # `_usage` summed over tenants
        self._extra: Counter[ChunkState] = Counter()   # per state, entry chunks' tokens x (holders - 1)
        self._shared = 0                               # tokens of the chunks 2+ sessions hold, each once

    def usage(self, sessions: Mapping[str, Session], retained: AbstractSet[str]
              ) -> Mapping[tuple[ChunkState, str], int]:
        self._flush(sessions, retained)
        return self._usage

    def totals(self, sessions: Mapping[str, Session], retained: AbstractSet[str]) -> Mapping[ChunkState, int]:
        """`usage` per chunk state, over every tenant: O(the stale sessions' chunks), not O(tenants)."""
        self._flush(sessions, retained)
        return self._totals

    def live(self, sessions: Mapping[str, Session], retained: AbstractSet[str]
             ) -> Mapping[tuple[ChunkState, str], int]:
        self._flush(sessions, retained)
        out = {k: n - self._retained.get(k, 0) for k, n in self._usage.items()}
        return {k: n for k, n in out.items() if n}

    def physical(self, sessions: Mapping[str, Session], retained: AbstractSet[str]
                 ) -> tuple[Mapping[ChunkState, int], int]:
        """(per chunk state, the tokens `totals` counts more than once: a shared chunk's extra holders; the tokens
        of the chunks 2+ sessions hold, each once), so `stats()` reads physical tokens without walking them."""
        self._flush(sessions, retained)
        return self._extra, self._shared

    def drop(self, s: Session) -> None:
        """`s` leaves the table: its last count is taken back (its entry chunks were let go: `stale_chunks`)."""
        if s.counted:
            self._add(s.counted[0], s.counted[1:], tenant_of(s.session_id), -1)
        s.counted = ()
        self.stale.discard(s.session_id)

    def _flush(self, sessions: Mapping[str, Session], retained: AbstractSet[str]) -> None:
        bs = self.block_size
        for sid in self.stale:
            s = sessions.get(sid)
            if s is None:
                continue
            t = tenant_of(sid)
            if s.counted:
                self._add(s.counted[0], s.counted[1:], t, -1)
            by: dict[ChunkState, int] = {}
            for k, c in enumerate(s.chunks):
                if c.entry is None:
                    by[c.state] = by.get(c.state, 0) + s.chunk_len(k, bs)
                else:
                    self.stale_chunks[id(c)] = c
            s.counted = (s.retained, *(x for st, n in by.items() for x in (STATES.index(st), n)))
            self._add(s.retained, s.counted[1:], t, 1)
        self.stale.clear()
        for cid, c in self.stale_chunks.items():
            old = self._chunks.pop(cid, None)
            if old is not None:
                _, t, live, kept, extra, shared = old
                self._add(False, live, t, -1)
                self._add(True, kept, t, -1)
                self._extra[STATES[(live or kept)[0]]] -= extra
                self._shared -= shared
            e = c.entry
            if e is None or not e.holders:
                continue
            held = e.holders
            r = sum(h in held for h in retained) if len(retained) < len(held) else sum(h in retained for h in held)
            n, st, t = len(e.ids), STATES.index(c.state), tenant_of(next(iter(held)))     # holders: one tenant
            live, kept = (st, n * (len(held) - r)) if r < len(held) else (), (st, n * r) if r else ()
            extra, shared = n * (len(held) - 1), n if len(held) > 1 else 0
            self._chunks[cid] = (c, t, live, kept, extra, shared)
            self._add(False, live, t, 1)
            self._add(True, kept, t, 1)
            self._extra[c.state] += extra
            self._shared += shared
        self.stale_chunks.clear()

    def _add(self, retained: bool, flat: tuple, t: str, sign: int) -> None:
        """Add (sign 1) or take back (-1) tokens of tenant `t`: `flat` = (state index, tokens, ...)."""
        for i in range(0, len(flat), 2):
            key = (STATES[flat[i]], t)
            self._totals[key[0]] += sign * flat[i + 1]
            for c in (self._usage, self._retained) if retained else (self._usage,):
                c[key] += sign * flat[i + 1]
                if not c[key]:
                    del c[key]
