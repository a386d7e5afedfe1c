"""Tenant namespaces in the store's keys, and fair-share eviction, on the store alone (no model)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_policy import turn as policy_turn

from stateful_hf.cache import (
    DEFAULT_TENANT,
    FairSharePolicy,
    KVSpec,
    KVStore,
    LRUPolicy,
    RecencyCostPolicy,
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
