"""Victims in a tier (the device too) without ranking every chunk held: a best-first walk of a tier's holders
under a policy with a `floor` (`tier_victims`, `walk`), and the fair share's merge of one walk per
tenant (`fair_victims`).

`FairSharePolicy` over such a policy (any of the four) keys tenant t's idle chunks of a
tier, walked in the inner policy's order, by (rank(u, share_t), *inner key), u the tenant's tokens in
the tier not yet walked past (`FairSharePolicy._ranks`). Along one tenant's walk those keys only grow
(the excess first, then -u / share as u falls), so the tier's order is a merge of one walk per tenant
(`TierOrder`'s per-tenant lists), and the n lowest come from the heads of those walks. A tenant's
usage comes from the session table's counts (`SessionTable.usage`), so a choice costs O(the sessions
walked + log held), not O(every chunk held). `Placement.victims(scan=True)` is the oracle.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from itertools import islice

from ..prefix.sharing import PrefixSharing
from ..sessions.session import ChunkState, Session, SessionTable
from .policy import EvictionPolicy, FairSharePolicy

Items = list[tuple[Session, int]]


def tier_victims(sessions: SessionTable, sharing: PrefixSharing, policy: EvictionPolicy, state: ChunkState, n: int,
                 exclude: set[str], shadowed: bool | None, now: float, block_size: int) -> Items:
    """`Placement.victims` in a tier under `policy` (prepared, with a floor): one walk of the tier's holders."""
    found = walk(sessions, sharing, policy, state, None, exclude, shadowed, now, block_size)
    try:
        return [(s, k) for _, s, k in islice(found, max(n, 0))]
    finally:
        found.close()


def fair_victims(sessions: SessionTable, sharing: PrefixSharing, policy: FairSharePolicy, inner: EvictionPolicy,
                 state: ChunkState, n: int, exclude: set[str], shadowed: bool | None, now: float,
                 block_size: int) -> Items:
    """`Placement.victims` in a tier under `policy` (its `inner` prepared, with a floor): the n lowest
    chunks in `state` of idle sessions outside `exclude`, one per physical chunk, lowest first."""
    usage = {t: u for (st, t), u in sessions.usage().items() if st is state}
    if n <= 0 or not usage:
        return []
    walks = [walk(sessions, sharing, inner, state, t, exclude, shadowed, now, block_size,
                  _ranker(policy, usage[t], share))
             for t, share in policy.shares(usage).items()]
    try:
        return [(s, k) for _, s, k in islice(heapq.merge(*walks, key=lambda e: e[0]), n)]
    finally:
        for w in walks:
            w.close()


def _ranker(policy: FairSharePolicy, used: int, share: float) -> Callable[[int], tuple]:
    """The fair key's head of each chunk walked in turn, given its tokens: u falls by each (`_ranks`)."""
    def rank(tokens: int) -> tuple:
        nonlocal used
        head, used = policy.rank(used, share), used - tokens
        return head
    return rank


def walk(sessions: SessionTable, sharing: PrefixSharing, policy: EvictionPolicy, state: ChunkState,
         tenant: str | None, exclude: set[str], shadowed: bool | None, now: float, bs: int,
         rank: Callable[[int], tuple] | None = None) -> Iterator[tuple[tuple, Session, int]]:
    """(key, session, chunk) of the movable chunks in `state` of the holders (of `tenant`; None: all),
    ascending by `policy`'s key (prepared; `by_session` returned it), with `rank`'s head before it when
    given. Best first: the holders are read furthest next use first (`TierOrder`) and a chunk is taken
    once its key is below the `floor` of the next holder read, which bounds every key not read yet.
    `rank` is asked for every idle chunk taken, movable or not (busy sessions' chunks are in the fair
    share's usage but never walked; a shared chunk once, with all its holders' tokens, when none is busy);
    without it an excluded session is passed over. A shared chunk is
    taken once, at its holder whose key is the chunk's (its most valuable: the last of its entries the walk
    reads, `TierOrder.entries`), and named by its first holder in table order, as `sharing.unique` names it."""
    holders_walk = sessions.holding(state, now, tenant)
    heap: list[tuple[tuple, int, Session, int]] = []     # (key, push order, session, chunk): keys read
    pushed = 0
    popped: dict[int, int] = {}       # id(shared chunk) -> its entries taken so far
    order = sessions.tiers

    def take() -> Iterator[tuple[tuple, Session, int]]:
        ikey, _, s, k = heapq.heappop(heap)
        c = s.chunks[k]
        if c.entry is not None:
            # the walk pushes c at each idle holder listing it (its tops) and takes entries in ascending key
            # order: the last one taken is its most valuable holder's (c's key); a busy one's is never pushed, so
            # then the count stays short, as free_to_move would refuse. The fair share ranks c there, once, with
            # every holder's copy (its usage counts each), and only if no holder is busy (`FairSharePolicy._ranks`)
            n = popped[id(c)] = popped.get(id(c), 0) + 1
            if n < order.entries(c) or (rank is not None and not sharing.free_to_move(c, set())):
                return
        tokens = s.chunk_len(k, bs) * (1 if c.entry is None else len(c.entry.holders))
        key = ikey if rank is None else (*rank(tokens), *ikey)
        if s.session_id in exclude or (shadowed is not None and (c.shadow is not None) != shadowed):
            return
        if c.entry is None:
            yield key, s, k
        elif sharing.free_to_move(c, exclude):
            yield key, min(sharing.holders(s, k), key=lambda h: h.seq), k

    try:
        for s, ks in holders_walk:
            if s.busy or (rank is None and s.session_id in exclude):
                continue
            floor = policy.floor(s, now, bs)
            while heap and heap[0][0] < floor:
                yield from take()
            for k in ks:
                heapq.heappush(heap, (policy.key(s, k, bs, now), pushed, s, k))
                pushed += 1
        while heap:
            yield from take()
    finally:
        holders_walk.close()
