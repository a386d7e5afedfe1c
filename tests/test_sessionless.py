"""Turns without a session id: the engine's throwaway sessions (`Engine.submit(None, ...)`) and the
server's (no `X-Session-Id` / `session_id`; the OpenAI `user` field is not a session)."""

from __future__ import annotations

import pytest
import torch

from stateful_hf import Engine, SamplingParams
from stateful_hf.cache import split_key
from stateful_hf.testing import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def stateless(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_throwaway_session_is_exact_and_deleted(model):
    engine = Engine(model, chunk_size=8)
    ids = list(range(3, 40))
    h = engine.submit(None, ids, SamplingParams(max_new_tokens=5, ignore_eos=True))
    out = h.result()
    assert list(out.token_ids) == stateless(model, ids, 5)
    assert out.session_id == h.session_id and split_key(h.session_id)[0] == "default"
    assert engine.store.session_ids() == []           # deleted; its full chunks stay findable (prefix sharing)
    assert h.session_id not in engine.store or engine.store.session(h.session_id).retained
    engine.store.check_integrity()


def test_throwaway_session_of_a_tenant_and_bad_arguments(model):
    engine = Engine(model, chunk_size=8)
    h = engine.submit(None, [5, 6, 7], SamplingParams(max_new_tokens=2), tenant="acme", cache_salt="s")
    h.result()
    assert split_key(h.session_id)[0] == "acme" and engine.store.session_ids() == []
    with pytest.raises(ValueError, match="tenant"):
        engine.submit("alice", [1, 2], tenant="acme")
    with pytest.raises(ValueError, match="cache_salt"):
        engine.submit("alice", [1, 2], cache_salt="")
    refused = engine.submit(None, [])                      # a bad prompt: refused, nothing is kept
    assert refused.output().error is not None and engine.store.session_ids() == []


def test_many_throwaway_turns_run_together(model):
    engine = Engine(model, chunk_size=8)
    prompts = [list(range(2 + i, 30 + 3 * i)) for i in range(4)]
    handles = [engine.submit(None, p, SamplingParams(max_new_tokens=4, ignore_eos=True)) for p in prompts]
    outs = [h.result() for h in handles]
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == stateless(model, p, 4)
    assert len({h.session_id for h in handles}) == 4 and engine.store.session_ids() == []
    engine.store.check_integrity()


@pytest.fixture(scope="module")
def served():
    """A local server; its tests skip without the web stack (the engine's tests above still run)."""
    for name in ("fastapi", "openai", "httpx"):
        pytest.importorskip(name)
    from stateful_hf.serve import ServerThread, build_local

    app, router = build_local(tiny_llama(), tiny_tokenizer(), "tiny")
    with ServerThread(app) as srv:
        yield srv, router.clients[0].replica.store
    for c in router.clients:
        c.replica.shutdown()


def test_user_field_does_not_name_a_session(served):
    """(runs first on the module's server: nothing shared yet)"""
    import httpx
    import openai

    srv, store = served
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=30, max_retries=0)
    for text in ("First conversation.", "A second, unrelated conversation."):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                           max_tokens=3, temperature=0, user="same-user")
        assert r.usage.prompt_tokens_details.cached_tokens <= r.usage.prompt_tokens
    assert store.session_ids() == []                       # both ran in throwaway sessions, now deleted
    assert httpx.get(srv.url + "/v1/sessions/same-user", timeout=10).status_code == 404
    store.check_integrity()


def test_requests_without_a_session_reuse_a_shared_prompt(served):
    import openai

    srv, store = served
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=30, max_retries=0)
    system = {"role": "system", "content": "You are a careful assistant. " * 12}
    usage = []
    for q in ("What is the tallest mountain?", "Name a river in Africa."):
        r = client.chat.completions.create(model="tiny", messages=[system, {"role": "user", "content": q}],
                                           max_tokens=3, temperature=0)
        usage.append(r.usage)
    assert usage[0].prompt_tokens_details.cached_tokens == 0
    assert usage[1].prompt_tokens_details.cached_tokens >= 64        # the shared system prompt's full chunks
    assert store.session_ids() == []
    store.check_integrity()
