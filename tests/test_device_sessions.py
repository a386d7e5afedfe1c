"""The sessions a turn's work looks at: exactly the sessions holding a device block
(`SessionTable.device_sessions`) and, per tier below, its holders least recently active first
(`SessionTable.holding`, `session.py`: `TierIndex`), kept without scanning the idle sessions held
elsewhere, so that making room, counting what a step could get and the ahead-of-time swap-out cost
what they touch, not what the store holds. Over random schedules of turns (a shared system prompt
among them, sessions of one or two tenants), moves between every tier, deletes, cuts and expected
turns (`KVStore.expect`): `check_integrity` (which asserts both indexes are exact), the device room
against a count from the chunk tables alone, and the eviction order of every tier against a full
scan of every session (the oracle) under every policy and fair share, after every operation;
every turn equals stateless greedy generate."""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections import Counter

import pytest
import torch
from conftest import FAMILIES, greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_capacity import reference

from stateful_hf import CapacityError, SessionStore
from stateful_hf.cache import ChunkState
from stateful_hf.cache.eviction.policy import (
    CostProfile,
    FairSharePolicy,
    RetentionPolicy,
    ReturnAwarePolicy,
    make_policy,
)
from stateful_hf.cache.sessions.session import Chunk
from stateful_hf.cache.sessions.tenant import tenant_of

BS = 8
SYSTEM = torch.randint(3, 300, (1, 19), generator=torch.Generator().manual_seed(5))    # 2 full chunks + 3
IDS = ("a", "b", "c", "d", "e", "f")
TENANT_IDS = ("a", "b", "c", "@acme/d", "@acme/e", "@acme/f")     # two tenants: fair share ranks every chunk
MODEL, ORACLE = FAMILIES["llama"](), FAMILIES["llama"]()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def full_scan_victims(store, state: ChunkState, shadowed: bool | None) -> list[tuple[str, int]]:
    """What `Placement.victims` chose before it looked only at device sessions: every idle session's
    chunks in `state`, one per physical chunk, ranked by the policy's key over their holders."""
    sharing, bs = store.sharing, store.block_size
    now = store.clock.now
    store.policy.prepare(store.sessions, now)
    found = sharing.unique((s, k) for s in store.sessions if not s.busy for k, c in enumerate(s.chunks)
                           if c.state is state and (shadowed is None or (c.shadow is not None) == shadowed)
                           and sharing.free_to_move(c, set()))
    found.sort(key=lambda sk: max(store.policy.key(h, sk[1], bs, now) for h in sharing.holders(*sk)))
    return [(s.session_id, k) for s, k in found]


def full_walk_stats(store) -> dict:
    """The token figures of `stats()` from every chunk of every session (what it walked before it read the
    table's counts): physical tokens per state, shadows, logical and shared tokens, sessions."""
    bs, tot, seen = store.block_size, Counter(), set()
    logical = shared = cached = 0
    for s in store.sessions:
        for k, c in enumerate(s.chunks):
            n = s.chunk_len(k, bs)
            logical += n if c.state is not ChunkState.DROPPED else 0
            if id(c) in seen:
                continue
            seen.add(id(c))
            tot[c.state.value] += n
            cached += n if c.shadow is not None else 0
            shared += bs if c.entry is not None and len(c.entry.holders) > 1 else 0
    return {"device_tokens": tot["device"], "host_tokens": tot["host"] + tot["hidden"],
            "disk_tokens": tot["disk"] + tot["disk_hidden"], "dropped_tokens": tot["dropped"],
            "hidden_tokens": tot["hidden"], "layered_tokens": tot["layered"], "device_cached_tokens": cached,
            "logical_tokens": logical, "shared_tokens": shared,
            "sessions": sum(not s.retained for s in store.sessions)}


def stats_figures(store) -> dict:
    st = store.stats()
    return {f: getattr(st, f) for f in full_walk_stats(store)}


def check(store) -> None:
    store.check_integrity()                  # device_sessions() == the sessions holding device blocks
    assert stats_figures(store) == full_walk_stats(store)     # stats() reads counts, not every session
    assert store.room().device_blocks == store.free_blocks() + reference(store, {ChunkState.DEVICE}, True)
    for state, shadowed in ((ChunkState.DEVICE, None), (ChunkState.HOST, True), (ChunkState.HOST, None),
                            (ChunkState.HOST, False), (ChunkState.DISK, None)):
        want = full_scan_victims(store, state, shadowed)
        for n in (1, 3, 10 ** 6):            # a walk stops once it has n: its first n are the scan's first n
            store.clock.now -= 1.0           # victims reads the clock once: the oracle's `now` is that one
            got = [(s.session_id, k) for s, k in store.placement.victims(state, n, set(), shadowed)]
            assert got == want[:n], (state, shadowed, n)


op = st.one_of(
    st.tuples(st.just("turn"), st.sampled_from(IDS), st.integers(1, 12), st.booleans()),
    st.tuples(st.just("move"), st.sampled_from(IDS), st.sampled_from(["host", "device", "disk", "dropped"])),
    st.tuples(st.just("delete"), st.sampled_from(IDS), st.booleans()),
    st.tuples(st.just("cut"), st.sampled_from(IDS), st.integers(0, 30)),
    st.tuples(st.just("expect"), st.sampled_from(IDS), st.integers(0, 20)),     # a tool pause: ranked later
)


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=4, max_size=14), st.integers(0, 2),
       st.sampled_from(["lru", "recency_cost", "pensieve", "return_aware", "fair", "fair_pensieve"]),
       st.booleans(), st.booleans())
def test_device_sessions_are_exact_and_eviction_matches_a_full_scan(ops, tight, policy, tenants, small_host):
    ids = dict(zip(IDS, TENANT_IDS if tenants else IDS))
    with tempfile.TemporaryDirectory() as disk:
        store = SessionStore(MODEL, [96, 160, 4096][tight], host_capacity=48 if small_host else 4096,
                             disk_dir=disk, disk_capacity=4096, chunk_size=BS, clock=Clock(),
                             policy=FairSharePolicy(make_policy("recency_cost" if policy == "fair" else "pensieve"))
                             if policy.startswith("fair") else policy)
        run(store, [(o[0], ids[o[1]], *o[2:]) for o in ops])


def run(store, ops) -> None:
    convs: dict[str, torch.Tensor] = {}
    for o in ops:
        sid = o[1]
        exists = sid in store and store.num_tokens(sid) > 0
        if o[0] == "turn":
            _, _, n, system = o
            head = convs.get(sid, SYSTEM if system else torch.empty((1, 0), dtype=torch.long))
            ids = torch.cat([head, torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(n))], 1)
            out = greedy(MODEL, ids, n=3, cache=store.cache(sid))
            assert torch.equal(out, greedy(ORACLE, ids, n=3)), sid
            convs[sid] = out
        elif o[0] == "move" and exists:
            with contextlib.suppress(ValueError, CapacityError):   # dropped chunks cannot move up; a full tier
                store.move(sid, range(len(store.places(sid))), o[2])
        elif o[0] == "delete" and sid in store.session_ids():
            store.delete(sid, keep_shared=o[2])
            convs.pop(sid, None)
        elif o[0] == "expect" and sid in store:
            store.expect(sid, o[2])
        elif o[0] == "cut" and exists:
            store.truncate(sid, min(o[2], store.num_tokens(sid)))
            convs[sid] = torch.tensor([store.token_ids(sid)], dtype=torch.long)
        check(store)
    store.close()


def test_a_session_missing_from_a_tier_index_is_caught():
    """Negative control: a host-tier holder dropped from its tier's order by hand is never chosen by
    the walk (the full scan still finds it) and `check_integrity` says so."""
    with tempfile.TemporaryDirectory() as disk:
        store = SessionStore(MODEL, 4096, host_capacity=4096, disk_dir=disk, disk_capacity=4096, chunk_size=BS,
                             clock=Clock())
        for sid in ("a", "b"):
            greedy(MODEL, (SYSTEM[:, :12] + ord(sid)) % 300, n=3, cache=store.cache(sid))
            store.move(sid, range(len(store.places(sid))), "host")
        host = ChunkState.HOST
        walked = [(s.session_id, k) for s, k in store.placement.victims(host, 10 ** 6, set())]
        assert walked == full_scan_victims(store, host, None) and {s for s, _ in walked} == {"a", "b"}
        store.sessions.tiers.forget("a", {})
        assert {s.session_id for s, _ in store.placement.victims(host, 10 ** 6, set())} == {"b"}
        assert {s.session_id for s, _ in store.placement.victims(host, 10 ** 6, set(), scan=True)} == {"a", "b"}
        with pytest.raises(AssertionError, match="'a' holds host chunks, unlisted"):
            store.check_integrity()
        store.close()


@pytest.mark.parametrize("name", ["pensieve", "return_aware"])
def test_a_best_first_walk_reads_what_it_takes_and_a_floor_above_the_keys_is_caught(name):
    """Under pensieve and return_aware, keys interleave sessions (chunk 1 of an older one after chunk 0 of a
    newer one); the walk reads the host tier's 40 holders furthest next use first and takes a chunk once it
    is below the next holder's floor: its victims equal the full scan's, and under pensieve the first victim
    reads 2 of the 40 holders (return_aware's floor allows a later holder a 1-token last chunk, Cost(1) / 8
    here: it reads them all, as the scan does). Negative control: a floor above every key (each holder's
    chunks taken as it is read) gives another order."""
    steep = CostProfile(lengths=(8, 16, 24, 32), seconds=(1.0, 2.0, 3.0, 4.0))     # chunk k costs k + 1
    store = SessionStore(MODEL, 4096, host_capacity=4096, chunk_size=BS, clock=Clock(),
                         policy=RetentionPolicy(steep) if name == "pensieve" else ReturnAwarePolicy(steep))
    for i in range(40):
        greedy(MODEL, (SYSTEM[:, :20] + i) % 300, n=3, cache=store.cache(f"s{i}"))
        store.move(f"s{i}", range(len(store.places(f"s{i}"))), "host")
    host, policy = ChunkState.HOST, store.policy
    scanned = full_scan_victims(store, host, None)
    read = []
    policy.floor = lambda s, now, bs, floor=policy.floor: read.append(s.session_id) or floor(s, now, bs)
    store.clock.now -= 1.0
    assert [(s.session_id, k) for s, k in store.placement.victims(host, 10 ** 6, set())] == scanned
    assert [k for _, k in scanned[:3]] == [0, 0, 0]          # the order interleaves sessions
    read.clear()
    store.clock.now -= 1.0
    assert [(s.session_id, k) for s, k in store.placement.victims(host, 1, set())] == scanned[:1]
    assert len(read) == (2 if name == "pensieve" else 40), read    # return_aware's floor allows a 1-token chunk
    policy.floor = lambda s, now, bs: (math.inf,)
    store.clock.now -= 1.0
    assert [(s.session_id, k) for s, k in store.placement.victims(host, 10 ** 6, set())] != scanned
    store.check_integrity()
    store.close()


def test_stats_read_counts_and_a_shared_chunk_left_uncounted_is_caught():
    """`stats()` takes tokens per tier from the table's counts less the extra holders of shared chunks, both
    kept by the table (`TierUsage`: a shared chunk counted once, as its tokens times its holders): equal to a
    walk of every chunk with three sessions sharing a system prompt, moved to the host. Negative control: a move
    of the shared chunks whose recount is lost by hand makes the figures wrong and `check_integrity` says so."""
    store = SessionStore(MODEL, 4096, host_capacity=4096, chunk_size=BS, clock=Clock())
    for sid in ("a", "b", "c"):
        greedy(MODEL, torch.cat([SYSTEM, torch.tensor([[ord(sid)] * 5])], 1), n=3, cache=store.cache(sid))
    store.move("a", range(len(store.places("a"))), "host")
    assert full_walk_stats(store)["shared_tokens"] == 2 * BS
    assert stats_figures(store) == full_walk_stats(store)
    store.check_integrity()
    class Deaf(dict):                              # a recount of a chunk asked for and lost
        def __setitem__(self, key, value):
            pass

    counts = store.sessions._counts
    counts.stale_chunks = Deaf()
    store.move("b", [0, 1], "device")              # the shared chunks move back, uncounted
    store.stats()                                  # (their holders' recounts would ask again: read them now)
    counts.stale_chunks = {}
    assert stats_figures(store) != full_walk_stats(store)
    with pytest.raises(AssertionError, match="usage counts|extra holders"):
        store.check_integrity()
    store.close()


def test_a_shared_chunk_is_listed_once_at_its_most_valuable_holder(monkeypatch):
    """40 sessions share a system prompt's two chunks on the device; the 30 least recently active have moved
    their own chunks to the host. Making room on the device reads 2 holders' floors (the shared chunks are
    listed at their most valuable holder, `TierOrder`'s tops, not by every holder) and takes what a full scan
    takes; the tops are the last holder to finish a turn; the same with the fair share's per-tenant lists
    (`regroup(True)`). Negative control: with `Chunk.shared` false (every holder lists the shared chunks as its
    own, as the per-tenant lists did before) the same walk reads 32 holders."""
    store = SessionStore(MODEL, 4096, host_capacity=4096, chunk_size=BS, clock=Clock())
    for i in range(40):
        ids = torch.cat([SYSTEM, torch.tensor([[5 + i, 6, 7, 8, 9]])], 1)
        assert torch.equal(greedy(MODEL, ids, n=3, cache=store.cache(f"s{i}")), greedy(ORACLE, ids, n=3))
    for i in range(30):
        store.move(f"s{i}", [2, 3], "host")
    shared = store.session("s0").chunks[0]
    assert len(shared.entry.holders) == 40 and shared.state is ChunkState.DEVICE
    tops = store.sessions.tiers.tops[id(shared)]
    assert tops.top[0][1] == "s39" and tops.top[1] is None
    store.check_integrity()
    device, policy = ChunkState.DEVICE, store.policy
    read = []
    policy.floor = lambda s, now, bs, floor=policy.floor: read.append(s.session_id) or floor(s, now, bs)
    for per_tenant, every, reads in ((False, False, 2), (True, False, 2), (False, True, 32)):
        if every:                            # the control: no chunk is shared for the order, listed anew
            monkeypatch.setattr(Chunk, "shared", property(lambda c: False))
            store.sessions.regroup(True)
        store.sessions.regroup(per_tenant)
        if not every:
            store.check_integrity()
        for _ in range(2):                   # the first walk also drops who holds nothing it lists
            read.clear()
            store.clock.now -= 1.0
            got = [(s.session_id, k) for s, k in store.placement.victims(device, 1, set())]
            assert got == full_scan_victims(store, device, None)[:1] and got[0][0] == "s30"
        assert len(read) == reads, (per_tenant, every, read)
    store.close()


def test_the_fair_share_ranks_a_shared_chunk_once_with_every_holders_copy():
    """Two tenants; six of the default tenant's sessions share a system prompt's two chunks, a seventh and the
    other tenant's two share nothing. The fair share counts the shared chunks once per holder (usage) and walks
    them once, at their most valuable holder, where the tenant's tokens not yet walked past fall by all six
    copies: the ranks are those of a hand-written walk of that rule, and `victims` (one walk per tenant over the
    tops) takes what the full scan takes. Negative control: counting one copy there gives other ranks."""
    store = SessionStore(MODEL, 4096, host_capacity=4096, chunk_size=BS, clock=Clock(),
                         policy=FairSharePolicy(make_policy("lru")))
    sids = [f"a{i}" for i in range(1, 7)]
    for i, sid in enumerate(sids):
        ids = torch.cat([SYSTEM, torch.tensor([[5 + i, 6, 7, 8, 9]])], 1)
        assert torch.equal(greedy(MODEL, ids, n=3, cache=store.cache(sid)), greedy(ORACLE, ids, n=3))
    for i, sid in enumerate(("a7", "@acme/b1", "@acme/b2")):
        ids = torch.tensor([[40 + i] * 24])
        assert torch.equal(greedy(MODEL, ids, n=3, cache=store.cache(sid)), greedy(ORACLE, ids, n=3))
    shared = store.session("a1").chunks[:2]
    assert all(len(c.entry.holders) == 6 for c in shared)
    store.check_integrity()
    device, bs, now = ChunkState.DEVICE, store.block_size, store.clock.now
    policy = store.policy
    policy.prepare(store.sessions, now)
    usage = {t: u for (st, t), u in store.sessions.usage().items() if st is device}
    shares = policy.shares(usage)

    def walked(copies: int) -> dict[tuple[str, int], tuple]:
        """The rule by hand: each tenant's chunks in LRU order, a shared chunk at its last holder, u falling by
        its tokens times `copies` there."""
        out = {}
        for t, share in shares.items():
            u = usage[t]
            chunks = sorted(((policy.inner.key(s, k, bs, now), s, k) for s in store.sessions
                             if tenant_of(s.session_id) == t for k, c in enumerate(s.chunks)
                             if c.state is device and (not c.shared or s.session_id == "a6")), key=lambda e: e[0])
            for _, s, k in chunks:
                head = policy.rank(u, share)
                c = s.chunks[k]
                for h in (c.entry.holders if c.shared else (s.session_id,)):
                    out[h, k] = head
                u -= s.chunk_len(k, bs) * (copies if c.shared else 1)
        return out

    ranks = policy._ranks(bs)
    assert ranks == walked(6)
    assert ranks != walked(1)                          # the control: it matters here
    got = [(s.session_id, k) for s, k in store.placement.victims(device, 10 ** 6, set())]
    assert got == full_scan_victims(store, device, None) and len(got) == sum(len(s.chunks) for s in store.sessions) - 10
    store.close()
