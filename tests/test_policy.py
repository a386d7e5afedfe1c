"""Eviction policies and the online return estimator, on the store alone with a fake clock."""

from __future__ import annotations

import random

import pytest

from stateful_hf.cache import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    ChunkState,
    CostProfile,
    EvictionPolicy,
    KVSpec,
    KVStore,
    LRUPolicy,
    RecencyCostPolicy,
    RetentionPolicy,
    ReturnAwarePolicy,
    ReturnEstimator,
    make_policy,
)

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4)
STEEP = CostProfile((4, 8, 16, 32, 64), (1.0, 10.0, 100.0, 1000.0, 10000.0))   # trailing chunks cost far more


def turn(store: KVStore, sid: str, new: list[int], out: int) -> None:
    """One turn as `generate` with a StatefulCache makes it: lease, recompute dropped history, the
    prompt's step, then one step per generated token but the last."""
    store.open(sid)
    with store.lease(sid):
        s = store.session(sid)
        missing = store.missing_positions(sid)
        if missing:
            store.commit(store.plan_step([(sid, [s.token_ids[p] for p in missing], missing)]))
        n = s.num_tokens
        store.commit(store.plan_step([(sid, new, range(n, n + len(new)))]))
        for _ in range(out - 1):
            store.commit(store.plan_step([(sid, [1], [s.num_tokens])]))


def ranking(policy: EvictionPolicy, store: KVStore, now: float) -> list[tuple[str, int]]:
    sessions = [store.session(sid) for sid in store.session_ids()]
    policy.prepare(sessions, now)
    items = [(s, k) for s in sessions for k in range(len(s.chunks))]
    items.sort(key=lambda sk: policy.key(sk[0], sk[1], SPEC.block_size, now))
    return [(s.session_id, k) for s, k in items]


def test_kaplan_meier_treats_idle_sessions_as_censored():
    est = ReturnEstimator()
    assert not est.fitted and est.p_return(0.0) == 0.0
    for gap in (10, 20, 30):
        est.observe(gap)
    est.fit([25, 100])             # idle now: their gaps, if any, are longer than that
    # at risk 5, 4, 2 at the gaps 10, 20, 30: S = 0.8, 0.6, 0.3; the 0.3 past 30 is "never returns"
    assert [est.survival(t) for t in (0, 10, 15, 20, 29.9, 30, 1e9)] == pytest.approx([1, .8, .8, .6, .6, .3, .3])
    assert est.p_return(0) == pytest.approx(0.7)
    assert est.p_return(15) == pytest.approx(0.5 / 0.8)
    assert est.p_return(30) == 0.0 and est.p_return(1e6) == 0.0
    est = ReturnEstimator()
    est.observe(10)
    est.fit([50, 60, 70])          # three conversations idle past every gap seen: most never come back
    assert est.p_return(0) == pytest.approx(0.25)       # ignoring censoring would say 1.0


def test_return_probability_never_increases_with_idle_time():
    rng = random.Random(3)
    est = ReturnEstimator(max_gaps=50)
    for _ in range(200):
        est.observe(rng.expovariate(1 / 30))
    assert est.num_gaps == 50
    est.fit([rng.uniform(0, 300) for _ in range(40)])
    ps = [est.p_return(t) for t in range(0, 400, 2)]
    assert ps[0] > 0.3 and all(a >= b for a, b in zip(ps, ps[1:])) and ps[-1] == 0.0


def test_idle_past_every_gap_ranks_below_recent_whatever_its_cost():
    """A conversation idle longer than any gap observed goes first, even its costliest chunk before the
    cheapest chunk of a recently idle one; Pensieve's Cost / T ranks the other way at these costs."""
    now = [0.0]
    store = KVStore(SPEC, 64, clock=lambda: now[0], policy=ReturnAwarePolicy(STEEP))
    turn(store, "old", [5] * 20, 1)             # 5 chunks, idle from t = 0
    turn(store, "fresh", [5] * 4, 1)
    for t in (90.0, 95.0, 99.0):                # "fresh" comes back: gaps 90, 5 and 4 s
        now[0] = t
        turn(store, "fresh", [6], 1)
    now[0] = 100.0                              # "old" idle 100 s, longer than every gap; "fresh" 1 s
    est = store.policy.returns
    assert est.num_gaps == 3
    order = ranking(store.policy, store, now[0])
    assert order[:5] == [("old", k) for k in range(5)]             # all of "old" first, cheapest first
    assert est.p_return(100.0) == 0.0 and est.p_return(1.0) == pytest.approx(0.75)
    pensieve = ranking(RetentionPolicy(STEEP), store, now[0])
    assert pensieve.index(("fresh", 0)) < pensieve.index(("old", 4))  # Cost(4) / 1 s < Cost(20) / 100 s
    store.check_integrity()


def test_before_any_gap_return_aware_falls_back_to_pensieve():
    now = [0.0]
    store = KVStore(SPEC, 64, clock=lambda: now[0], policy=ReturnAwarePolicy(STEEP))
    turn(store, "a", [5] * 12, 1)               # 3 full chunks
    now[0] = 40.0
    turn(store, "b", [5] * 8, 1)                # 2 full chunks, 40 s later
    now[0] = 50.0
    assert store.policy.returns.num_gaps == 0   # first turns are not returns
    assert ranking(store.policy, store, 50.0) == ranking(RetentionPolicy(STEEP), store, 50.0)


def test_store_reports_gaps_and_prepares_before_ranking():
    class Spy(LRUPolicy):
        def __init__(self):
            self.gaps, self.prepared = [], []

        def observe_return(self, gap):
            self.gaps.append(gap)

        def prepare(self, sessions, now):
            self.prepared.append((now, sorted(s.session_id for s in sessions)))

    now, spy = [0.0], Spy()
    store = KVStore(SPEC, 16, clock=lambda: now[0], policy=spy)     # 4 blocks
    turn(store, "a", [5] * 8, 1)
    now[0] = 7.0
    turn(store, "a", [6], 1)
    now[0] = 9.5
    turn(store, "b", [5] * 8, 1)               # needs room: a ranking
    assert spy.gaps == [7.0]
    assert spy.prepared and spy.prepared[-1] == (9.5, ["a", "b"])
    store.check_integrity()


def test_recency_cost_orders_conversations_as_lru_and_chunks_by_cost():
    now = [0.0]
    store = KVStore(SPEC, 64, clock=lambda: now[0])
    assert isinstance(store.policy, RecencyCostPolicy) and DEFAULT_POLICY == "recency_cost"
    turn(store, "long", [5] * 30, 1)            # chunks 0..6 full, chunk 7 holds 2 tokens
    now[0] = 5.0
    turn(store, "short", [5] * 5, 1)            # chunk 0 full, chunk 1 holds 1 token
    policy = RecencyCostPolicy(STEEP)
    order = ranking(policy, store, 10.0)
    lru = ranking(LRUPolicy(), store, 10.0)
    assert [sid for sid, _ in order] == [sid for sid, _ in lru]    # whole conversations, LRU's order
    assert order[0] == ("long", 0)                                  # Cost(4) is the cheapest of "long"
    assert order[8:] == [("short", 1), ("short", 0)]                # 1 token at l=5 costs less than 4 at l=4
    flat = RecencyCostPolicy(CostProfile((4, 64), (1.0, 1.0)))
    assert ranking(flat, store, 10.0)[0] == ("long", 7)             # flat cost: the 2-token chunk first
    store.sessions.touch(store.session("short"), store.session("long").last_active)
    ids = [sid for sid, _ in ranking(policy, store, 10.0)]
    assert ids == sorted(ids)                                       # a tie in time: still one conversation at a time


def test_recency_cost_drops_as_many_chunks_as_lru_and_never_more_tokens():
    """Same conversations lose the same number of chunks at every turn under both policies (the order
    of conversations is LRU's), so recomputed tokens can only be fewer: partial chunks go first."""
    rng = random.Random(7)
    sched = sorted((rng.uniform(0, 200), f"c{rng.randrange(8)}",
                    [rng.randrange(3, 50) for _ in range(rng.randrange(1, 9))], rng.randrange(1, 12))
                   for _ in range(60))
    stores = {}
    for name in ("lru", "recency_cost"):
        now = [0.0]
        store = KVStore(SPEC, 160, clock=lambda now=now: now[0], policy=make_policy(name))
        dropped = []
        for t, sid, ids, n_out in sched:
            now[0] = t
            turn(store, sid, ids, n_out)
            dropped.append(sorted((s, sum(c.state is ChunkState.DROPPED for c in store.session(s).chunks))
                                  for s in store.session_ids()))
            store.check_integrity()
        stores[name] = (store.counters, dropped)
    (lru, d_lru), (rc, d_rc) = stores["lru"], stores["recency_cost"]
    assert d_lru == d_rc and lru.recomputed > 0
    assert rc.recomputed < lru.recomputed and rc.dropped < lru.dropped


def test_make_policy_names():
    assert [make_policy(n).name for n in POLICY_NAMES] == list(POLICY_NAMES)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fifo")
