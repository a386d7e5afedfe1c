"""A session forked from another (`KVStore.fork`, stateful_hf/cache/prefix/fork.py): the full chunks shared, the
partial last chunk copied to a block of its own. Every turn is checked against stateless greedy generate on the
whole conversation and the store's integrity after it; the copy never aliases the parent's block (appending to
one leaves the other's bytes as they were, the control: the appended one's changed)."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, greedy, store_turn

from stateful_hf.cache import SessionBusyError, StoreError, UnknownSessionError

BS = 8
SYSTEM = torch.randint(3, 300, (1, 43), generator=torch.Generator().manual_seed(7))   # 5 full chunks + 3


def user(seed: int, n: int = 9) -> torch.Tensor:
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(2000 + seed))


@pytest.fixture
def models():
    return FAMILIES["llama"](), FAMILIES["llama"]()


def block_of(store, sid: str, k: int) -> torch.Tensor:
    c = store.session(sid).chunks[k]
    assert c.state.value == "device", c
    return store.tiers.device.data[:, c.loc].clone()


@pytest.mark.parametrize("hidden", [False, True])
def test_a_fork_shares_full_chunks_and_copies_the_partial_one(models, make_store, hidden):
    model, oracle = models
    kw = dict(hidden_states="always", hidden_layers=1) if hidden else {}
    store = make_store(model, device_capacity=1024, host_capacity=1024, chunk_size=BS, **kw)
    a = store_turn(model, oracle, store, "a", SYSTEM)     # 52 tokens stored (the last sampled one is not fed)
    assert store.fork("a", "b") == 52                     # 6 full chunks shared + 4 copied
    assert store.token_ids("b") == a[0, :52].tolist() and store.stats().shared_tokens == 48
    sa, sb = store.session("a"), store.session("b")
    assert all(sa.chunks[k] is sb.chunks[k] for k in range(6)) and sa.chunks[6] is not sb.chunks[6]
    assert sa.chunks[6].loc != sb.chunks[6].loc and store.transfer.issued["duplicated"] == 1
    store.check_integrity()
    before_b, before_a = block_of(store, "b", 6), block_of(store, "a", 6)
    a = store_turn(model, oracle, store, "a", torch.cat([a, user(1)], 1))  # a appends into its partial block
    assert torch.equal(block_of(store, "b", 6), before_b)                # b's copy untouched
    assert not torch.equal(store.tiers.device.data[:, sa.chunks[6].loc], before_a)   # the control: a's changed
    b = torch.cat([SYSTEM, greedy(oracle, SYSTEM)[:, 43:], user(2)], 1)
    store_turn(model, oracle, store, "b", b)
    last = store.stats("b").last_turn
    assert (last.reused_tokens, last.recomputed_tokens, last.computed_tokens) == (52, 0, 1 + 9 + 9), last
    if hidden:                                          # the copy kept the captured hidden states
        store.move("b", [6], "hidden")
        assert store.residency("b")["hidden"] == BS
        store_turn(model, oracle, store, "b", torch.cat([greedy(oracle, b), user(3)], 1))


def test_a_fork_of_a_prompt_prefix_and_its_controls(models, make_store):
    model, oracle = models
    store = make_store(model, device_capacity=1024, chunk_size=BS)
    a = store_turn(model, oracle, store, "a", SYSTEM)
    prompt = torch.cat([a[:, :20], user(4)], 1)                           # shares 20 tokens: 2 full + 4
    assert store.fork("a", "c", prompt[0].tolist()) == 20 and store.num_tokens("c") == 20
    store_turn(model, oracle, store, "c", prompt)
    assert store.stats("c").last_turn.reused_tokens == 20
    with pytest.raises(StoreError, match="exists"):
        store.fork("a", "c")
    with pytest.raises(ValueError, match="tenant"):
        store.fork("a", "@acme/d")
    with pytest.raises(UnknownSessionError):
        store.fork("nobody", "d")
    off = make_store(model, device_capacity=1024, chunk_size=BS, prefix_sharing=False)
    store_turn(model, oracle, off, "a", SYSTEM)
    with pytest.raises(StoreError, match="prefix sharing"):
        off.fork("a", "b")
    assert "b" not in off and "d" not in store
    store.check_integrity()


def test_a_fork_of_a_busy_session_leaves_its_step_in_flight_out(models, make_store):
    """The parent's step planned and not committed appends tokens and fills chunks whose K/V is not written
    yet: the fork takes the history before it; the step then aborts (its blocks freed) and the fork is exact."""
    model, oracle = models
    store = make_store(model, device_capacity=1024, host_capacity=1024, chunk_size=BS, swap_out_threshold=0)
    a = store_turn(model, oracle, store, "a", SYSTEM)
    store.move("a", [6], "dropped")                                       # its partial chunk: no KV
    with store.lease("a"):
        store.begin_turn("a", torch.cat([a, user(5)], 1)[0].tolist())
        hist = store.token_ids("a")
        step = store.plan_step([("a", hist[48:] + user(5)[0].tolist(), list(range(48, 52 + 9)))])
        assert store.session("a").chunks[6].state.value == "device"       # filled in this step: no K/V yet
        assert store.fork("a", "b") == 48 and store.num_tokens("b") == 52  # the dropped partial: recomputed
        store.abort(step)
    assert store.residency("b")["dropped"] == 4
    store.check_integrity()
    store_turn(model, oracle, store, "b", torch.cat([a, user(6)], 1))


def test_forks_freed_moved_and_evicted_stay_consistent(models, make_store):
    model, oracle = models
    store = make_store(model, device_capacity=1024, host_capacity=1024, chunk_size=BS, swap_out_threshold=0)
    a = store_turn(model, oracle, store, "a", SYSTEM)
    for sid in ("b", "c", "d"):
        store.fork("a", sid)
    store.move("b", range(7), "host")                                     # shared chunks move for every holder
    assert store.residency("a")["host"] == 48 and store.residency("a")["device"] == 4
    store.delete("a")
    store.evict("c")
    store.check_integrity()
    for i, sid in enumerate(("b", "c", "d")):
        store_turn(model, oracle, store, sid, torch.cat([a, user(10 + i)], 1))
    store.delete("b")
    store.move("d", range(len(store.session("d").chunks)), "dropped")
    store.check_integrity()
    store_turn(model, oracle, store, "c", torch.cat([a, user(20)], 1))


def test_a_fork_replaces_a_session_in_one_step(models, make_store):
    """`replace=True` (the server continuing a held choice): the session becomes a fork of the chosen one, its
    old chunks freed under the same lock; its next turn reuses the whole fork and computes only its new rows.
    Refused with nothing changed where the session is busy, is the parent itself, or `replace` is not asked."""
    model, oracle = models
    store = make_store(model, device_capacity=1024, chunk_size=BS)
    store_turn(model, oracle, store, "s", SYSTEM)                          # choice 0: 52 tokens
    assert store.fork("s", "f", SYSTEM[0].tolist()) == 43                  # choice 1 from the prompt
    f = store_turn(model, oracle, store, "f", torch.cat([SYSTEM, user(7)], 1))
    mine, theirs = store.token_ids("s"), store.token_ids("f")             # 52 and 61 tokens
    assert mine != theirs[:len(mine)]                                      # not vacuous: other histories
    with pytest.raises(StoreError, match="exists"):
        store.fork("f", "s")
    with pytest.raises(ValueError, match="itself"):
        store.fork("s", "s", replace=True)
    with store.lease("s"), pytest.raises(SessionBusyError):
        store.fork("f", "s", replace=True)
    assert store.token_ids("s") == mine
    assert store.fork("f", "s", replace=True) == 61                        # 7 full chunks shared + 5 copied
    assert store.token_ids("s") == theirs and store.stats().shared_tokens == 56
    store.delete("f")
    store.check_integrity()
    store_turn(model, oracle, store, "s", torch.cat([f, user(8)], 1))
    last = store.stats("s").last_turn
    assert (last.reused_tokens, last.recomputed_tokens, last.computed_tokens) == (61, 0, 1 + 9 + 9), last
