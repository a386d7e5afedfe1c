"""No 5xx from client input, validation as OpenAI's, and a bug's 500 that keeps the connection: over HTTP
on 127.0.0.1 (an in-process server on the tiny model, as tests/test_serve.py)."""

from __future__ import annotations

import http.client
import json
import logging
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from fastapi import FastAPI  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402

from stateful_hf.serve import ServerThread, build_local  # noqa: E402
from stateful_hf.serve import app as app_module  # noqa: E402
from stateful_hf.serve.protocol import SAMPLING_FLOOR, sampling_params  # noqa: E402
from stateful_hf.serve.replica import api_error  # noqa: E402
from stateful_hf.serve.request_body import MAX_DEPTH, depth  # noqa: E402
from stateful_hf.testing import tiny_llama, tiny_tokenizer  # noqa: E402

MODEL = "tiny"
USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": USER, "max_tokens": 3}


@pytest.fixture(scope="module")
def server():
    app, router = build_local(tiny_llama(), tiny_tokenizer(), MODEL)
    with ServerThread(app) as srv:
        yield srv
    for c in router.clients:
        c.replica.shutdown()


def _post(url: str, path: str, body) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=30)


def _param(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
    return err["param"]


def _nested(levels: int) -> str:
    """A chat body whose `tools` value nests `levels` arrays (the body object adds one level)."""
    return json.dumps(CHAT)[:-1] + ', "tools": ' + "[" * levels + "]" * levels + "}"


# the causes of the 5xx a schemathesis hunt found (issue 52), each now a 400 naming its param
FIVE_HUNDREDS = [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0.text"),
    ("/v1/responses", {"model": MODEL, "input": [{"role": {"a": 1}, "content": "x"}]}, "input.0.role"),
    ("/v1/responses", {"model": MODEL, "input": [{"role": ["user"], "content": "x"}]}, "input.0.role"),
    ("/v1/responses", {"model": MODEL, "input": [{"type": "function_call_output", "call_id": {"a": 1}, "output": "x"}]},
     "input.0.call_id"),
    ("/v1/responses", {"model": MODEL, "input": [{"type": "function_call_output", "call_id": [1], "output": "x"}]},
     "input.0.call_id"),
    ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text", "text": 7}]}]},
     "input.0.content.0.text"),
    ("/v1/chat/completions", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "body"),
    ("/v1/chat/completions", _nested(MAX_DEPTH), "body"),
    ("/v1/chat/completions", json.dumps(CHAT).replace('"hi"', '"a\\ud800b"'), "messages.0.content"),
    ("/v1/chat/completions", json.dumps(CHAT).replace('"hi"', '"a\\udc00"'), "messages.0.content"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x\\udfff", "max_tokens": 2}', "prompt"),
    ("/v1/responses", '{"model": "tiny", "input": "x", "metadata": {"k": "\\ud800"}}', "metadata.k"),
    ("/v1/chat/completions", json.dumps(CHAT)[:-1] + ', "user": "a\\ud800"}', "user"),
    ("/v1/hints", '{"session_id": "a", "expected_arrival": Infinity}', "expected_arrival"),
    ("/v1/hints", '{"session_id": "a", "expected_arrival": NaN}', "expected_arrival"),
    ("/v1/hints", {"session_id": "a", "expected_arrival": 1e300}, "expected_arrival"),
    ("/v1/chat/completions", json.dumps(CHAT)[:-1] + ', "temperature": -Infinity}', "temperature"),
    ("/v1/responses", '{"model": "tiny", "input": "x", "metadata": {"k": Infinity}}', "metadata.k"),
]


@pytest.mark.parametrize("path,body,param", FIVE_HUNDREDS, ids=range(len(FIVE_HUNDREDS)))
def test_client_input_that_was_a_500_is_a_400_naming_its_param(server, path, body, param):
    assert _param(_post(server.url, path, body)) == param


def test_the_bounds_admit_what_is_valid(server):
    """Negative controls of the table above: the limit's own depth, a surrogate pair (an emoji sent
    escaped, as json.dumps does), a finite expected_arrival and text parts are served."""
    r = _post(server.url, "/v1/chat/completions", _nested(MAX_DEPTH - 1))
    assert r.status_code != 400 or r.json()["error"]["param"] != "body", r.text       # the tools' own check
    assert _post(server.url, "/v1/chat/completions", json.dumps(CHAT).replace('"hi"', '"a\\ud83d\\ude00b"')
                 ).status_code == 200
    assert _post(server.url, "/v1/hints", {"session_id": "a", "expected_arrival": 86400}).status_code == 200
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]
    assert _post(server.url, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": parts}]}
                 ).status_code == 200
    r = _post(server.url, "/v1/responses", {"model": MODEL, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}], "max_output_tokens": 2})
    assert r.status_code == 200, r.text


def test_depth_counts_brackets_outside_strings():
    assert depth(b'{"a": "[[[[[[[[[[[[' + b"[" * 100 + b'"}') <= 1
    assert depth(b'{"a": "\\"' + b"[" * 100 + b'"}') <= 1                  # an escaped quote stays inside
    assert depth(b'{"a": "\\\\", "b": ' + b"[" * 100 + b"]" * 100 + b"}") == 101   # \\ ends no string
    assert depth(b"[" * 30 + b"]" * 30 + b"[" * 70 + b"]" * 70) == 70


def test_validation_as_openai(server):
    """Each 400 names its param; the same request without the bad value is served (the control)."""
    cases = [
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**CHAT, "stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
        ({**CHAT, "seed": 2**64, "temperature": 1}, "seed"),
        ({**CHAT, "seed": 2**63, "temperature": 1}, "seed"),
        ({**CHAT, "seed": -2**63 - 1, "temperature": 1}, "seed"),
        ({**CHAT, "max_completion_tokens": -5}, "max_completion_tokens"),
        ({**CHAT, "max_tokens": 3, "max_completion_tokens": -5}, "max_completion_tokens"),
        ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({**CHAT, "max_tokens": -1}, "max_tokens"),
        ({**CHAT, "n": 0}, "n"), ({**CHAT, "n": 129}, "n"), ({**CHAT, "n": -3}, "n"),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({**CHAT, "user": 5}, "user"), ({**CHAT, "stop": [1]}, "stop.0"), ({**CHAT, "stop": 3}, "stop"),
        ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({**CHAT, "session_id": 5}, "session_id"), ({**CHAT, "cache_salt": ["x"]}, "cache_salt"),
        ({**CHAT, "temperature": 2.5}, "temperature"), ({**CHAT, "top_p": 0}, "top_p"),
        ({**CHAT, "stop_token_ids": [-1]}, "stop_token_ids"),
        ({**CHAT, "stop_token_ids": [2**64]}, "stop_token_ids"),
    ]
    for body, param in cases:
        assert _param(_post(server.url, "/v1/chat/completions", body)) == param, body
    served = [{**CHAT, "stream": True, "stream_options": {"include_usage": True}},
              {**CHAT, "seed": 2**63 - 1, "temperature": 1}, {**CHAT, "seed": -2**63, "temperature": 1},
              {**CHAT, "max_tokens": None, "max_completion_tokens": 3}, {**CHAT, "logprobs": True, "top_logprobs": 20},
              {**CHAT, "logprobs": True, "top_logprobs": 0}, {**CHAT, "user": "u", "stop": ["\n"]}]
    for body in served:
        assert _post(server.url, "/v1/chat/completions", body).status_code == 200, body
    comp = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    assert _param(_post(server.url, "/v1/completions", {**comp, "stream_options": {"include_usage": True}})
                  ) == "stream_options"
    assert _param(_post(server.url, "/v1/completions", {**comp, "seed": 2**64, "temperature": 1})) == "seed"
    resp = {"model": MODEL, "input": "hello", "max_output_tokens": 2}
    assert _param(_post(server.url, "/v1/responses", {**resp, "seed": 2**64, "temperature": 1})) == "seed"
    assert _param(_post(server.url, "/v1/responses", {**resp, "instructions": 5})) == "instructions"
    assert _post(server.url, "/v1/responses", {**resp, "seed": 2**63 - 1, "temperature": 1}).status_code == 200


def _chat_text(server, **fields) -> str:
    r = _post(server.url, "/v1/chat/completions", {**CHAT, "max_tokens": 12, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_degenerate_sampling_is_greedy(server):
    """A temperature under SAMPLING_FLOOR (1e-39: float32 logits / temperature overflow) or a top_p
    under it (1e-46 rounds to 0 in float32) was a 500 "probability tensor contains inf or nan"; it is
    greedy. The control: a plain temperature 1 sample (seeded) is not the greedy answer, so the
    comparison can tell."""
    greedy = _chat_text(server, temperature=0)
    for fields in ({"temperature": 1e-39}, {"temperature": 1e-38}, {"temperature": 1e-6},
                   {"temperature": 1.0, "top_p": 1e-46, "seed": 1}, {"temperature": 1.0, "top_p": 1e-6, "seed": 2}):
        assert _chat_text(server, **fields) == greedy, fields
    r = _post(server.url, "/v1/responses", {"model": MODEL, "input": "hi", "temperature": 1e-40,
                                            "max_output_tokens": 3})
    assert r.status_code == 200, r.text
    assert _chat_text(server, temperature=1.0, seed=3) != greedy


def test_sampling_params_floor():
    assert sampling_params(None, temperature=SAMPLING_FLOOR / 2).greedy
    assert sampling_params(None, temperature=1.0, top_p=SAMPLING_FLOOR / 2).greedy
    assert not sampling_params(None, temperature=SAMPLING_FLOOR).greedy       # at the floor: sampled
    assert not sampling_params(None, temperature=1.0, top_p=SAMPLING_FLOOR).greedy


# ---- a bug's 500 -----------------------------------------------------------------------------------

def _two_requests(url: str, first: tuple[str, str], second: tuple[str, str]) -> tuple[tuple, tuple]:
    """Two requests on ONE keep-alive connection (http.client does not reconnect on its own: a closed
    connection makes the second raise). Each: (method, path, json body or None) -> (status, headers, body)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    out, sock = [], None
    try:
        for method, path, body in (first, second):
            conn.request(method, path, body=body, headers={"content-type": "application/json"} if body else {})
            if out:
                assert conn.sock is sock, "the client opened a new connection"
            sock = conn.sock
            r = conn.getresponse()
            out.append((r.status, dict(r.getheaders()), r.read()))
    finally:
        conn.close()
    return out[0], out[1]


def _boom(*args, **kwargs):
    raise RuntimeError("secret internals at /srv/model/weights.bin")


def test_a_bugs_500_is_generic_logged_and_keeps_the_connection(server, monkeypatch, caplog):
    chat, real, failed = json.dumps(CHAT), app_module.encode, []

    def fails_once(*args, **kwargs):                # the chat path's tokenization (in a worker thread)
        if not failed:
            failed.append(1)
            _boom()
        return real(*args, **kwargs)
    monkeypatch.setattr(app_module, "encode", fails_once)
    with caplog.at_level(logging.ERROR, logger="stateful_hf.errors"):
        (s1, h1, b1), (s2, _, b2) = _two_requests(server.url, ("POST", "/v1/chat/completions", chat),
                                                  ("POST", "/v1/chat/completions", chat))
    assert s1 == 500, b1
    err = json.loads(b1)["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error" and err["param"] is None
    assert "secret" not in b1.decode() and "RuntimeError" not in b1.decode()
    rid = h1["x-request-id"]
    assert re.fullmatch(r"req_[0-9a-f]{24}", rid) and rid in err["message"]
    assert h1.get("connection", "").lower() != "close"
    assert s2 == 200, b2                                      # the next request on the same connection
    assert json.loads(b2)["choices"][0]["message"]["content"] is not None
    [record] = [r for r in caplog.records if getattr(r, "request_id", None) == rid]
    assert record.exc_info and "secret internals" in str(record.exc_info[1])


def test_a_stream_that_fails_midway_ends_cleanly_and_keeps_the_connection(server, monkeypatch):
    real = app_module.chat_chunk
    sent = []

    def second_chunk_fails(*args, **kwargs):
        sent.append(1)
        if len(sent) == 2:
            raise RuntimeError("secret internals")
        return real(*args, **kwargs)
    monkeypatch.setattr(app_module, "chat_chunk", second_chunk_fails)
    stream = json.dumps({**CHAT, "stream": True})
    (s1, h1, b1), (s2, _, b2) = _two_requests(server.url, ("POST", "/v1/chat/completions", stream),
                                              ("GET", "/v1/models", None))
    assert s1 == 200 and h1["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in b1.decode().splitlines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["error"]["code"] == "internal_error" and "secret" not in b1.decode()
    assert s2 == 200 and json.loads(b2)["data"][0]["id"] == MODEL


def test_the_keep_alive_probe_detects_a_dropped_connection():
    """Negative control: the design the server had (a FastAPI exception handler for Exception, which
    Starlette's outermost middleware answers and then re-raises, so uvicorn drops the connection
    without `Connection: close`) fails the probe's second request."""
    app = FastAPI()

    @app.exception_handler(Exception)
    async def _server_error(request, e):
        return JSONResponse({"error": {"message": str(e)}}, status_code=500)

    @app.get("/fail")
    async def fail():
        _boom()

    @app.get("/ok")
    async def ok():
        return {"ok": True}

    with ServerThread(app) as srv, pytest.raises((http.client.HTTPException, ConnectionError, AssertionError)):
        _two_requests(srv.url, ("GET", "/fail", None), ("GET", "/ok", None))


def test_an_engine_error_is_generic_and_logged(caplog):
    with caplog.at_level(logging.ERROR, logger="stateful_hf.errors"):
        e = api_error(RuntimeError("probability tensor contains either inf, nan (internals)"))
    assert e.status == 500 and e.code == "internal_error" and "internals" not in e.message
    rid = re.search(r"req_[0-9a-f]{24}", e.message).group(0)
    assert [r for r in caplog.records if getattr(r, "request_id", None) == rid]
    assert api_error(ValueError("bad prompt")).status == 400           # client errors keep their 400


# ---- /openapi.json ---------------------------------------------------------------------------------

def test_openapi_declares_request_bodies_and_errors(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    schemas = doc["components"]["schemas"]
    bodies = {("post", "/v1/chat/completions"): "ChatCompletionRequest", ("post", "/v1/completions"):
              "CompletionRequest", ("post", "/v1/responses"): "ResponsesRequest", ("post", "/v1/hints"): "HintRequest"}
    for (method, path), model in bodies.items():
        op = doc["paths"][path][method]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"] == f"#/components/schemas/{model}"
        for status in ("400", "401", "413", "500"):
            assert op["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith("/Error")
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["seed"]["anyOf"][0]["maximum"] == 2**63 - 1 and chat["top_logprobs"]["anyOf"][0]["maximum"] == 20
    assert chat["n"]["minimum"] == 1 and "messages" in schemas["ChatCompletionRequest"]["required"]
    assert schemas["Error"]["properties"]["error"]["required"] == ["message", "type", "param", "code"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "500" in op["responses"] and "422" not in op["responses"], (method, path)
    # the bodies stay off the event loop: no route has a body parameter FastAPI would parse there
    for route in server.server.config.app.routes:
        assert getattr(route, "body_field", None) is None, route.path
