"""Server behaviour for real clients: the default max_tokens, a session's bounded queue (409 +
Retry-After), refusals of unsupported fields, GET / DELETE /v1/sessions/{id} (one server and a
two-replica router)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from stateful_hf import Engine, SamplingParams  # noqa: E402
from stateful_hf.serve import APIError, LocalClient, Replica, Router, ServerThread, build_local  # noqa: E402
from stateful_hf.serve.app import max_tokens_for  # noqa: E402
from stateful_hf.serve.server import EngineOptions  # noqa: E402
from stateful_hf.testing import tiny_llama, tiny_tokenizer  # noqa: E402

MODEL = "tiny"
CTX = 2048                       # the tiny model's context


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    opts = EngineOptions(device_capacity=4096, host_capacity=4096, disk_dir=str(tmp_path_factory.mktemp("disk")),
                         disk_capacity=4096, session_wait_timeout=0.5)
    app, router = build_local(tiny_llama(), tiny_tokenizer(), MODEL, opts)
    with ServerThread(app) as srv:
        yield srv, router.clients[0].replica
    router.clients[0].replica.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", timeout=30, max_retries=0)


def _chat(srv, body: dict, sid: str | None = None) -> httpx.Response:
    headers = {"X-Session-Id": sid} if sid else {}
    return httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, **body}, headers=headers, timeout=60)


def test_max_tokens_precedence():
    assert max_tokens_for(7, 100, CTX, None, "messages") == 7                 # the request's own
    assert max_tokens_for(None, 100, CTX, None, "messages") == CTX - 100      # the room left
    assert max_tokens_for(None, 100, CTX, 256, "messages") == 256             # capped when a cap is given
    assert max_tokens_for(None, CTX - 3, CTX, 256, "messages") == 3           # never beyond the room
    for requested, prompt in ((None, CTX), (10, CTX - 5)):
        with pytest.raises(APIError) as e:
            max_tokens_for(requested, prompt, CTX, None, "messages")
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"


def test_no_max_tokens_uses_the_room_left_in_the_context(served):
    """A conversation within 256 tokens of the context gets an answer up to the context's end (it was
    a 400 with the fixed default of 256)."""
    srv, _ = served
    tok = tiny_tokenizer()
    content = "The quick brown fox jumps over the lazy dog. " * 200
    msgs = [{"role": "user", "content": content}]
    n = len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    cut = len(content) * (CTX - 6) // n                 # aim a few tokens short of the context
    while True:
        msgs = [{"role": "user", "content": content[:cut]}]
        n = len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
        if n < CTX - 2:
            break
        cut -= 20
    assert CTX - n <= 256
    r = _chat(srv, {"messages": msgs, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == CTX - n
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_turn_waiting_past_the_timeout_gets_409_with_retry_after(served):
    srv, replica = served
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 1900,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", srv.url + "/v1/chat/completions",
                                                       json={"model": MODEL, **body},
                                                       headers={"X-Session-Id": "slow"}) as first:
        assert first.status_code == 200
        lines = first.iter_lines()          # kept: dropping the iterator would close the connection
        assert next(line for line in lines if line.startswith("data:"))
        t0 = time.monotonic()
        r = _chat(srv, {**body, "stream": False, "max_tokens": 2}, sid="slow")
        waited = time.monotonic() - t0
        assert r.status_code == 409, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "session_busy" and r.json()["error"]["param"] == "session_id"
        assert waited >= 0.45                            # it was queued for the timeout (0.5 s)
        # a busy session is not deleted either
        d = httpx.delete(srv.url + "/v1/sessions/slow", timeout=10)
        assert d.status_code == 409 and d.headers["retry-after"] == "1"
    deadline = time.monotonic() + 30
    while replica.turns.busy("slow") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not replica.turns.busy("slow")               # the cancelled turn gave its slot back
    assert httpx.delete(srv.url + "/v1/sessions/slow", timeout=10).status_code == 200
    replica.store.check_integrity()


@pytest.mark.parametrize("field, value", [
    ("best_of", 2),
    ("guided_regex", "a+"),
    ("functions", [{"name": "f", "parameters": {}}]),
])
def test_unsupported_chat_fields_are_refused_by_name(served, field, value):
    r = _chat(served[0], {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "unsupported_parameter" and field in err["message"]


def test_chat_logprobs_are_the_models_log_softmax_of_the_chosen_tokens(served, client):
    """logprobs / top_logprobs (OpenAI's shape) come from the logits the sampler used: equal to the
    stateless model's log_softmax at each generated position."""
    import torch

    tok, model = tiny_tokenizer(), tiny_llama()
    msgs = [{"role": "user", "content": "Tell me a story about a fox."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True, "return_token_ids": True},
                                       extra_headers={"X-Session-Id": "lp"})
    content = r.choices[0].logprobs.content
    ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    gen = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    want_ids = gen.sequences[0, len(ids):].tolist()
    assert len(content) == 6
    for k, c in enumerate(content):
        lp = torch.log_softmax(gen.logits[k][0].float(), -1)
        assert c.token == tok.decode([want_ids[k]]) and bytes(c.bytes) == c.token.encode("utf-8")
        assert abs(c.logprob - lp[want_ids[k]].item()) < 1e-4
        assert len(c.top_logprobs) == 3
        assert c.top_logprobs[0].logprob == c.logprob          # greedy: the chosen token is the most likely
        top = torch.topk(lp, 3)
        assert [a.logprob for a in c.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    # the next turn of the same session (history reused) still gives exact logprobs
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "More."}]
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                        extra_headers={"X-Session-Id": "lp"})
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    gen = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    for k, c in enumerate(r2.choices[0].logprobs.content):
        t = gen.sequences[0, len(ids) + k].item()
        assert abs(c.logprob - torch.log_softmax(gen.logits[k][0].float(), -1)[t].item()) < 1e-4
        assert c.top_logprobs == []
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    for body, param in (({"top_logprobs": 2}, "top_logprobs"),
                        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
        r = _chat(served[0], {"messages": msgs, "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_neutral_values_of_those_fields_are_served(served, client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       logprobs=False, response_format={"type": "text"}, tool_choice="none",
                                       presence_penalty=0, frequency_penalty=0, temperature=0)
    assert r.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as e:       # served (tests/test_serve_structured.py), if well formed
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       response_format={"type": "xml"})
    assert e.value.body["param"] == "response_format"
    for field, value in (("suffix", "x"), ("best_of", 2)):
        r = httpx.post(served[0].url + "/v1/completions", json={"model": MODEL, "prompt": "hi", field: value},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)


def test_get_and_delete_session_frees_every_tier(served, client):
    srv, replica = served
    store = replica.store
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there! " * 20}],
                                   max_tokens=8, temperature=0, extra_headers={"X-Session-Id": "gone"})
    before = time.time()
    info = httpx.get(srv.url + "/v1/sessions/gone", timeout=10).json()
    assert info["id"] == "gone" and info["tokens"] == store.session("gone").num_tokens > 64
    assert info["tiers"]["device"] == info["tokens"] and not info["busy"]
    assert before - 30 < info["last_active_at"] <= time.time() and info["idle_seconds"] >= 0
    # spread it over every tier: chunk 0 on the disk, chunk 1 on the host, the rest on the device
    store.move("gone", [0], "disk")
    store.move("gone", [1], "host")
    info = httpx.get(srv.url + "/v1/sessions/gone", timeout=10).json()
    assert info["tiers"]["disk"] > 0 and info["tiers"]["host"] > 0 and info["tiers"]["device"] > 0
    st = store.stats()
    used = (st.device_tokens, st.host_tokens, st.disk_tokens)
    r = httpx.delete(srv.url + "/v1/sessions/gone", timeout=10)
    assert r.status_code == 200 and r.json() == {"id": "gone", "object": "session.deleted", "deleted": True,
                                                 "freed_tokens": info["tokens"]}
    st = store.stats()
    assert (st.device_tokens, st.host_tokens, st.disk_tokens) == (used[0] - info["tiers"]["device"],
                                                                   used[1] - info["tiers"]["host"],
                                                                   used[2] - info["tiers"]["disk"])
    assert "gone" not in store
    store.check_integrity()
    for method in (httpx.get, httpx.delete):
        r = method(srv.url + "/v1/sessions/gone", timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    # the id can start a new conversation
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           extra_headers={"X-Session-Id": "gone"})
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_router_sends_session_calls_to_the_owning_replica():
    tok = tiny_tokenizer()
    replicas = [Replica(EngineOptions(device_capacity=4096).build(tiny_llama(), tok), name=f"r{i}") for i in range(2)]
    router = Router([LocalClient(r) for r in replicas])

    async def main():
        ids = list(tok.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True,
                                           tokenize=True)["input_ids"])
        owners = {}
        for sid in ("a", "b", "c"):
            final = None
            async for ev in router.stream(sid, ids, SamplingParams(max_new_tokens=3)):
                final = ev
            owners[sid] = final["replica"]
        assert len(set(owners.values())) == 2             # both replicas hold sessions
        for sid, name in owners.items():
            assert (await router.session_info(sid))["replica"] == name
        fresh = Router([LocalClient(r) for r in replicas])   # a restarted router asks the replicas
        assert (await fresh.delete_session("b"))["deleted"]
        assert all("b" not in r.store for r in replicas)
        with pytest.raises(APIError) as e:
            await fresh.session_info("b")
        assert e.value.status == 404
        with pytest.raises(APIError) as e:
            await router.delete_session("nobody")
        assert e.value.status == 404
        for r in replicas:
            r.store.check_integrity()
        await router.shutdown()

    asyncio.run(main())


def test_queue_gives_the_slot_in_arrival_order_and_times_out():
    from stateful_hf.serve.session_queue import SessionQueue

    async def main():
        q, order = SessionQueue(timeout=5), []
        await q.acquire("s")

        async def turn(i):
            await q.acquire("s")
            order.append(i)
            await asyncio.sleep(0.01)
            q.release("s")
        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(turn(i)))
            await asyncio.sleep(0)
        assert q.waiting("s") == 5
        threading.Thread(target=q.release, args=("s",)).start()     # released from another thread
        await asyncio.gather(*tasks)
        assert order == list(range(5)) and not q.busy("s")
        short = SessionQueue(timeout=0.05)
        await short.acquire("s")
        with pytest.raises(APIError) as e:
            await short.acquire("s")
        assert e.value.status == 409 and e.value.retry_after == 1 and short.waiting("s") == 0
        short.release("s")
        assert not short.busy("s")

    asyncio.run(main())


def test_engine_reference_unchanged_by_queueing(served, client):
    """A queued turn's reply is still exactly the stateless engine's."""
    msgs = [{"role": "user", "content": "What would you like to talk about?"}]
    want = Engine(tiny_llama(), tiny_tokenizer()).submit("x", msgs, SamplingParams(max_new_tokens=6)).result().text
    got = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                         extra_headers={"X-Session-Id": "ref"})
    assert got.choices[0].message.content == want
