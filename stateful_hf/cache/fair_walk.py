"""Fair share's victims below the device without ranking every chunk held (`fair_victims`).

`FairSharePolicy` over a session-ordered policy (lru, recency_cost) keys tenant t's idle chunks of a
tier, walked in the inner policy's order, by (rank(u, share_t), *inner key), u the tenant's tokens in
the tier not yet walked past (`FairSharePolicy._ranks`). Along one tenant's walk those keys only grow
(the excess first, then -u / share as u falls), so the tier's order is a merge of one walk per tenant
(`TierOrder`'s per-tenant lists), and the n lowest come from the heads of those walks. A tenant's
usage comes from the session table's counts (`SessionTable.usage`), so a choice costs O(the sessions
walked + log held), not O(every chunk held). `Placement.victims(scan=True)` is the oracle.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from .policy import EvictionPolicy, FairSharePolicy
from .prefix.sharing import PrefixSharing
from .session import ChunkState, Session, SessionTable

Items = list[tuple[Session, int]]


def fair_victims(sessions: SessionTable, sharing: PrefixSharing, policy: FairSharePolicy, inner: EvictionPolicy,
                 state: ChunkState, n: int, exclude: set[str], shadowed: bool | None, now: float,
                 block_size: int) -> Items:
    """`Placement.victims` below the device under `policy` (its `inner` session-ordered): the n lowest
    chunks in `state` of idle sessions outside `exclude`, one per physical chunk, lowest first."""
    usage = {t: u for (st, t), u in sessions.usage().items() if st is state}
    if n <= 0 or not usage:
        return []
    walks = [_tenant_walk(sessions, sharing, policy, inner, state, t, used, share, exclude, shadowed, now,
                          block_size)
             for t, (used, share) in {t: (usage[t], sh) for t, sh in policy.shares(usage).items()}.items()]
    found: Items = []
    try:
        for _, s, k in heapq.merge(*walks, key=lambda e: e[0]):
            found.append((s, k))
            if len(found) >= n:
                break
    finally:
        for w in walks:
            w.close()
    return found


def _tenant_walk(sessions: SessionTable, sharing: PrefixSharing, policy: FairSharePolicy, inner: EvictionPolicy,
                 state: ChunkState, tenant: str, used: int, share: float, exclude: set[str], shadowed: bool | None,
                 now: float, bs: int) -> Iterator[tuple[tuple, Session, int]]:
    """(fair key, session, chunk) of the tenant's movable chunks in `state`, ascending. Every idle chunk
    walked lowers u, as in `FairSharePolicy._ranks`, movable or not (busy sessions' chunks are in the
    usage but never walked). A shared chunk is named once, at its holder walked last (its most valuable,
    whose key is the chunk's), by its first holder in table order, as `sharing.unique` names it."""
    walk = sessions.holding(state, now, tenant)
    try:
        for s in walk:
            if s.busy:
                continue
            mine = sorted((inner.key(s, k, bs, now), k) for k, c in enumerate(s.chunks) if c.state is state)
            for ikey, k in mine:
                key = (*policy.rank(used, share), *ikey)
                used -= s.chunk_len(k, bs)
                c = s.chunks[k]
                if s.session_id in exclude or (shadowed is not None and (c.shadow is not None) != shadowed):
                    continue
                if c.entry is None:
                    yield key, s, k
                elif sharing.free_to_move(c, exclude):
                    holders = sharing.holders(s, k)
                    if max((inner.key(h, k, bs, now), h.session_id) for h in holders)[1] == s.session_id:
                        yield key, min(holders, key=lambda h: h.seq), k
    finally:
        walk.close()
