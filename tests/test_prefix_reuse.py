"""When a turn may reuse a shared prefix: a session id whose prefix was retained, a throwaway key under
another `cache_salt`, the router's prefix keys per scope (tenant, `cache_salt`), and chunks another
step is still rebuilding from hidden states. Token output is checked against stateless greedy
generate, and the store's integrity after every turn."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import FAMILIES, greedy, store_turn

import stateful_hf
from stateful_hf import Engine, SamplingParams
from stateful_hf.cache import CostProfile

BS = 8
SHARED = 5 * BS
SYSTEM = torch.randint(3, 300, (1, 43), generator=torch.Generator().manual_seed(7))   # 5 full chunks + 3


def user(seed: int, n: int = 9) -> torch.Tensor:
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(2000 + seed))


exact = partial(store_turn, n=5)    # one exact turn of a session, integrity checked after it


def test_a_turn_on_a_retained_id_is_a_session_again():
    """A session deleted with keep_shared (its prefix retained) whose id takes a turn again is a listed,
    counted session that reuses what matches of the retained prefix, and it outlives its chunk 0
    leaving the prefix index (a retained session would be deleted then, its history and KV with it)."""
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    store = stateful_hf.SessionStore(model, device_capacity=1024, chunk_size=BS, cost_profile=CostProfile())
    exact(model, oracle, store, "a", torch.cat([SYSTEM, user(1)], 1))
    store.delete("a", keep_shared=True)
    assert store.session_ids() == [] and store.stats().prefix_index_chunks == 7
    conv = exact(model, oracle, store, "a", torch.cat([SYSTEM[:, :20], user(2, 14)], 1))   # a new conversation
    assert store.session_ids() == ["a"] and store.tenant_usage()["default"].sessions == 1
    assert store.stats("a").last_turn.reused_tokens == 20          # what matched of the retained prefix
    store.move("a", [0], "dropped")                                  # chunk 0 leaves the index
    store.maintain()
    assert store.session_ids() == ["a"] and store.session("a").num_tokens == conv.shape[1] - 1
    exact(model, oracle, store, "a", torch.cat([conv, user(3)], 1))
    assert store.stats("a").last_turn.recomputed_tokens == BS        # only the dropped chunk
    store.close()


def test_a_throwaway_key_submitted_again_under_another_salt():
    """`Engine.throwaway_session()`'s key, submitted with once (deleted when that turn ended, its prompt
    retained), then again under another cache_salt: the second turn is a new session of that scope,
    not a refusal ("opened with cache_salt") nor a continuation of the retained prefix's scope."""
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    engine = Engine(model, chunk_size=BS, device_capacity=1024)
    key = engine.throwaway_session()
    ids = torch.cat([SYSTEM, user(4)], 1)[0].tolist()
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    want = greedy(oracle, torch.tensor([ids]), n=5)[0, len(ids):].tolist()
    assert list(engine.submit(key, ids, params).result().token_ids) == want
    assert engine.store.session_ids() == [] and engine.store.session(key).retained
    out = engine.submit(key, ids, params, cache_salt="s").result()
    assert out.error is None and list(out.token_ids) == want and out.metrics.reused_tokens == 0
    assert engine.store.session_ids() == [key]
    engine.store.check_integrity()
    out = engine.submit("b", ids, params, cache_salt="s").result()    # the new scope shares its prompt
    assert list(out.token_ids) == want and out.metrics.reused_tokens == 48
    engine.store.check_integrity()


def test_prefix_affinity_keys_are_the_replicas_scopes():
    """The router's prefix keys start from the scope as the replicas' prefix index encodes it: cache_salt
    None and "None" are two scopes, "" and None one, and tenant None is "default" (a seed such as
    f"{tenant}\\0{cache_salt}" would route None and "None" by each other's prefixes)."""
    pytest.importorskip("fastapi")                 # the server (stateful_hf.serve) imports the web stack
    from stateful_hf.serve.prefix_affinity import PrefixAffinity

    a = PrefixAffinity(block_tokens=4)
    p = list(range(3, 20))
    assert a.keys(p, "t", None) != a.keys(p, "t", "None")
    assert a.keys(p, "t", "") == a.keys(p, "t", None) != a.keys(p, "t", "x")
    assert a.keys(p, None, None) == a.keys(p, "default", None) != a.keys(p, "t", None)


def test_no_step_reads_a_shared_chunk_another_step_is_rebuilding():
    """Session a's step is in flight and rebuilds chunks shared with x from hidden states (they are
    DEVICE, their blocks filled layer by layer by a's forward); meanwhile another thread's turn of a
    new session c adopts them. c's step waits for a's step to commit (the store lock released); read
    before a's forward filled them, the blocks would give wrong tokens."""
    import threading

    from stateful_hf.integration.hooks import run_step

    model, oracle = FAMILIES["opt"](), FAMILIES["opt"]()
    store = stateful_hf.SessionStore(model, device_capacity=1024, host_capacity=1024, chunk_size=BS,
                                     cost_profile=CostProfile(), hidden_states="always", hidden_layers=1)
    a = exact(model, oracle, store, "a", torch.cat([SYSTEM, user(1)], 1), n=4)
    exact(model, oracle, store, "x", torch.cat([SYSTEM, user(2)], 1), n=4)
    store.move("a", range(5), "hidden")                      # the shared chunks: for x too
    pool = store.tiers.device
    free = torch.tensor(pool.free_ids())
    pool.data[:, free] = torch.randn_like(pool.data[:, free])      # free blocks hold anything
    nxt = torch.cat([a, user(3)], 1)[0].tolist()
    ids = torch.cat([SYSTEM, user(4)], 1)
    got = {}
    with store.lease("a"):
        store.begin_turn("a", nxt)
        n = store.session("a").num_tokens
        step = store.plan_step([("a", nxt[n:], list(range(n, len(nxt))))])      # a's step in flight
        assert store.session("x").chunks[0].source is not None
        c = threading.Thread(target=lambda: got.setdefault("c", greedy(model, ids, n=4, cache=store.cache("c"))))
        c.start()
        c.join(0.5)
        assert c.is_alive()                                   # waiting for a's step
        with torch.inference_mode():
            run_step(model, step)
        store.commit(step)
    c.join(60)
    assert torch.equal(got["c"], greedy(oracle, ids, n=4))
    assert store.stats("c").last_turn.reused_tokens == SHARED
    store.check_integrity()
    store.close()
