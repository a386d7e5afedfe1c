"""`model.generate` with a StatefulCache: exact against stateless generate on the whole conversation."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import FAMILIES, Conversation, greedy, seed_of

import stateful_hf


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("spelling", ["past_key_values", "cache"])
def test_eight_turns_exact(family, spelling, make_store):
    model, oracle = FAMILIES[family](), FAMILIES[family]()
    store = make_store(model, device_capacity=1024)
    cache = store.cache("alice")
    conv = Conversation(seed=seed_of(family))
    for _ in range(8):
        out = greedy(model, conv.ids, **{spelling: cache})
        assert torch.equal(out, greedy(oracle, conv.ids))
        conv.reply(out)
    st = store.stats("alice")
    assert st.last_turn.reused_tokens > 100 and st.last_turn.recomputed_tokens == 0


def test_interleaved_sessions_on_one_store(make_store):
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    store = make_store(model, device_capacity=2048)
    convs = {f"s{i}": Conversation(seed=i) for i in range(4)}
    for _ in range(4):
        for sid, conv in convs.items():
            out = greedy(model, conv.ids, past_key_values=store.cache(sid))
            assert torch.equal(out, greedy(oracle, conv.ids)), sid
            conv.reply(out)
            store.check_integrity()
    assert store.stats().sessions == 4


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_edit_and_regenerate(family, make_store):
    model, oracle = FAMILIES[family](), FAMILIES[family]()
    store = make_store(model, device_capacity=1024)
    cache = store.cache("a")
    conv = Conversation(seed=3)
    history = []
    for _ in range(4):
        out = greedy(model, conv.ids, cache=cache)
        history.append(conv.ids)
        conv.reply(out)
    # Edit the second user turn: everything after the edit point is cut, the prefix reused.
    edited = history[1].clone()
    edited[0, -3] = (edited[0, -3] + 1) % 300
    out = greedy(model, edited, cache=cache)
    assert torch.equal(out, greedy(oracle, edited))
    last = store.stats("a").last_turn
    assert last.truncated_tokens > 0 and last.reused_tokens == edited.shape[1] - 3
    # Regenerate: the very same prompt again (whole prompt cached) still gives the same answer.
    again = greedy(model, edited, cache=cache)
    assert torch.equal(again, out)
    assert store.stats("a").last_turn.reused_tokens == edited.shape[1] - 1


def test_only_new_tokens_are_computed(make_store):
    model = FAMILIES["llama"]()
    store = make_store(model, device_capacity=1024)
    cache = store.cache("a")
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda m, a, o: seen.append(a[0].shape[-1]))
    conv = Conversation(seed=5)
    for turn in range(4):
        seen.clear()
        out = greedy(model, conv.ids, n=6, cache=cache)
        new_prompt = conv.ids.shape[1] if turn == 0 else conv.turn + 1   # + the uncached last reply token
        assert seen == [new_prompt] + [1] * 5, (turn, seen)
        conv.reply(out)


def test_device_pressure_recomputes_and_stays_exact(make_store):
    model, oracle = FAMILIES["qwen2"](), FAMILIES["qwen2"]()
    store = make_store(model, device_capacity=160)         # 5 blocks for 6 sessions of ~60 tokens
    convs = {f"s{i}": Conversation(seed=10 + i, first=12, turn=8) for i in range(6)}
    recomputed = 0
    for _ in range(3):
        for sid, conv in convs.items():
            out = greedy(model, conv.ids, n=8, cache=store.cache(sid))
            assert torch.equal(out, greedy(oracle, conv.ids, n=8)), sid
            recomputed += store.stats(sid).last_turn.recomputed_tokens
            conv.reply(out)
            store.check_integrity()
    assert recomputed > 0 and store.stats().dropped_tokens > 0


def test_request_larger_than_pool(make_store):
    model = FAMILIES["llama"]()
    store = make_store(model, device_capacity=64)
    cache = store.cache("a")
    greedy(model, torch.arange(3, 20)[None], n=4, cache=cache)
    before = list(store.session("a").token_ids)
    with pytest.raises(stateful_hf.CapacityError, match="device_capacity"):
        greedy(model, torch.arange(3, 103)[None], n=4, cache=cache)
    # the divergent tail was cut, the reusable prefix is intact and nothing leaked
    assert list(store.session("a").token_ids) == before[: len(store.session("a").token_ids)]
    store.check_integrity()


def test_bad_input_leaves_store_intact(make_store):
    model = FAMILIES["opt"]()
    store = make_store(model, device_capacity=512)
    cache = store.cache("a")
    ok = torch.arange(3, 30)[None]
    greedy(model, ok, n=4, cache=cache)
    before = list(store.session("a").token_ids)
    cases = [
        (torch.zeros(1, 0, dtype=torch.long), ValueError, "empty"),
        (torch.tensor([[5, 999999]]), ValueError, "invalid token ids"),
        (torch.tensor([[5, -1]]), ValueError, "invalid token ids"),
        (torch.arange(3, 30).repeat(2, 1), ValueError, "batch size 1"),
        (torch.ones(1, 3000, dtype=torch.long), ValueError, "context"),
        (torch.ones(1, 3), TypeError, "integer"),
    ]
    for ids, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            greedy(model, ids, cache=cache)
        assert list(store.session("a").token_ids) == before
        store.check_integrity()
    with pytest.raises(ValueError, match="padding"):
        greedy(model, ok, cache=cache, attention_mask=torch.cat([torch.zeros(1, 1), torch.ones(1, 26)], 1).long())
    with pytest.raises(ValueError, match="once"):
        greedy(model, ok, cache=cache, past_key_values=store.cache("b"))
    with pytest.raises(stateful_hf.UnknownSessionError):
        store.stats("nobody")
    with store.lease("a"), pytest.raises(stateful_hf.SessionBusyError):
        greedy(model, ok, cache=cache)
    assert list(store.session("a").token_ids) == before


def test_unsupported_model_family():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(stateful_hf.UnsupportedModelError, match="gpt2"):
        stateful_hf.SessionStore(transformers.GPT2LMHeadModel(config))


def test_model_still_works_without_a_stateful_cache(make_store):
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    make_store(model)
    ids = torch.arange(3, 40)[None]
    assert torch.equal(greedy(model, ids), greedy(oracle, ids))
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 2), torch.ones(1, ids.shape[1])], 1).long()
    assert torch.equal(greedy(model, padded, attention_mask=mask), greedy(oracle, padded, attention_mask=mask))


def test_plain_forward_with_cache(make_store):
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    store = make_store(model)
    cache = store.cache("a")
    ids = torch.arange(3, 43)[None]
    with torch.no_grad():
        model(ids[:, :30], past_key_values=cache)
        got = model(ids[:, 30:], past_key_values=cache).logits
        want = oracle(ids).logits[:, 30:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == 40
