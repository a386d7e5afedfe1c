"""The session table's indexes per tier: who holds chunks in each tier (the device's included), in the
session-ordered policies' order (`TierOrder`), and how many tokens each tenant has in each tier
(`TierUsage`). Both are kept by `SessionTable` (`session.py`), which tells them what changed."""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterator, Mapping

from sortedcontainers import SortedList

from .session import ChunkState, Session
from .tenant import tenant_of

Entry = tuple[float, str]      # (last_active, id) in `order`; (-expected_at, id) in `ahead`


class TierOrder:
    """Per tier (`session.INDEXED`; and per tenant when `per_tenant`), the sessions that may hold a chunk
    there, in the session-ordered policies' order (`EvictionPolicy.by_session`: furthest
    `Session.next_use` first, ties by id), so that a walk for victims (`Placement.victims`) visits only
    the sessions it takes from and the busy or excluded ones ahead of them: O(those + log held), never
    every session held. Two sorted lists per (tier, group), merged by a walk: sessions with no turn
    expected, by last activity (their order never changes), and sessions with one, by expected time
    (lapsed when it passes, at the next walk). A group is a tenant when `per_tenant` (the fair share's
    per-tenant walks; a list costs ~0.5 KiB, so only a fair-share store groups: `regroup`), else one
    group "" for all. A walk covers one tenant or all, merged. Written only by `SessionTable` (`mark`:
    wherever a session may gain a chunk in a tier, or change its last activity or expected time); a walk
    drops who holds nothing there any more (each mark pays for one). Read by integrity."""

    __slots__ = ("order", "ahead", "key", "per_tenant", "soonest")

    def __init__(self, states: tuple[ChunkState, ...], per_tenant: bool = False):
        self.order: dict[ChunkState, dict[str, SortedList]] = {st: {} for st in states}   # no turn expected
        self.ahead: dict[ChunkState, dict[str, SortedList]] = {st: {} for st in states}   # latest expected first
        self.key: dict[str, tuple[bool, Entry]] = {}   # id -> (expected?, its entry in those lists)
        self.per_tenant = per_tenant
        self.soonest = math.inf     # <= every expected time listed in `ahead`: no lapse is due before it

    def group(self, session_id: str) -> str:
        """The group a session's entries are listed under: its tenant when `per_tenant`, else ""."""
        return tenant_of(session_id) if self.per_tenant else ""

    def regroup(self, per_tenant: bool) -> None:
        """List every entry per tenant or all together from now on. O(entries), once (a policy change)."""
        if per_tenant == self.per_tenant:
            return
        self.per_tenant = per_tenant
        for by in (self.order, self.ahead):
            for st, per in by.items():
                entries = [e for lst in per.values() for e in lst]
                by[st] = {}
                for e in entries:
                    by[st].setdefault(self.group(e[1]), SortedList()).add(e)

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

    def mark(self, s: Session) -> None:
        """`s` may hold chunks in tiers it is not listed in yet, or has a new key. O(its chunks + log held)."""
        want = self.entry(s)
        if self.key.get(s.session_id, want) != want:
            self.forget(s.session_id)
        held = {c.state for c in s.chunks}
        states = [st for st in self.order if st in held]
        if not states:
            return
        self.key[s.session_id] = want
        by, t = (self.ahead if want[0] else self.order), self.group(s.session_id)
        if want[0]:
            self.soonest = min(self.soonest, -want[1][0])
        for st in states:
            lst = by[st].get(t)
            if lst is None:
                lst = by[st][t] = SortedList()
            if want[1] not in lst:
                lst.add(want[1])

    def forget(self, session_id: str) -> None:
        """The session leaves every tier's order (it is removed, or re-keyed)."""
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
             tenant: str | None = None) -> Iterator[Session]:
        """The sessions holding a chunk in `state` (of `tenant`; None: every tenant), in `by_session` order
        at `now`; the lists must not change meanwhile. Expected times that passed lapse first (`lapse`)."""
        if now >= self.soonest:
            self.lapse(sessions, now)
        stale: list[tuple[SortedList, Entry]] = []
        try:
            for _, lst, e in self._merged(state, tenant, now):
                s = sessions.get(e[1])
                if s is None or not any(c.state is state for c in s.chunks):
                    stale.append((lst, e))
                    continue
                yield s
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
        re-listed by last activity. O(the lists + those lapsing); a walk runs it only once one is due."""
        soonest = math.inf
        for per in self.ahead.values():
            for t, lst in list(per.items()):
                while lst and -lst[-1][0] <= now:
                    e = lst[-1]
                    s = sessions.get(e[1])
                    if s is None:
                        self.forget(e[1])
                    else:
                        s.expected_at = 0.0
                        self.mark(s)
                    lst.discard(e)
                if lst:
                    soonest = min(soonest, -lst[-1][0])
                else:
                    per.pop(t, None)        # (a re-keyed session's `forget` may have taken it out already)
        self.soonest = soonest

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
    (`usage`) and of those not retained (`live`), as of each session's last count (`Session.counted`:
    (retained, state index, tokens, ...), written only here; a flat tuple, ~64 bytes a session). `stale`:
    sessions to count again at the next read, added by the table (`SessionTable.recount`: wherever a
    session's chunks, token ids or retained flag may have changed); a removed session is subtracted at
    once (`drop`). A read costs O(the stale sessions' chunks); `check_integrity` compares a full count."""

    __slots__ = ("block_size", "stale", "_usage", "_retained", "_totals")

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.stale: set[str] = set()
        self._usage: Counter[tuple[ChunkState, str]] = Counter()      # every session
        self._retained: Counter[tuple[ChunkState, str]] = Counter()   # of which retained ones (few)
        self._totals: Counter[ChunkState] = Counter()                  # `_usage` summed over tenants

    def usage(self, sessions: Mapping[str, Session]) -> Mapping[tuple[ChunkState, str], int]:
        self._flush(sessions)
        return self._usage

    def totals(self, sessions: Mapping[str, Session]) -> Mapping[ChunkState, int]:
        """`usage` per chunk state, over every tenant: O(the stale sessions' chunks), not O(tenants)."""
        self._flush(sessions)
        return self._totals

    def live(self, sessions: Mapping[str, Session]) -> Mapping[tuple[ChunkState, str], int]:
        self._flush(sessions)
        out = {k: n - self._retained.get(k, 0) for k, n in self._usage.items()}
        return {k: n for k, n in out.items() if n}

    def drop(self, s: Session) -> None:
        """`s` leaves the table: its last count is taken back."""
        self._add(s, -1)
        s.counted = ()
        self.stale.discard(s.session_id)

    def _flush(self, sessions: Mapping[str, Session]) -> None:
        if not self.stale:
            return
        for sid in self.stale:
            s = sessions.get(sid)
            if s is None:
                continue
            self._add(s, -1)
            by = s.tokens_by_state(self.block_size)
            s.counted = (s.retained, *(x for st, n in by.items() for x in (STATES.index(st), n)))
            self._add(s, 1)
        self.stale.clear()

    def _add(self, s: Session, sign: int) -> None:
        if not s.counted:
            return
        t, retained, flat = tenant_of(s.session_id), s.counted[0], s.counted[1:]
        for i in range(0, len(flat), 2):
            key = (STATES[flat[i]], t)
            self._totals[key[0]] += sign * flat[i + 1]
            for c in (self._usage, self._retained) if retained else (self._usage,):
                c[key] += sign * flat[i + 1]
                if not c[key]:
                    del c[key]
