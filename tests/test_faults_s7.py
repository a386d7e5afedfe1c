"""Faults found in session 7's review of what session 6 landed (disk-tier prefix sharing, prefix
affinity, the arrival window, sessionless requests). Each test failed before its fix; token output is
checked against stateless greedy generate, and the store's integrity after every turn."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import FAMILIES, greedy, store_turn

import stateful_hf
from stateful_hf import Engine, SamplingParams
from stateful_hf.cache import CapacityError, CostProfile

BS = 8
SHARED = 5 * BS
SYSTEM = torch.randint(3, 300, (1, 43), generator=torch.Generator().manual_seed(7))   # 5 full chunks + 3


def user(seed: int, n: int = 9) -> torch.Tensor:
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(2000 + seed))


exact = partial(store_turn, n=5)    # one exact turn of a session, integrity checked after it


def test_a_turn_on_a_retained_id_is_a_session_again():
    """A session deleted with keep_shared (its prefix retained) whose id takes a turn again: before the
    fix the turn ran in the retained session, which stayed unlisted and uncounted, and the store
    deleted it (its history, its KV) as soon as its chunk 0 left the prefix index."""
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
    """The router's prefix keys start from the scope as the replicas' prefix index encodes it: before
    the fix the seed was f"{tenant}\\0{cache_salt}", so cache_salt None and "None" (two scopes) routed
    by each other's prefixes, and "" and None (one scope) did not."""
    pytest.importorskip("fastapi")                 # the server (stateful_hf.serve) imports the web stack
    from stateful_hf.serve.prefix_affinity import PrefixAffinity

    a = PrefixAffinity(block_tokens=4)
    p = list(range(3, 20))
    assert a.keys(p, "t", None) != a.keys(p, "t", "None")
    assert a.keys(p, "t", "") == a.keys(p, "t", None) != a.keys(p, "t", "x")
    assert a.keys(p, None, None) == a.keys(p, "default", None) != a.keys(p, "t", None)


def test_a_sessions_turns_run_in_submit_order_even_when_the_later_is_short():
    """Two turns queued for one session, a long one then a short one (`on_busy="wait"`: the second
    waits for the first). Before the fix admission took short turns first across sessions AND within
    one: the later turn ran first, and the session kept the earlier turn's conversation, so its next
    turn (continuing the later one) found a divergent history and recomputed it."""
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    engine = Engine(model, chunk_size=BS, device_capacity=1024, max_batch_tokens=64)
    long, short = list(range(3, 103)), list(range(200, 210))
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    h1, h2 = engine.submit("a", long, params), engine.submit("a", short, params)
    while engine.has_work():
        engine.step()
    o1, o2 = h1.output(), h2.output()
    for prompt, out in ((long, o1), (short, o2)):
        assert list(out.token_ids) == greedy(oracle, torch.tensor([prompt]), n=3)[0, len(prompt):].tolist()
    first_token = [o.metrics.arrival_time + o.metrics.ttft for o in (o1, o2)]
    assert first_token[0] < first_token[1]
    assert engine.store.session("a").token_ids == short + list(o2.token_ids[:-1])     # the later turn's
    more = short + list(o2.token_ids) + [7, 8, 9]
    out = engine.submit("a", more, params).result()
    assert list(out.token_ids) == greedy(oracle, torch.tensor([more]), n=3)[0, len(more):].tolist()
    assert out.metrics.recomputed_tokens == 0 and out.metrics.reused_tokens == len(more) - 4
    engine.store.check_integrity()


def test_a_step_that_cannot_get_its_blocks_leaves_no_unrebuilt_chunk():
    """A turn whose chunks are hidden states needs blocks for their rebuild and for its new tokens;
    another session is busy (leased: its blocks cannot be taken), so the rebuild's blocks are found
    and the new tokens' are not: plan_step raises CapacityError. Before the fix the chunks queued for
    the rebuild stayed DEVICE (with a `source`) in blocks that never got their K/V, and the next turn
    read those blocks as the session's KV: wrong tokens. Now they go back to their hidden form."""
    model, oracle = FAMILIES["opt"](), FAMILIES["opt"]()
    store = stateful_hf.SessionStore(model, device_capacity=10 * BS, host_capacity=40 * BS, chunk_size=BS,
                                     cost_profile=CostProfile(), hidden_states="always", hidden_layers=1)
    exact(model, oracle, store, "b", user(10, 36), n=4)
    h = exact(model, oracle, store, "h", user(11, 20), n=4)
    store.move("h", range(len(store.session("h").chunks)), "hidden")
    pool = store.device_pool
    free = torch.tensor(pool.free_ids())
    pool.data[:, free] = torch.randn_like(pool.data[:, free])      # free blocks hold anything
    nxt = torch.cat([h, user(12, 30)], 1)
    with store.lease("b"):
        with pytest.raises(CapacityError):
            greedy(model, nxt, n=3, cache=store.cache("h"))
        assert all(c.state.value == "hidden" and c.source is None for c in store.session("h").chunks)
        store.check_integrity()
    exact(model, oracle, store, "h", nxt, n=3)
    assert store.stats("h").last_turn.restored_hidden == h.shape[1] - 1
    store.close()


def test_no_step_reads_a_shared_chunk_another_step_is_rebuilding():
    """Session a's step is in flight and rebuilds chunks shared with x from hidden states (they are
    DEVICE, their blocks filled layer by layer by a's forward); meanwhile another thread's turn of a
    new session c adopts them. Before the fix c's step read the blocks before a's forward filled
    them: wrong tokens. Now c's step waits for a's step to commit (the store lock released)."""
    import threading

    from stateful_hf.integration import run_step

    model, oracle = FAMILIES["opt"](), FAMILIES["opt"]()
    store = stateful_hf.SessionStore(model, device_capacity=1024, host_capacity=1024, chunk_size=BS,
                                     cost_profile=CostProfile(), hidden_states="always", hidden_layers=1)
    a = exact(model, oracle, store, "a", torch.cat([SYSTEM, user(1)], 1), n=4)
    exact(model, oracle, store, "x", torch.cat([SYSTEM, user(2)], 1), n=4)
    store.move("a", range(5), "hidden")                      # the shared chunks: for x too
    pool = store.device_pool
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
