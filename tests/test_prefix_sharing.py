"""Prefix sharing in the store (stateful_hf/cache/prefix/sharing.py): sessions opening with the same prompt hold
its full chunks once. Every turn is checked against stateless greedy generate on the whole
conversation, and the store's integrity (reference counts against holders) after every change."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import FAMILIES, engine_round_ids, greedy, store_turn

from stateful_hf import Engine, SamplingParams

BS = 8
SYSTEM = torch.randint(3, 300, (1, 43), generator=torch.Generator().manual_seed(7))   # 5 full chunks + 3


def user(seed: int, n: int = 9) -> torch.Tensor:
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(1000 + seed))


turn = store_turn         # one exact turn of a session, integrity checked after it


@pytest.fixture
def models():
    return FAMILIES["llama"](), FAMILIES["llama"]()


def test_sessions_share_a_system_prompt(models, make_store):
    model, oracle = models
    store = make_store(model, device_capacity=1024, chunk_size=BS)
    a = turn(model, oracle, store, "a", torch.cat([SYSTEM, user(1)], 1))
    b_ids = torch.cat([SYSTEM, user(2)], 1)
    turn(model, oracle, store, "b", b_ids)
    assert store.stats("b").last_turn.reused_tokens == 40             # the 5 full chunks of the prompt
    st = store.stats()
    assert st.shared_tokens == 40 and st.logical_tokens == st.device_tokens + 40
    # the shared prefix is kept once: b's own tokens beyond it plus a's
    assert st.device_tokens == store.session("a").num_tokens + store.session("b").num_tokens - 40
    turn(model, oracle, store, "a", torch.cat([a, user(3)], 1))        # a continues over the shared chunks
    c = turn(model, oracle, store, "c", torch.cat([SYSTEM[:, :20], user(4, 30)], 1))   # diverges inside
    assert store.stats("c").last_turn.reused_tokens == 16
    store.delete("a")
    store.check_integrity()
    assert store.stats().shared_tokens == 16                           # b and c still share chunks 0-1
    turn(model, oracle, store, "c", torch.cat([c, user(5)], 1))


def test_edit_inside_the_shared_prefix(models, make_store):
    model, oracle = models
    store = make_store(model, device_capacity=1024, chunk_size=BS)
    a = turn(model, oracle, store, "a", torch.cat([SYSTEM, user(1)], 1))
    turn(model, oracle, store, "b", torch.cat([SYSTEM, user(2)], 1))
    edited = a.clone()
    edited[0, 30] = (edited[0, 30] + 1) % 300          # inside chunk 3 (tokens 24..31), shared with b
    turn(model, oracle, store, "a", edited)
    last, c = store.stats("a").last_turn, store.stats().counters
    # chunks 0-2 kept, and 24..29 too: a's private copy of chunk 3 (copy-on-write), nothing recomputed
    assert (last.reused_tokens, last.recomputed_tokens, c.copied_on_write) == (30, 0, 6)
    assert last.truncated_tokens > 0 and store.transfer.issued["duplicated"] == 1
    turn(model, oracle, store, "b", torch.cat([SYSTEM, user(2), user(6)], 1))   # b's chunk 3 untouched
    turn(model, oracle, store, "a", torch.cat([edited[:, :31], user(7)], 1))    # a's copy, cut again: private


def test_edit_inside_a_shared_chunk_on_the_host_recomputes_its_kept_part(models, make_store):
    """Negative control of copy-on-write: the shared chunk is on the host, so the session lets go of it and
    recomputes its kept part (exact all the same)."""
    model, oracle = models
    store = make_store(model, device_capacity=1024, host_capacity=1024, chunk_size=BS, swap_out_threshold=0)
    a = turn(model, oracle, store, "a", torch.cat([SYSTEM, user(1)], 1))
    turn(model, oracle, store, "b", torch.cat([SYSTEM, user(2)], 1))
    store.move("a", range(5), "host")                     # b's shared chunks go with them
    edited = a.clone()
    edited[0, 30] = (edited[0, 30] + 1) % 300
    turn(model, oracle, store, "a", edited)
    last, c = store.stats("a").last_turn, store.stats().counters
    assert (last.recomputed_tokens, c.copied_on_write, store.transfer.issued["duplicated"]) == (6, 0, 0), last
    turn(model, oracle, store, "b", torch.cat([SYSTEM, user(2), user(6)], 1))


@pytest.mark.parametrize("hidden", [False, True])
def test_engine_edit_inside_a_shared_chunk_copies_on_write(models, make_store, hidden):
    """Through the engine: the edited session's first step recomputes nothing of the chunk it copied
    (admission asks the store again after the cut); with hidden states captured, the copy keeps them, so
    it can move to the hidden tier and come back exact."""
    model, oracle = models
    kw = dict(hidden_states="always", hidden_layers=1) if hidden else {}
    store = make_store(model, device_capacity=1024, host_capacity=1024, chunk_size=BS, **kw)
    engine = Engine(model, store=store)
    convs = {"a": torch.cat([SYSTEM, user(1)], 1), "b": torch.cat([SYSTEM, user(2)], 1)}
    engine_round_ids(engine, oracle, convs, ["a", "b"], 6, lambda sid: user(3))
    convs["a"] = convs["a"][:, :40].clone()
    convs["a"][0, 30] = (convs["a"][0, 30] + 1) % 300       # inside shared chunk 3 (tokens 24..31)
    engine_round_ids(engine, oracle, convs, ["a"], 6, lambda sid: user(4))
    last, c = store.stats("a").last_turn, store.stats().counters
    assert (last.reused_tokens, last.recomputed_tokens, c.copied_on_write) == (30, 0, 6), last
    if hidden:
        store.move("a", [3], "hidden")                      # its captured hidden states came with the copy
        assert store.residency("a")["hidden"] == BS
    engine_round_ids(engine, oracle, convs, ["a", "b"], 6, lambda sid: user(5))
    store.check_integrity()


def test_shared_chunks_move_for_every_holder(models, make_store, tmp_path):
    model, oracle = models
    store = make_store(model, device_capacity=1024, host_capacity=1024, chunk_size=BS,
                       swap_out_threshold=0)
    a = turn(model, oracle, store, "a", torch.cat([SYSTEM, user(1)], 1))
    b = turn(model, oracle, store, "b", torch.cat([SYSTEM, user(2)], 1))
    store.move("a", range(5), "host")                  # the one physical copy: b's are on the host too
    assert store.residency("b")["host"] == 40 and store.stats().host_tokens == 40
    store.check_integrity()
    b = turn(model, oracle, store, "b", torch.cat([b, user(3)], 1))    # swapped in once, for both
    assert store.residency("a")["device"] >= 40
    store.move("b", [0, 1], "dropped")                 # dropped for every holder: both recompute
    store.check_integrity()
    st = store.stats()      # chunks 2-4 stay shared, unfindable until 0-1 are indexed again
    assert store.residency("a")["dropped"] == 16 and st.shared_tokens == 24 and st.prefix_index_chunks == 0
    turn(model, oracle, store, "a", torch.cat([a, user(4)], 1))
    turn(model, oracle, store, "b", torch.cat([b, user(5)], 1))
    assert store.stats().shared_tokens == 40 and store.stats().prefix_index_chunks >= 5
    store.evict("a")
    store.check_integrity()
    turn(model, oracle, store, "b", torch.cat([b, user(5), user(6)], 1))


def test_disk_and_restart_keep_exactness(models, tmp_path):
    import stateful_hf

    model, oracle = models
    opts = dict(device_capacity=1024, chunk_size=BS, disk_dir=tmp_path / "d", disk_capacity=1024)
    store = stateful_hf.SessionStore(model, **opts)
    a = turn(model, oracle, store, "a", torch.cat([SYSTEM, user(1)], 1))
    b = turn(model, oracle, store, "b", torch.cat([SYSTEM, user(2)], 1))
    store.move("a", range(len(store.session("a").chunks)), "disk")   # the shared chunks for b too, once
    store.check_integrity()
    assert store.residency("b")["disk"] == 40 and store.residency("a")["disk"] == store.session("a").num_tokens
    assert store.stats().disk_tokens == store.session("a").num_tokens
    b = turn(model, oracle, store, "b", torch.cat([b, user(3)], 1))
    store.close()
    store = stateful_hf.SessionStore(model, **opts)
    store.check_integrity()
    a = turn(model, oracle, store, "a", torch.cat([a, user(4)], 1))
    turn(model, oracle, store, "b", torch.cat([b, user(5)], 1))
    turn(model, oracle, store, "c", torch.cat([SYSTEM, user(6)], 1))
    assert store.stats("c").last_turn.reused_tokens == 40
    store.close()


def test_cache_salt_and_tenant_scope_sharing(models):
    model, oracle = models
    engine = Engine(model, chunk_size=BS)
    ids = torch.cat([SYSTEM, user(1)], 1)[0].tolist()
    greedy8 = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = greedy(oracle, torch.tensor([ids]), n=6)[0, len(ids):].tolist()

    def reused(sid, salt=None, tenant=None):
        out = engine.submit(sid, ids, greedy8, cache_salt=salt, tenant=tenant).result()
        assert list(out.token_ids) == want
        engine.store.check_integrity()
        return out.metrics.reused_tokens

    assert reused("x") == 0
    assert reused("y") == 48                           # all 6 full chunks of x's prompt
    assert reused("z", salt="s") == 0                  # another salt: another scope
    assert reused("w", salt="s") == 48
    assert reused(None, tenant="other") == 0           # another tenant
    assert reused(None, tenant="other") == 48          # a throwaway session fed the index ...
    assert engine.store.session_ids() == ["x", "y", "z", "w"]          # ... and is gone
    bad = engine.submit("x", ids, greedy8, cache_salt="s")
    with pytest.raises(RuntimeError, match="cache_salt"):      # x was opened without a salt: refused
        bad.result()
    assert isinstance(bad.output().error, ValueError)
    engine.store.check_integrity()


def test_engine_sessions_share_and_stay_exact(models):
    model, oracle = models
    engine = Engine(model, chunk_size=BS, device_capacity=96 * BS)
    convs = {f"s{i}": torch.cat([SYSTEM, user(i)], 1) for i in range(6)}
    for rnd in range(3):
        engine_round_ids(engine, oracle, convs, list(convs), 5, lambda sid, rnd=rnd: user(10 * rnd + int(sid[1:])))
        engine.store.check_integrity()
    st = engine.store.stats()
    assert st.shared_tokens == 40 and st.logical_tokens - st.device_tokens - st.host_tokens >= 5 * 40 - 40


def test_prefix_sharing_off_and_where_it_cannot_be(models, make_store):
    model, oracle = models
    store = make_store(model, device_capacity=1024, chunk_size=BS, prefix_sharing=False)
    turn(model, oracle, store, "a", torch.cat([SYSTEM, user(1)], 1))
    turn(model, oracle, store, "b", torch.cat([SYSTEM, user(2)], 1))
    assert store.stats("b").last_turn.reused_tokens == 0 and store.stats().shared_tokens == 0
    with pytest.raises(ValueError, match="prefix_sharing"):
        make_store(model, device_capacity=1024, chunk_size=BS, layout="virtual", prefix_sharing=True)


def test_hidden_states_of_a_shared_chunk(make_store, tmp_path):
    """A shared chunk kept as hidden states (HCache) is rebuilt once for every holder; on the disk
    tier's hidden file it stays shared (one slot) and comes back once, rebuilt for every holder."""
    import stateful_hf

    model, oracle = FAMILIES["opt"](), FAMILIES["opt"]()
    store = make_store(model, device_capacity=1024, host_capacity=1024, chunk_size=BS, disk_dir=tmp_path / "d",
                       disk_capacity=1024, cost_profile=stateful_hf.cache.CostProfile(), hidden_states="always",
                       hidden_layers=1)
    a = turn(model, oracle, store, "a", torch.cat([SYSTEM, user(1)], 1))
    b = turn(model, oracle, store, "b", torch.cat([SYSTEM, user(2)], 1))
    store.move("b", range(5), "hidden")
    assert store.residency("a")["hidden"] == 40
    a = turn(model, oracle, store, "a", torch.cat([a, user(3)], 1))    # rebuilt by projection, for both
    assert store.stats("a").last_turn.restored_hidden == 40 and store.residency("b")["device"] >= 40
    store.move("a", range(5), "hidden")
    store.move("a", range(5), "disk")                  # DISK_HIDDEN: one slot each, for both
    assert store.residency("b")["disk_hidden"] == 40 and store.residency("a")["disk_hidden"] == 40
    assert store.stats().disk_hidden_tokens == 40
    turn(model, oracle, store, "b", torch.cat([b, user(4)], 1))
    assert store.stats("b").last_turn.restored_hidden == 40 and store.residency("a")["device"] >= 40
    turn(model, oracle, store, "a", torch.cat([a, user(5)], 1))
    assert store.stats("a").last_turn.recomputed_tokens == 0


def test_engine_under_device_pressure_with_a_shared_prompt(models):
    """Many sessions, one system prompt, a device that holds a few of them: the policy moves chunks
    down and drops them (a shared chunk only when no holder runs); every answer stays exact."""
    model, oracle = models
    engine = Engine(model, chunk_size=BS, device_capacity=24 * BS, host_capacity=24 * BS, max_batch_tokens=64)
    convs = {f"s{i}": torch.cat([SYSTEM, user(i)], 1) for i in range(8)}
    for rnd in range(3):
        engine_round_ids(engine, oracle, convs, list(convs), 4, lambda sid, rnd=rnd: user(10 * rnd + int(sid[1:])))
        engine.store.check_integrity()
    c = engine.store.stats().counters
    assert c.swapped_out_host + c.dropped > 0                       # there was pressure


OPS = st_ops = None
try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    OPS = st.lists(st.tuples(st.sampled_from(["turn", "new", "edit", "move", "delete", "evict"]),
                             st.integers(0, 3), st.integers(0, 60), st.sampled_from(["device", "host", "hidden",
                                                                                       "disk", "dropped"])),
                   min_size=3, max_size=9)
except ImportError:      # pragma: no cover
    pass


@pytest.mark.skipif(OPS is None, reason="needs hypothesis")
def test_random_operations_stay_exact_and_consistent(tmp_path_factory):
    """Sessions opening with one of two prompts take turns, are edited, moved to any tier, evicted and
    deleted in a random order: every turn is exact and the store's integrity holds after each step."""
    import stateful_hf

    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    prompts = [SYSTEM, torch.cat([SYSTEM[:, :21], user(99, 30)], 1)]

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(ops=OPS)
    def run(ops):
        store = stateful_hf.SessionStore(model, device_capacity=40 * BS, host_capacity=40 * BS, chunk_size=BS,
                                         disk_dir=tmp_path_factory.mktemp("d"), disk_capacity=40 * BS,
                                         cost_profile=stateful_hf.cache.CostProfile(), hidden_states="always",
                                         hidden_layers=1)
        convs: dict[str, torch.Tensor] = {}
        try:
            for i, (op, who, n, tier) in enumerate(ops):
                sid = f"s{who}"
                if op == "new" or (op == "turn" and sid not in convs):
                    ids = torch.cat([prompts[who % 2], user(100 * i + who)], 1)
                elif op == "turn":
                    ids = torch.cat([convs[sid], user(100 * i + who)], 1)
                elif op == "edit" and sid in convs:
                    ids = convs[sid][:, : 1 + n % convs[sid].shape[1]].clone()
                    ids[0, -1] = 3 + (int(ids[0, -1]) + 1) % 290
                    ids = torch.cat([ids, user(100 * i)], 1)
                else:
                    if sid in store.session_ids():
                        s = store.session(sid)
                        if op == "move":
                            ks = [k for k in range(len(s.chunks)) if (k + n) % 3 == 0]
                            with contextlib.suppress(ValueError):   # e.g. K/V chunks cannot become hidden
                                store.move(sid, ks, tier)
                        elif op == "evict":
                            store.evict(sid)
                        elif op == "delete":
                            store.delete(sid)
                            convs.pop(sid)
                    store.check_integrity()
                    continue
                if op == "new" and sid in store.session_ids():
                    store.delete(sid)
                convs[sid] = turn(model, oracle, store, sid, ids)
        finally:
            store.close()

    run()
