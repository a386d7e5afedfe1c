"""The single-machine OpenAI-compatible server, over HTTP on 127.0.0.1, with the official `openai` client."""

from __future__ import annotations

import json
import re
import threading
import time
from urllib.parse import quote

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from stateful_hf import Engine, SamplingParams  # noqa: E402
from stateful_hf.serve import ServerThread, build_local  # noqa: E402
from stateful_hf.testing import tiny_llama, tiny_tokenizer  # noqa: E402

MODEL = "tiny"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def server():
    app, router = build_local(tiny_llama(), tiny_tokenizer(), MODEL)
    with ServerThread(app) as srv:
        yield srv
    for c in router.clients:
        c.replica.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=30, max_retries=0)


def metric(server, name: str, having: str = "") -> float:
    """Sum of a metric's samples (those whose labels include `having`, e.g. 'finish_reason="stop"')."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(m.group(2)) for m in re.finditer(rf"^stateful_hf_{name}(\{{[^}}]*}})? (\S+)$", text, re.M)
               if having in (m.group(1) or ""))


def test_three_turn_streamed_chat_reuses_and_equals_engine(server, client):
    reference = Engine(tiny_llama(), tiny_tokenizer())
    greedy = SamplingParams(max_new_tokens=MAX_TOKENS)
    users = ["Hello! How are you today?", "Tell me about the weather.", "Please summarize the previous answer."]
    messages: list[dict] = []
    reused_before = metric(server, "reused_tokens_total")
    for turn, text in enumerate(users):
        messages.append({"role": "user", "content": text})
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_headers={"X-Session-Id": "alice"})
        parts, usage, finish = [], None, None
        for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        reply = "".join(parts)
        expected = "".join(reference.chat("alice", text, greedy))
        assert reply == expected, f"turn {turn + 1}"
        assert finish in ("stop", "length")
        assert 1 <= usage.completion_tokens <= MAX_TOKENS
        reused_now = metric(server, "reused_tokens_total")
        if turn == 0:
            assert usage.prompt_tokens_details.cached_tokens == 0
        else:   # turns 2 and 3 reuse the history's KV: reported in usage and in /metrics
            assert usage.prompt_tokens_details.cached_tokens > 0
            assert reused_now - reused_before == usage.prompt_tokens_details.cached_tokens
        reused_before = reused_now
        messages.append({"role": "assistant", "content": reply})
    assert metric(server, "turns_with_reuse_total") >= 2
    page = httpx.get(server.url + "/metrics", timeout=10).text
    for family in ("time_to_first_token_seconds", "time_per_output_token_seconds", "tier_tokens"):
        assert f"# TYPE stateful_hf_{family}" in page
    assert metric(server, "time_to_first_token_seconds_count") >= 3


def test_non_streaming_chat_and_completions(server, client):
    reference = Engine(tiny_llama(), tiny_tokenizer())
    msgs = [{"role": "user", "content": "What would you like to talk about?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                       extra_body={"session_id": "bob"})
    assert r.choices[0].message.content == reference.submit("x", msgs, SamplingParams(max_new_tokens=6)).result().text
    assert r.object == "chat.completion" and r.usage.completion_tokens <= 6
    # a completion prompt as text and as ids
    c = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, temperature=0,
                                  extra_body={"session_id": "carol"})
    ids = tiny_tokenizer()("The quick brown fox", add_special_tokens=False)["input_ids"]
    want = reference.submit("y", ids, SamplingParams(max_new_tokens=5)).result()
    assert c.choices[0].text == want.text and c.usage.prompt_tokens == len(ids)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt=ids, max_tokens=5, temperature=0, stream=True) if ch.choices)
    assert streamed == want.text
    # the same session continued as a completion: its history is reused
    c2 = client.completions.create(model=MODEL, prompt=ids + list(want.token_ids) + ids, max_tokens=3, temperature=0,
                                   extra_body={"session_id": "carol"})
    assert c2.usage.prompt_tokens_details.cached_tokens >= len(ids)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def _post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)


def _error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if status == 400:                                  # every 400 names the field (or header) at fault
        assert isinstance(err["param"], str) and err["param"], err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_bad_input_gets_openai_errors(server, client):
    user = [{"role": "user", "content": "hi"}]
    _error(_post(server, "/v1/chat/completions", "{not json"), 400, "invalid_json")
    _error(_post(server, "/v1/chat/completions", "[1, 2]"), 400, "invalid_json")
    _error(_post(server, "/v1/chat/completions", {"model": "gpt-4", "messages": user}), 404, "model_not_found")
    assert _error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": user, "max_tokens": -1}),
                  400)["param"] == "max_tokens"
    _error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": user, "max_tokens": 0}), 400)
    _error(_post(server, "/v1/chat/completions", {"model": MODEL}), 400, "missing_required_parameter")
    _error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400)
    _error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": user, "temperature": -1}), 400)
    _error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": user, "n": 0}), 400)
    long = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 400}]
    _error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": long, "max_tokens": 4}), 400,
           "context_length_exceeded")
    _error(_post(server, "/v1/completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": 5000}), 400,
           "context_length_exceeded")
    _error(_post(server, "/v1/completions", {"model": MODEL, "prompt": [10**6]}), 400, "invalid_prompt")
    _error(_post(server, "/v1/completions", {"model": MODEL, "prompt": ""}), 400)
    _error(_post(server, "/v1/hints", {"session_id": ""}), 400)
    _error(_post(server, "/v1/hints", {"session_id": "a", "expected_arrival": -1}), 400)
    _error(httpx.get(server.url + "/v1/nothing", timeout=10), 404)
    # the openai client raises its typed errors on these
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=user)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=user, max_tokens=-5)
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"


def test_every_400_names_its_param(server):
    user = [{"role": "user", "content": "hi"}]
    chat = {"model": MODEL, "messages": user, "max_tokens": 2}
    for body, param in (({**chat, "top_p": 0}, "top_p"), ({**chat, "top_k": -2}, "top_k"),
                        ({**chat, "stop": ""}, "stop"), ({**chat, "stop": ["a", ""]}, "stop"),
                        ({**chat, "tools": [{"type": "function"}]}, "tools.0.function"),
                        ({**chat, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
                        ({**chat, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
                        ({**chat, "top_logprobs": 3}, "top_logprobs"), ({**chat, "cache_salt": ""}, "cache_salt"),
                        ({**chat, "session_id": "a b"}, "session_id"), ("{not json", "body"), ("[1]", "body")):
        assert _error(_post(server, "/v1/chat/completions", body), 400)["param"] == param, body
    many = {"model": MODEL, "prompt": ["a", "b"], "session_id": "s"}      # a list of prompts runs without a session
    assert _error(_post(server, "/v1/completions", many), 400)["param"] == "prompt"
    assert _error(_post(server, "/v1/hints", {"session_id": "x/y"}), 400)["param"] == "session_id"
    salted = {**chat, "session_id": "salted", "cache_salt": "one"}
    assert _post(server, "/v1/chat/completions", salted).status_code == 200
    err = _error(_post(server, "/v1/chat/completions", {**salted, "cache_salt": "two"}), 400)
    assert err["param"] == "cache_salt", err


def test_session_ids_are_bounded(server):
    """X-Session-Id, the body's session_id and the URL's id: 1-128 of [A-Za-z0-9._:-], else a 400
    naming where the id came from; nothing is created."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    def post(sid: str) -> httpx.Response:
        return httpx.post(server.url + "/v1/chat/completions", json=chat, headers={"X-Session-Id": sid.encode()},
                          timeout=30)
    longest = "a.b_c:d-" * 16
    assert len(longest) == 128 and post(longest).status_code == 200
    assert httpx.get(f"{server.url}/v1/sessions/{longest}", timeout=10).json()["tokens"] > 0
    for bad in (longest + "x", "alice bob", "a/b", "@acme/x", "é", "a\tb", "x" * 4000):
        err = _error(post(bad), 400, "invalid_session_id")
        assert err["param"] == "X-Session-Id" and "1-128 characters" in err["message"]
        assert len(err["message"]) < 300                         # the id is not echoed whole
        assert httpx.get(f"{server.url}/v1/sessions/{quote(bad, safe='')}", timeout=10).status_code in (400, 404)
    err = _error(_post(server, "/v1/chat/completions", {**chat, "session_id": "a" * 129}), 400, "invalid_session_id")
    assert err["param"] == "session_id"
    err = _error(httpx.delete(f"{server.url}/v1/sessions/{'b' * 129}", timeout=10), 400, "invalid_session_id")
    assert err["param"] == "session_id"
    # a header wins over the body: a bad header is refused even with a good body id
    r = httpx.post(server.url + "/v1/chat/completions", json={**chat, "session_id": "fine"},
                   headers={"X-Session-Id": "not fine"}, timeout=30)
    assert _error(r, 400)["param"] == "X-Session-Id"


def test_busy_session_queues_and_disconnect_cancels(server):
    """A second turn of a session waits for the running one (it is not refused); the client leaving
    the first stream cancels that turn, and the queued turn then runs."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 1900,
            "ignore_eos": True, "stream": True}
    cancelled = metric(server, "requests_total", 'finish_reason="cancelled"')
    second: dict = {}

    def queued():
        second["r"] = _post(server, "/v1/chat/completions",
                            {**body, "stream": False, "max_tokens": 2, "session_id": "dave"})
        second["t"] = time.monotonic()
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/chat/completions", json=body,
                                                       headers={"X-Session-Id": "dave"}) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))   # the turn is running
        t = threading.Thread(target=queued)
        t.start()
        time.sleep(0.3)
        assert "r" not in second, "the second turn ran while the first was in flight"
        left = time.monotonic()
    t.join(30)
    assert second["r"].status_code == 200, second["r"].text
    assert second["t"] > left
    assert second["r"].json()["usage"]["completion_tokens"] == 2
    assert metric(server, "requests_total", 'finish_reason="cancelled"') == cancelled + 1


def arrived(server, sid: str, finished: list) -> int:
    """A lower bound on the turns of `sid` the server has received: queued + running + those the client has back."""
    r = httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=10)
    info = r.json() if r.status_code == 200 else {}
    return info.get("queued_turns", 0) + bool(info.get("busy")) + len(finished)


def test_five_concurrent_turns_of_one_session_run_in_arrival_order(server, client):
    """Five turns of one session sent at once through the openai client (no retries): all succeed,
    finish in the order they were sent, and each equals the stateless reference."""
    reference = Engine(tiny_llama(), tiny_tokenizer())
    n, finished, replies, errors = 5, [], {}, []
    lock = threading.Lock()

    def go(i):
        try:
            r = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Turn number {i}, please answer."}],
                max_tokens=24, temperature=0, extra_body={"ignore_eos": True}, extra_headers={"X-Session-Id": "fifo"})
            with lock:
                finished.append(i)
                replies[i] = r.choices[0].message.content
        except Exception as e:     # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for i, t in enumerate(threads):
        t.start()
        while arrived(server, "fifo", finished) < i + 1:   # a defined arrival order: turn i is at the server
            time.sleep(0.002)                              # before turn i + 1 is sent
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert finished == list(range(n))
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for i in range(n):
        msgs = [{"role": "user", "content": f"Turn number {i}, please answer."}]
        assert replies[i] == reference.submit(f"r{i}", msgs, greedy).result().text


def test_hint_endpoint_prefetches(server, client):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=3,
                                   temperature=0, extra_headers={"X-Session-Id": "erin"})
    before = metric(server, "hints_total")
    r = _post(server, "/v1/hints", {"session_id": "erin", "expected_arrival": 2.5, "priority": 1})
    assert r.status_code == 200 and r.json()["session_id"] == "erin"
    assert metric(server, "hints_total") == before + 1
    # concurrent requests on distinct sessions all finish
    out, threads = {}, []
    for i in range(8):
        def go(i=i):
            out[i] = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"number {i}"}], max_tokens=4, temperature=0,
                extra_headers={"X-Session-Id": f"par-{i}"}).choices[0].message.content
        threads.append(threading.Thread(target=go))
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(out) == 8
