"""Which chunks move down first. Four policies; the store's default is `RecencyCostPolicy`.

- `RetentionPolicy` ("pensieve"): Pensieve's retention value V = Cost(l) / T for chunk k of a
  conversation idle T seconds, l = (k + 1) * chunk (the context the chunk attends to when recomputed);
  ascending V, so idler conversations first and, inside one, leading chunks first.
- `LRUPolicy` ("lru"): least recently active conversation first, its chunks front to back.
- `ReturnAwarePolicy` ("return_aware"): V = Cost(s, l) * P(returns | idle T), the expected recompute
  cost, with the return probability estimated online from the gaps the store has seen (`returns.py`).
- `RecencyCostPolicy` ("recency_cost", the default): conversations in ascending probability of
  returning, inside a conversation the cheapest Cost(s, l) first. For one population of conversations
  P(returns | idle T) = 1 - S(inf) / S(T) never increases with T, whatever the gaps' distribution S,
  so that order of conversations is LRU's, and no estimate is needed for it.

Cost(s, l) is Pensieve's cost of recomputing a chunk of s tokens attending to l: s / chunk * Cost(l),
l = k * chunk + s. It differs from Cost(l) only for a conversation's last, partial chunk.

Why the default: every chunk of one conversation is needed again at the same moment (its next turn),
so among them the cheapest should go first (an exchange argument), and a partial chunk frees a whole
block for fewer tokens. Between conversations, the products above trade a likelier-to-return
conversation's cheap chunk against a less likely one's expensive chunk on a myopic expectation; on the
benchmark's replay (benchmarks/multiturn/policy_grid.py) both products recomputed more tokens than LRU
in about half of the settings and fewer in the others, while the default never recomputed more than LRU
(it drops as many chunks of the same conversations, by construction) and fewer wherever a partial chunk
of a returning conversation was dropped. The same order decides device -> host, host -> disk and dropping.

Every policy reads a conversation's estimated next use (`Session.next_use`) where it would read its
idleness: for most, as far from now as its last activity is; for one whose next turn is expected
(`KVStore.expect`: a hint's `expected_arrival`, an agent's tool pause), that time, until it passes.
The furthest next use goes first (Belady's rule on an estimate): an agent back in 2 s keeps its KV
before one back in 30 s, and both before a conversation idle for a minute. A priority, never a pin.

`FairSharePolicy` wraps any of them for a store shared by tenants (`session.py`): chunks of tenants
above their fair share of a tier go first, so one tenant flooding the store cannot push everyone
else's history down.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ..sessions.session import ChunkState, Session
from ..sessions.tenant import tenant_of
from .returns import ReturnEstimator

SLACK = 1e-9          # a floor's relative margin below the exact bound: floating-point rounding of the keys


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Cost(l): seconds to recompute one chunk attending to l tokens, measured at increasing lengths
    (powers of two) and interpolated linearly; extrapolated with the last slope. Measurements are
    made non-decreasing (the cost of attention grows with l; noise must not reorder chunks)."""

    lengths: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    seconds: tuple[float, ...] = (1.0, 1.03, 1.09, 1.19, 1.38, 1.77, 2.53, 4.06, 7.13)  # c + a*l shape
    source: str = field(default="the built-in shape (not measured)", compare=False)   # where it came from
    # (tier, seconds) per chunk brought up to the device from that tier ("host", "disk"), where measured
    swap_in: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if len(self.lengths) != len(self.seconds) or len(self.lengths) < 2:
            raise ValueError("CostProfile needs >= 2 (length, seconds) points of equal count")
        if list(self.lengths) != sorted(set(self.lengths)):
            raise ValueError("CostProfile.lengths must strictly increase")
        monotone, top = [], 0.0
        for s in self.seconds:
            top = max(top, float(s))
            monotone.append(top)
        object.__setattr__(self, "seconds", tuple(monotone))

    def cost(self, context: int) -> float:
        xs, ys = self.lengths, self.seconds
        i = min(max(bisect.bisect_left(xs, context), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (context - x0) / (x1 - x0), ys[0] * 1e-3)

    def chunk_cost(self, k: int, tokens: int, block_size: int) -> float:
        """Cost(s, l) of chunk k holding `tokens` (s) tokens: s / block_size * Cost(k * block_size + s)."""
        return self.cost(k * block_size + tokens) * tokens / block_size


class EvictionPolicy:
    """Ranks chunks for moving down: smaller key first. Reads sessions, never mutates them. The store
    calls `observe_return` when an idle session with history starts a turn and `prepare` once before
    each ranking; both are no-ops unless a policy learns from them."""

    name = "base"
    profile: CostProfile | None = None     # Cost(l), for the policies whose keys read it

    def key(self, session: Session, k: int, block_size: int, now: float) -> tuple:
        raise NotImplementedError

    def describe(self) -> str:
        """The policy's name, with what it wraps (the server's start line)."""
        return self.name

    def use_profile(self, profile: CostProfile) -> None:
        """Later keys read `profile` (the engine's online correction, `profile/correction.py`); a policy
        whose keys read no cost profile ignores it."""
        if self.profile is not None:
            self.profile = profile

    def observe_return(self, gap: float) -> None:
        """A conversation idle for `gap` seconds started a turn."""

    def prepare(self, sessions: Iterable[Session], now: float) -> None:
        """Called with all the store's sessions before the keys of one ranking are taken."""

    def by_session(self, tenants: int) -> EvictionPolicy | None:
        """A policy ordering every chunk as this one does while `tenants` tenants hold sessions, with a
        `floor`: victims then walk a tier's holders furthest next use first (`TierOrder`), best first
        under the floor (`fair_walk.walk`), instead of ranking every chunk held. None: rank them all."""
        return None

    def floor(self, session: Session, now: float, block_size: int) -> tuple:
        """A key at most every chunk key of `session` and of each session after it in the walk's order
        (furthest `Session.next_use` first, ties by id) at `now`, once prepared: the walk takes the chunks
        keyed below it before it reads another session. Only for policies `by_session` returns."""
        raise NotImplementedError(f"{type(self).__name__} has no floor: rank every chunk")


class RetentionPolicy(EvictionPolicy):
    """Pensieve §4.3.1 as published: V = Cost(l) / T, l = (k + 1) * chunk."""

    name = "pensieve"

    def __init__(self, profile: CostProfile | None = None):
        self.profile = profile or CostProfile()

    def key(self, session, k, block_size, now):
        idle = max(session.next_use(now) - now, 1e-6)
        return (self.profile.cost((k + 1) * block_size) / idle, session.session_id, k)

    def by_session(self, tenants):
        return self

    def floor(self, session, now, block_size):
        """Cost(l) >= Cost(block_size) and T never grows along the walk; (1 - SLACK) covers rounding."""
        idle = max(session.next_use(now) - now, 1e-6)
        return (self.profile.cost(block_size) / idle * (1 - SLACK),)


class LRUPolicy(EvictionPolicy):
    """Least recently active session first, its chunks front to back."""

    name = "lru"

    def by_session(self, tenants):
        return self

    def key(self, session, k, block_size, now):
        return (now - session.next_use(now), session.session_id, k)

    def floor(self, session, now, block_size):
        return (now - session.next_use(now), session.session_id)


class RecencyCostPolicy(EvictionPolicy):
    """Conversations least recently active first (ascending estimated return probability); inside
    one, cheapest Cost(s, l) first. Conversations are grouped whole in the order (the session id
    comes before the cost), so every conversation loses as many chunks as under LRU; only which of
    its chunks differs, and a partial last chunk (fewer tokens to recompute) can go before a full one."""

    name = "recency_cost"

    def __init__(self, profile: CostProfile | None = None):
        self.profile = profile or CostProfile()

    def by_session(self, tenants):
        return self

    def key(self, session, k, block_size, now):
        cost = self.profile.chunk_cost(k, session.chunk_len(k, block_size), block_size)
        return (now - session.next_use(now), session.session_id, cost, k)

    def floor(self, session, now, block_size):
        return (now - session.next_use(now), session.session_id)


class ReturnAwarePolicy(EvictionPolicy):
    """V = Cost(s, l) * P(returns | idle T): the expected cost of recomputing the chunk. P comes from
    a `ReturnEstimator` fed by the store (observed gaps; sessions idle now as censored), refitted on a
    schedule: before a ranking once `len(sessions) // refit` rankings ran since the last fit (every
    ranking while fewer than `refit` sessions are held), so a fit over every session costs O(refit) a
    ranking, amortised. Ties (e.g. every conversation idle longer than any gap seen has P = 0) go
    least recently active first, cheapest first. Before any gap is observed: Pensieve's Cost(s, l) / T."""

    name = "return_aware"

    def __init__(self, profile: CostProfile | None = None, estimator: ReturnEstimator | None = None,
                 refit: int = 64):
        if refit < 1:
            raise ValueError(f"refit must be >= 1, got {refit}")
        self.profile = profile or CostProfile()
        self.returns = estimator or ReturnEstimator()
        self.refit, self.since_fit = refit, math.inf     # rankings since the last fit

    def observe_return(self, gap):
        self.returns.observe(gap)

    def prepare(self, sessions, now):
        self.since_fit += 1
        if self.since_fit > len(sessions) // self.refit:
            self.returns.fit(now - s.last_active for s in sessions if not s.busy and s.token_ids)
            self.since_fit = 0

    def by_session(self, tenants):
        return self

    def floor(self, session, now, block_size):
        """Cost(s, l) >= Cost(1) / block_size, P(returns | T) never falls as T falls along the walk (nor does
        1 / T), and after the value the key's next parts are the walk's own order; (1 - SLACK): rounding."""
        idle = max(session.next_use(now) - now, 1e-6)
        low = self.profile.cost(1) / block_size
        value = low * self.returns.p_return(idle) if self.returns.fitted else low / idle
        return (value * (1 - SLACK), now - session.next_use(now), session.session_id)

    def key(self, session, k, block_size, now):
        cost = self.profile.chunk_cost(k, session.chunk_len(k, block_size), block_size)
        idle = max(session.next_use(now) - now, 1e-6)
        value = cost * self.returns.p_return(idle) if self.returns.fitted else cost / idle
        return (value, now - session.next_use(now), session.session_id, cost, k)


@dataclass(slots=True)
class _SharedRank:
    """`FairSharePolicy._ranks`' running record of one shared chunk over its holders."""

    at: tuple[ChunkState, str]     # (its state, its tenant)
    k: int                         # its index in every holder
    key: tuple | None = None       # the max of the inner policy's keys over its idle holders
    tokens: int = 0                # tokens of every holder's copy
    busy: bool = False             # a holder is busy: not ranked
    holders: list[str] = field(default_factory=list)


class FairSharePolicy(EvictionPolicy):
    """`inner`'s order, except that tenants above their fair share of a tier lose chunks first.

    For each chunk state (tier) separately, over the chunks stored in it: tenant t's fair share is
    weights[t] / (sum of the weights of the tenants with chunks there) of the tier's stored tokens
    (weight 1 unless configured: equal shares). Each tenant's idle chunks in the tier are walked in
    `inner`'s order with u = the tenant's tokens there not yet walked past:
    - while u > share the chunk is excess: key (0, 0, *inner key), so all tenants' excess goes
      first, in `inner`'s order among itself;
    - after that: key (1, -u / share, *inner key): below its share a tenant's chunk goes before
      another's when its tenant holds more of its share (water-filling), so a tenant at its share
      needing room (the blocks a step takes are not counted until the step has them) takes it from
      itself before a tenant under its share loses anything.
    With one tenant nothing is excess and u decreases along `inner`'s order: the order is `inner`'s.
    Busy sessions' chunks count towards usage but are never ranked (they cannot move). A chunk several
    sessions share (one tenant's: sharing is scoped by tenant) counts once per holder in usage and is
    walked once, at its most valuable holder, where u falls by every holder's copy (it leaves the tier
    for all of them at once); a busy holder keeps it from being ranked."""

    name = "fair_share"

    def __init__(self, inner: EvictionPolicy, weights: Mapping[str, float] | None = None,
                 tenant: Callable[[str], str] = tenant_of):
        bad = {t: w for t, w in (weights or {}).items() if not w > 0}
        if bad:
            raise ValueError(f"tenant weights must be > 0, got {bad}")
        self.inner, self.weights, self.tenant = inner, dict(weights or {}), tenant
        self._sessions: list[Session] = []
        self._now = 0.0
        self._rank: dict[tuple[str, int], tuple[int, float]] | None = {}

    def describe(self) -> str:
        return f"{self.name}({self.inner.describe()})"

    @property
    def profile(self):                 # the inner policy's (its keys are the ones that read it)
        return self.inner.profile

    def use_profile(self, profile):
        self.inner.use_profile(profile)

    def observe_return(self, gap):
        self.inner.observe_return(gap)

    def by_session(self, tenants):     # one tenant: nothing is excess and the order is `inner`'s
        return self.inner.by_session(tenants) if tenants <= 1 else None

    def prepare(self, sessions, now, ranked=None):
        """`ranked`: the sessions whose chunks this ranking keys, holding every chunk of the state ranked
        (None: `sessions`): usage is counted over them, exact for that state (`Placement._ranking`)."""
        self._sessions, self._now = list(sessions if ranked is None else ranked), now
        self.inner.prepare(sessions, now)
        self._rank = None                    # computed at the first key (it needs the block size)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def shares(self, usage: Mapping[str, int]) -> dict[str, float]:
        """Each tenant's fair share of a tier's tokens, from their `usage` there (tokens per tenant)."""
        total, wsum = sum(usage.values()), sum(self.weight(t) for t in usage)
        return {t: total * self.weight(t) / wsum for t in usage}

    @staticmethod
    def rank(used: float, share: float) -> tuple[int, float]:
        """The key's head for a chunk walked when its tenant has `used` tokens not yet walked past."""
        return (0, 0.0) if used > share else (1, -used / share)

    def _ranks(self, block_size: int) -> dict[tuple[str, int], tuple[int, float]]:
        usage: dict[ChunkState, dict[str, int]] = {}
        idle: dict[tuple[ChunkState, str], list[tuple[tuple, list[str], int, int]]] = {}   # (key, holders, k, tokens)
        shared: dict[int, _SharedRank] = {}           # id(shared chunk) -> its ranking, over its holders
        for s in self._sessions:
            t = self.tenant(s.session_id)
            for k, c in enumerate(s.chunks):
                if c.state is ChunkState.DROPPED:
                    continue
                n = s.chunk_len(k, block_size)
                per = usage.setdefault(c.state, {})
                per[t] = per.get(t, 0) + n
                key = self.inner.key(s, k, block_size, self._now) if not s.busy else None
                if c.shared:                   # ranked once, at its most valuable holder, with every copy
                    e = shared.get(id(c))
                    if e is None:
                        e = shared[id(c)] = _SharedRank((c.state, t), k)
                    e.tokens += n
                    e.busy |= s.busy
                    e.holders.append(s.session_id)
                    if key is not None and (e.key is None or key > e.key):
                        e.key = key
                elif not s.busy:
                    idle.setdefault((c.state, t), []).append((key, [s.session_id], k, n))
        for e in shared.values():
            if not e.busy:
                idle.setdefault(e.at, []).append((e.key, e.holders, e.k, e.tokens))
        rank = {}
        for state, per in usage.items():
            for t, share in self.shares(per).items():
                used = per[t]
                for _, ids, k, n in sorted(idle.get((state, t), ()), key=lambda e: e[0]):
                    head = self.rank(used, share)
                    rank.update(((sid, k), head) for sid in ids)
                    used -= n
        return rank

    def key(self, session, k, block_size, now):
        if self._rank is None:
            self._rank = self._ranks(block_size)
        return (*self._rank.get((session.session_id, k), (1, 0.0)), *self.inner.key(session, k, block_size, now))


POLICY_NAMES = ("recency_cost", "return_aware", "pensieve", "lru")
DEFAULT_POLICY = "recency_cost"          # the store's default (SessionStore(policy=None))


def make_policy(name: str, profile: CostProfile | None = None) -> EvictionPolicy:
    """The policy called `name` (one of POLICY_NAMES) over `profile`."""
    if name == "recency_cost":
        return RecencyCostPolicy(profile)
    if name == "return_aware":
        return ReturnAwarePolicy(profile)
    if name == "pensieve":
        return RetentionPolicy(profile)
    if name == "lru":
        return LRUPolicy()
    raise ValueError(f"unknown policy {name!r}; choose from {POLICY_NAMES} or pass an EvictionPolicy")
