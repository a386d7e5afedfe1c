"""API keys, tenant namespaces and limits of the server, over HTTP on 127.0.0.1 with the `openai` client."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from stateful_hf import Engine, SamplingParams  # noqa: E402
from stateful_hf.cache import session_key  # noqa: E402
from stateful_hf.serve import LocalClient, Replica, Router, ServerThread, build_local  # noqa: E402
from stateful_hf.serve.auth import Access, KeyRing  # noqa: E402
from stateful_hf.serve.limits import Limits  # noqa: E402
from stateful_hf.serve.server import EngineOptions  # noqa: E402
from stateful_hf.testing import tiny_llama, tiny_tokenizer  # noqa: E402

MODEL = "tiny"
KEY_A, KEY_B, METRICS_KEY = "key-of-tenant-a-0123456789", "key-of-tenant-b-0123456789", "metrics-key-0123456789"


def _client(url: str, key: str):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, timeout=60, max_retries=0)


def _chat(client, sid: str, messages: list[dict], max_tokens: int = 5, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body={"session_id": sid}, **kw)


def _serve(tmp_path, limits: Limits | None = None, options: EngineOptions | None = None):
    keys = tmp_path / "keys"
    keys.write_text(f"# key tenant\n{KEY_A} a\n{KEY_B} b\n")
    access = Access(KeyRing(keys_file=keys), METRICS_KEY, limits or Limits())
    app, router = build_local(tiny_llama(), tiny_tokenizer(), MODEL, options, access=access)
    return ServerThread(app).start(), router


def _stop(srv, router) -> None:
    srv.stop()
    for c in router.clients:
        c.replica.shutdown()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    srv, router = _serve(tmp_path_factory.mktemp("keys"))
    yield srv, router.clients[0].replica.store
    _stop(srv, router)


def _error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


def test_missing_or_wrong_key_is_401(served):
    srv, _ = served
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError):
        _chat(_client(srv.url, "not-a-key"), "s", msgs)
    with pytest.raises(openai.AuthenticationError):
        _client(srv.url, KEY_A + "x").models.list()
    body = {"model": MODEL, "messages": msgs}
    for path, method in (("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/hints", "POST"),
                         ("/v1/models", "GET"), ("/v1/nothing", "GET"), ("/openapi.json", "GET")):
        r = httpx.request(method, srv.url + path, json=body, timeout=10)
        _error(r, 401, "missing_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Basic " + KEY_A}, timeout=10)
    _error(r, 401, "missing_api_key")
    assert KEY_A not in httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {KEY_A}z"}).text
    assert httpx.get(srv.url + "/health", timeout=10).json()["status"] == "ok"            # open
    assert httpx.get(srv.url + "/ping", timeout=10).status_code == 200                    # open: a probe sends no key
    for path in ("/version", "/tokenize"):                                                # vLLM's others need one
        _error(httpx.request("GET" if path == "/version" else "POST", srv.url + path, json={"prompt": "a"},
                             timeout=10), 401, "missing_api_key")
    _error(httpx.get(srv.url + "/metrics", timeout=10), 401, "missing_api_key")
    _error(httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY_A}"}), 401, "invalid_api_key")
    ok = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}, timeout=10)
    assert ok.status_code == 200 and "stateful_hf_" in ok.text
    assert [m.id for m in _client(srv.url, KEY_B).models.list().data] == [MODEL]


def test_same_session_id_under_two_keys_is_two_sessions(served):
    """Tenant B sends tenant A's session id (a different conversation, a hint): A's session is not
    touched, and A's next turn reuses all of its history."""
    srv, store = served
    a, b = _client(srv.url, KEY_A), _client(srv.url, KEY_B)
    reference, tok = Engine(tiny_llama(), tiny_tokenizer()), tiny_tokenizer()
    msgs = [{"role": "user", "content": "Hello! Tell me about the sea and the mountains."}]
    first = _chat(a, "shared", msgs)
    want = reference.submit("x", msgs, SamplingParams(max_new_tokens=5)).result()
    assert first.choices[0].message.content == want.text
    key_a = session_key("a", "shared")
    history = list(store.session(key_a).token_ids)
    residency = store.residency(key_a)
    # B: same id, another conversation; then a hint and a streamed turn of "shared"
    other = [{"role": "user", "content": "Something else entirely."}]
    rb = _chat(b, "shared", other)
    assert rb.usage.prompt_tokens_details.cached_tokens == 0          # nothing of A's was B's
    hb = httpx.post(srv.url + "/v1/hints", json={"session_id": "shared"}, headers={"Authorization": f"Bearer {KEY_B}"})
    assert hb.status_code == 200 and hb.json()["session_id"] == "shared"
    with httpx.stream("POST", srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_B}",
                      "X-Session-Id": "shared"}, json={"model": MODEL, "messages": other + [
                          {"role": "assistant", "content": rb.choices[0].message.content},
                          {"role": "user", "content": "More."}], "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["x-session-id"] == "shared"     # the caller's id, not the key
        assert list(r.iter_lines())[-2] == "data: [DONE]"
    assert list(store.session(key_a).token_ids) == history and store.residency(key_a) == residency
    assert {key_a, session_key("b", "shared")} <= set(store.session_ids())
    # A's next turn: all of the history is reused
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "And?"}]
    ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    common = next((k for k, (x, y) in enumerate(zip(history, ids)) if x != y), min(len(history), len(ids)))
    second = _chat(a, "shared", msgs)
    assert second.usage.prompt_tokens_details.cached_tokens == min(common, len(ids) - 1) > 0
    assert second.choices[0].message.content == reference.submit(
        "y", msgs, SamplingParams(max_new_tokens=5)).result().text
    assert store.session(key_a).last_turn.recomputed_tokens == 0
    # the default tenant's plain ids cannot name a tenant's key either
    assert set(store.tenant_usage()) == {"a", "b"}
    store.check_integrity()


def test_cache_salt_is_validated(served):
    srv, _ = served
    a = _client(srv.url, KEY_A)
    msgs = [{"role": "user", "content": "salted"}]
    assert _chat(a, "salty", msgs).choices                                                # no salt: fine
    r = a.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_body={"cache_salt": "s1"})
    assert r.choices[0].message.content is not None
    for bad in ("", 5, "x" * 257):
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            a.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_body={"cache_salt": bad})


def test_limits(tmp_path):
    limits = Limits(max_body_bytes=4096, max_prompt_tokens=120, max_sessions_per_tenant=2,
                    max_stored_tokens_per_tenant=2000)
    srv, router = _serve(tmp_path, limits)
    try:
        a, b = _client(srv.url, KEY_A), _client(srv.url, KEY_B)
        big = {"model": MODEL, "prompt": "x" * 5000}
        hdr = {"Authorization": f"Bearer {KEY_A}"}
        _error(httpx.post(srv.url + "/v1/completions", json=big, headers=hdr), 413, "request_too_large")

        def chunked():                                   # no Content-Length: counted while reading
            yield json.dumps(big).encode()
        _error(httpx.post(srv.url + "/v1/completions", content=chunked(), headers=hdr), 413, "request_too_large")
        with pytest.raises(openai.BadRequestError, match="prompt_too_long|at most 120"):
            a.completions.create(model=MODEL, prompt=list(range(5, 130)), max_tokens=2)
        # sessions per tenant: two, a third is refused (no Retry-After: waiting does not help)
        msgs = [{"role": "user", "content": "One two three."}]
        _chat(a, "s1", msgs, max_tokens=2)
        _chat(a, "s2", msgs, max_tokens=2)
        with pytest.raises(openai.RateLimitError) as e:
            _chat(a, "s3", msgs, max_tokens=2)
        assert e.value.code == "tenant_session_limit" and "retry-after" not in e.value.response.headers
        _chat(a, "s1", msgs, max_tokens=2)                # existing sessions go on
        _chat(b, "s3", msgs, max_tokens=2)                # another tenant is not counted
        # stored tokens: a turn that could bring the tenant past 2000 history tokens is refused
        with pytest.raises(openai.RateLimitError) as e:
            _chat(a, "s2", msgs, max_tokens=2000)
        assert e.value.code == "tenant_token_limit" and "retry-after" not in e.value.response.headers
        # ... with Retry-After when the tenant's turn in flight is what makes it exceed
        body = {"model": MODEL, "messages": msgs, "max_tokens": 1900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body,
                          headers={**hdr, "X-Session-Id": "s1"}) as running:
            assert running.status_code == 200
            lines = running.iter_lines()              # kept: dropping the iterator closes the stream
            assert next(lines).startswith("data:")
            with pytest.raises(openai.RateLimitError) as e:
                _chat(a, "s2", msgs, max_tokens=60)
            assert e.value.code == "tenant_token_limit" and e.value.response.headers["retry-after"] == "1"
        router_stats = router.clients[0].replica.store.tenant_usage()
        assert router_stats["a"].sessions == 2 and router_stats["b"].sessions == 1
        router.clients[0].replica.store.check_integrity()
    finally:
        _stop(srv, router)


@pytest.mark.parametrize("fair", [True, False])
def test_flooding_tenant_cannot_evict_another(tmp_path, fair):
    """A small device (8 blocks of 32 tokens, no host tier). Tenant B has one conversation; tenant A
    then opens 12. With fair share (the server's default) B's next turn reuses its whole history;
    without it B's history was dropped by A's flood and is recomputed."""
    opts = EngineOptions(device_capacity=256, fair_share=fair)
    srv, router = _serve(tmp_path, options=opts)
    try:
        a, b = _client(srv.url, KEY_A), _client(srv.url, KEY_B)
        msgs = [{"role": "user", "content": "Hello! Tell me about the weather today."}]
        out = _chat(b, "mine", msgs, max_tokens=4)
        msgs += [{"role": "assistant", "content": out.choices[0].message.content},
                 {"role": "user", "content": "And tomorrow?"}]
        out = _chat(b, "mine", msgs, max_tokens=4)
        for i in range(12):
            _chat(a, f"flood-{i}", [{"role": "user", "content": f"Flood number {i}, tell me a story."}], max_tokens=4)
        store = router.clients[0].replica.store
        assert store.tenant_usage()["a"].history_tokens > 256        # A alone could fill the device
        history = len(store.session(session_key("b", "mine")).token_ids)
        msgs += [{"role": "assistant", "content": out.choices[0].message.content},
                 {"role": "user", "content": "Thanks."}]
        last = _chat(b, "mine", msgs, max_tokens=4)
        reused = last.usage.prompt_tokens_details.cached_tokens
        if fair:
            assert store.session(session_key("b", "mine")).last_turn.recomputed_tokens == 0
            assert reused >= history - 4 > 0          # all but the re-tokenized tail of the last reply
        else:
            assert store.session(session_key("b", "mine")).last_turn.recomputed_tokens > 0
        store.check_integrity()
    finally:
        _stop(srv, router)


def test_router_and_migration_keep_the_namespace():
    """Two replicas: tenants a and b both have a session "s" on different replicas; b's hint moves
    only b's session, and the migrated session keeps its tenant."""
    tok = tiny_tokenizer()
    replicas = [Replica(EngineOptions(device_capacity=4096).build(tiny_llama(), tok), name=f"r{i}") for i in range(2)]
    router = Router([LocalClient(r) for r in replicas])
    ka, kb = session_key("a", "s"), session_key("b", "s")
    ids = list(tok.apply_chat_template([{"role": "user", "content": "Hello there, replica."}],
                                       add_generation_prompt=True, tokenize=True)["input_ids"])

    async def turn(sid):
        final = None
        async for ev in router.stream(sid, ids, SamplingParams(max_new_tokens=3)):
            final = ev
        assert final["type"] == "done", final
        return router.names.index(final["replica"])

    async def main():
        ra = await turn(ka)
        router.assigned[ra] += 5                       # b's first turn goes to the other replica
        rb = await turn(kb)
        assert ra != rb
        router.assigned[ra] -= 5
        router.assigned[rb] += 5
        hint = await router.hint(kb)                   # b's hint: towards the least loaded replica (a's)
        await router.wait_migrations()
        assert hint["migrating"] and router.location[kb] == ra == router.location[ka]
        store = replicas[ra].store
        assert {ka, kb} <= set(store.session_ids()) and kb not in replicas[rb].store
        assert store.tenant_usage()["b"].sessions == 1 and store.tenant_usage()["a"].sessions == 1
        usage = await router.tenant_usage("b", [kb, ka])
        assert usage["sessions"] == 1 and set(usage["present"]) == {kb, ka}
        await router.shutdown()

    asyncio.run(main())


def test_concurrent_admissions_cannot_overshoot_a_limit():
    """Replicas that answer usage questions slowly (as over Ray): turns admitted meanwhile are counted,
    so 6 concurrent new sessions under a limit of 2 admit exactly 2, and the token limit holds too."""
    from stateful_hf.serve.limits import LimitError, TenantGate

    class SlowRouter:
        def __init__(self):
            self.history: dict[str, int] = {}

        async def tenant_usage(self, tenant, keys):
            await asyncio.sleep(0.01)
            mine = {k: n for k, n in self.history.items() if k.startswith(f"@{tenant}/")}
            return {"sessions": len(mine), "history_tokens": sum(mine.values()), "stored_tokens": 0,
                    "present": {k: mine[k] for k in keys if k in mine}}

        async def stream(self, sid, prompt, sampling):
            self.history.setdefault(sid, 0)               # the session exists once the turn runs
            await asyncio.sleep(0.05)
            self.history[sid] = len(prompt) + sampling.max_new_tokens
            yield {"type": "done"}

    async def attempt(gate, sid, n):
        try:
            async for _ in gate.stream(session_key("t", sid), [1] * 10, SamplingParams(max_new_tokens=n)):
                pass
            return "ok"
        except LimitError as e:
            return e.code

    async def main():
        gate = TenantGate(SlowRouter(), Limits(max_sessions_per_tenant=2))
        out = await asyncio.gather(*(attempt(gate, f"s{i}", 5) for i in range(6)))
        assert sorted(out) == ["ok"] * 2 + ["tenant_session_limit"] * 4 and not gate._flight
        gate = TenantGate(SlowRouter(), Limits(max_stored_tokens_per_tenant=100))
        out = await asyncio.gather(*(attempt(gate, f"s{i}", 15) for i in range(6)))     # 25 tokens each at most
        assert sorted(out) == ["ok"] * 4 + ["tenant_token_limit"] * 2
        assert sum(gate.router.history.values()) == 100 and not gate._flight

    asyncio.run(main())
