"""Tenant namespaces in the store's keys, and fair-share eviction, on the store alone (no model)."""

from __future__ import annotations

import contextlib
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_policy import turn as policy_turn

from stateful_hf.cache import (
    DEFAULT_TENANT,
    CapacityError,
    ChunkState,
    FairSharePolicy,
    KVSpec,
    KVStore,
    LRUPolicy,
    RecencyCostPolicy,
    RetentionPolicy,
    ReturnAwarePolicy,
    TenantUsage,
    session_key,
    split_key,
)

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4)
tenants = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,10}", fullmatch=True) | st.just(DEFAULT_TENANT)
sids = st.text(min_size=1, max_size=12) | st.sampled_from(["@", "@x", "@x/y", "@default/a", "a/b", "@@a/b"])


@given(tenants, sids, tenants, sids)
def test_keys_round_trip_and_never_collide(t1, s1, t2, s2):
    k1, k2 = session_key(t1, s1), session_key(t2, s2)
    assert split_key(k1) == (t1, s1) and split_key(k2) == (t2, s2)
    assert (k1 == k2) == ((t1, s1) == (t2, s2))


def test_key_shapes_and_bad_tenants():
    assert session_key("default", "alice") == "alice"            # the default tenant keeps plain ids
    assert session_key("acme", "alice") == "@acme/alice"
    assert session_key("default", "@acme/alice") == "@default/@acme/alice"
    assert split_key("plain/id") == (DEFAULT_TENANT, "plain/id")
    for bad in ("", "a/b", "@a", "x" * 65, "-a", "a b"):
        with pytest.raises(ValueError, match="tenant names"):
            session_key(bad, "s")
    with pytest.raises(ValueError, match="session id"):
        session_key("acme", "")


def turn(store: KVStore, sid: str, tokens: int) -> None:
    """One turn of `tokens` new tokens (recomputing dropped history first, as a real turn would)."""
    policy_turn(store, sid, [1] * tokens, 1)


def flood(policy, b_sessions: int = 2) -> KVStore:
    """Tenant B keeps `b_sessions` sessions of 8 tokens; then tenant A opens 30 sessions of 8 tokens
    in a store of 64 device tokens; then B's sessions are looked at (no turn ran since)."""
    t = [0.0]
    store = KVStore(SPEC, device_capacity=64, policy=policy, clock=lambda: t[0])
    for i in range(b_sessions):
        t[0] += 1
        turn(store, session_key("b", f"s{i}"), 8)
    for i in range(30):
        t[0] += 1
        turn(store, session_key("a", f"s{i}"), 8)
    store.check_integrity()
    return store


@pytest.mark.parametrize("inner", [LRUPolicy, RecencyCostPolicy])
def test_one_tenant_flooding_cannot_evict_another(inner):
    """Under the plain policy B's two older sessions are dropped by A's flood; under the fair-share
    wrapper B keeps every token on the device (B is under its half of the tier) and A evicts itself."""
    plain = flood(inner())
    assert all(plain.residency(session_key("b", f"s{i}"))["device"] == 0 for i in range(2))
    fair = flood(FairSharePolicy(inner()))
    for i in range(2):
        sid = session_key("b", f"s{i}")
        assert fair.residency(sid)["device"] == 8 and fair.missing_positions(sid) == []
    usage = fair.tenant_usage()
    assert usage["b"] == TenantUsage(sessions=2, history_tokens=16, stored_tokens=16)
    assert usage["a"].sessions == 30 and usage["a"].history_tokens == 240
    assert usage["a"].stored_tokens == 64 - 16              # A holds the rest of the device, no more
    assert fair.stats().counters.dropped == 30 * 8 - 48


def test_fair_share_weights_and_single_tenant_order():
    """One tenant: the wrapper changes nothing. Weights split a tier unequally: with b weighted 3:1,
    b keeps 3/4 of the device while a floods, less one chunk: when both are exactly at their share
    (a tie) the inner order picks once; from then on a is above its share."""
    t = [0.0]
    store = KVStore(SPEC, device_capacity=64, policy=LRUPolicy(), clock=lambda: t[0])
    for i in range(5):
        t[0] += 1
        turn(store, f"s{i}", 8)
    inner, fair = LRUPolicy(), FairSharePolicy(LRUPolicy())
    sessions = [store.session(s) for s in store.session_ids()]
    fair.prepare(sessions, t[0])
    items = [(s, k) for s in sessions for k in range(len(s.chunks))]
    order = sorted(items, key=lambda sk: inner.key(*sk, 4, t[0]))
    assert sorted(items, key=lambda sk: fair.key(*sk, 4, t[0])) == order
    with pytest.raises(ValueError, match="weights"):
        FairSharePolicy(LRUPolicy(), {"a": 0})

    usage = flood(FairSharePolicy(LRUPolicy(), {"b": 3}), b_sessions=6).tenant_usage()
    assert usage["b"].stored_tokens >= 48 - 4 and usage["a"].stored_tokens <= 16 + 4
    assert sum(u.stored_tokens for u in usage.values()) == 64


def test_tenants_survive_a_restart_in_the_disk_index(tmp_path):
    """The tenant is part of the key the disk index records: a reopened store knows whose each session is."""
    keys = [session_key("a", "s"), session_key("b", "s"), "s", session_key("default", "@a/s")]
    store = KVStore(SPEC, 64, disk_dir=tmp_path, disk_capacity=64, policy=LRUPolicy())
    for i, key in enumerate(keys):
        turn(store, key, 5 + i)
        store.move(key, range(len(store.session(key).chunks)), "disk")
    before = store.tenant_usage()
    assert before == {"a": TenantUsage(1, 5, 5), "b": TenantUsage(1, 6, 6), "default": TenantUsage(2, 15, 15)}
    store.close()
    again = KVStore(SPEC, 64, disk_dir=tmp_path, disk_capacity=64, policy=LRUPolicy())
    assert sorted(split_key(k) for k in again.session_ids()) == sorted(
        [("a", "s"), ("b", "s"), ("default", "s"), ("default", "@a/s")])
    assert again.tenant_usage() == before
    assert all(again.residency(k)["disk"] == again.session(k).num_tokens for k in keys)
    again.check_integrity()
    again.close()


def _fair_store(disk: str, inner, weights=None, device: int = 16, **kw) -> tuple[KVStore, list[float]]:
    t = [0.0]
    return KVStore(SPEC, device_capacity=device, host_capacity=96, disk_dir=disk, disk_capacity=512,
                   policy=FairSharePolicy(inner(), weights), clock=lambda: t[0], **kw), t


def _victims(store: KVStore, state, n: int, exclude: set[str], shadowed=None, scan: bool = False) -> list:
    return [(s.session_id, k) for s, k in store.placement.victims(state, n, exclude, shadowed, scan=scan)]


@pytest.mark.parametrize("inner", [LRUPolicy, RecencyCostPolicy])
def test_fair_walk_below_the_device_puts_the_flooding_tenant_first(inner, tmp_path):
    """Negative control for the walk: on the host tier, b's two sessions are older, so the inner policy
    alone would take them first; fair share takes a's (above its half of the tier) first, and the per-tenant
    walk (`cache/eviction/fair_walk.py`) chooses exactly as the full scan does."""
    store, t = _fair_store(str(tmp_path), inner)
    for sid in [session_key("b", f"s{i}") for i in range(2)] + [session_key("a", f"s{i}") for i in range(10)]:
        t[0] += 1
        turn(store, sid, 8)
        store.move(sid, range(len(store.session(sid).chunks)), "host")
    host = ChunkState.HOST
    walked, scanned = _victims(store, host, 10 ** 6, set()), _victims(store, host, 10 ** 6, set(), scan=True)
    assert walked == scanned and len(walked) == 12 * 2
    assert {split_key(s)[0] for s, _ in walked[:12]} == {"a"}          # a's excess first
    plain = sorted(((s, k) for s in store.session_ids() for k in range(2)),
                   key=lambda sk: inner().key(store.session(sk[0]), sk[1], 4, t[0]))
    assert split_key(plain[0][0])[0] == "b" and walked != plain       # the inner order alone: b first
    store.check_integrity()
    store.close()


SIDS = [session_key(t, f"s{i}") for t in ("a", "b", "default") for i in range(3)]
fair_ops = st.lists(st.tuples(st.sampled_from(SIDS), st.integers(1, 8),
                              st.sampled_from(["turn", "turn", "host", "disk", "delete", "expect"])),
                    min_size=4, max_size=20)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fair_ops, st.sampled_from([LRUPolicy, RecencyCostPolicy, RetentionPolicy, ReturnAwarePolicy]),
       st.sampled_from([None, {"b": 3.0}]))
def test_fair_walk_matches_a_full_scan(ops, inner, weights):
    """Over random schedules of three tenants' turns, moves, deletes and expected turns, every tier below
    the device and the device's cached shadows of host chunks: the per-tenant walk's victims equal the full
    scan's (any n, with and without an excluded session), and `check_integrity` (the table's token counts
    against a full count) holds."""
    with tempfile.TemporaryDirectory() as disk:
        # swapped out ahead as soon as idle: host chunks keep device shadows (the shadows' victims are checked)
        store, t = _fair_store(disk, inner, weights, device=256, swap_out_threshold=0.9)
        for sid, n, op in ops:
            t[0] += 1
            if op == "turn":
                turn(store, sid, n)
            elif op in ("host", "disk") and sid in store.session_ids():
                with contextlib.suppress(ValueError, CapacityError):
                    store.move(sid, range(len(store.session(sid).chunks)), op)
            elif op == "delete" and sid in store.session_ids():
                store.delete(sid)
            elif op == "expect" and sid in store.session_ids():
                store.expect(sid, n)
            store.check_integrity()
            for state, shadowed in ((ChunkState.HOST, None), (ChunkState.HOST, False), (ChunkState.HOST, True),
                                    (ChunkState.DISK, None)):
                want = _victims(store, state, 10 ** 6, set(), shadowed, scan=True)
                for n_ in (1, 3, 10 ** 6):
                    assert _victims(store, state, n_, set(), shadowed) == want[:n_], (state, n_)
                assert _victims(store, state, 4, {sid}, shadowed) == _victims(store, state, 4, {sid}, shadowed,
                                                                               scan=True)
        store.close()


def test_a_change_the_table_is_not_told_of_is_caught(tmp_path):
    """Negative control of the table's token counts: a history grown behind its back (no `recount`) fails
    `check_integrity`; told (`recount`), it holds again, and tenant_usage follows."""
    from stateful_hf.cache.sessions.session import Chunk

    store, t = _fair_store(str(tmp_path), LRUPolicy, device=64)
    turn(store, session_key("a", "s"), 8)
    store.check_integrity()                    # counted
    s = store.session(session_key("a", "s"))
    s.token_ids.extend([1] * 4)
    s.chunks.append(Chunk())                   # 4 more tokens, DROPPED: a valid table, uncounted
    with pytest.raises(AssertionError, match="usage counts"):
        store.check_integrity()
    store.sessions.recount(s.session_id)
    store.check_integrity()
    assert store.tenant_usage()["a"] == TenantUsage(sessions=1, history_tokens=12, stored_tokens=8)
    store.close()


def test_a_policy_set_later_regroups_the_tier_order(tmp_path):
    """The server sets the fair share after the store is made: the tier order is then grouped per tenant
    (and back when the policy changes again), and the walks choose as the full scan does throughout."""
    store = KVStore(SPEC, device_capacity=16, host_capacity=96, disk_dir=str(tmp_path), disk_capacity=512,
                    policy=LRUPolicy(), clock=lambda: 0.0)
    for sid in [session_key("b", f"s{i}") for i in range(2)] + [session_key("a", f"s{i}") for i in range(6)]:
        turn(store, sid, 8)
        store.move(sid, range(len(store.session(sid).chunks)), "host")
    host = ChunkState.HOST
    for policy, grouped in ((FairSharePolicy(LRUPolicy()), True), (RecencyCostPolicy(), False)):
        store.policy = policy
        assert store.sessions.tiers.per_tenant is grouped
        store.check_integrity()
        assert _victims(store, host, 10 ** 6, set()) == _victims(store, host, 10 ** 6, set(), scan=True)
    store.close()
