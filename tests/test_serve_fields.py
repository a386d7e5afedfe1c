"""The request field list (`stateful_hf/serve/fields.py`) walked against an in-process server (the tiny
float32 model, greedy): every REFUSED field set to a value that asks for something is a 400 naming it;
every HARMLESS field is accepted and changes no token; every IMPLEMENTED field has a case built for it
whose answer (or request, where no tiny-model answer can show it) differs with the field set. A field
marked IMPLEMENTED but wired to nothing fails the walk (the negative control, `allowed_token_ids`). Unknown fields:
dropped with a warning, a 400 under --strict-fields. docs/server-api.md holds the list's table.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from stateful_hf.serve import ServerThread, build_local, fields  # noqa: E402
from stateful_hf.serve.fields import Endpoint, FieldStatus  # noqa: E402
from stateful_hf.serve.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from stateful_hf.serve.responses import ResponsesRequest  # noqa: E402
from stateful_hf.serve.tool_parse import chat_prompt  # noqa: E402
from stateful_hf.testing import tiny_llama, tiny_tokenizer  # noqa: E402

MODEL = "tiny-walk"
ASK = [{"role": "user", "content": "Tell me about the weather, the sea and the stars at night."}]
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
BASE = {Endpoint.CHAT: {"model": MODEL, "messages": ASK, "max_tokens": 6, "temperature": 0, "return_token_ids": True},
        Endpoint.COMPLETIONS: {"model": MODEL, "prompt": ASK[0]["content"] * 3, "max_tokens": 6, "temperature": 0,
                               "return_token_ids": True},
        Endpoint.RESPONSES: {"model": MODEL, "input": ASK[0]["content"] * 2, "max_output_tokens": 6,
                             "temperature": 0}}
HOT = {"temperature": 1.5, "seed": 1}
LONG = {"max_tokens": 16}           # penalties over the generated tokens need some
DOCS = Path(__file__).resolve().parents[1] / "docs" / "server-api.md"


@pytest.fixture(scope="module")
def server():
    app, router = build_local(tiny_llama(), tiny_tokenizer(), MODEL)
    with ServerThread(app) as srv:
        srv.app = app
        yield srv
    for c in router.clients:
        c.replica.shutdown()


def post(url: str, endpoint: Endpoint, body: dict) -> httpx.Response:
    body = {k: v for k, v in body.items() if v is not None}
    return httpx.post(url + endpoint.value, json=body, timeout=60)


def answer(r: httpx.Response):
    """What a response says: its status and its tokens (chat, completions) or text (Responses)."""
    if r.status_code != 200 or not r.headers["content-type"].startswith("application/json"):
        return r.status_code, r.headers["content-type"], r.text.count('"usage"')
    body = r.json()
    if "choices" in body:
        c = body["choices"][0]
        return 200, c.get("token_ids"), c.get("logprobs"), (c.get("message") or {}).get("tool_calls")
    return 200, [(o["type"], o.get("name"), [c.get("text") for c in o.get("content") or ()]) for o in body["output"]], \
        body["usage"]["output_tokens"]


def cached(r: httpx.Response) -> int:
    u = r.json()["usage"]
    return (u.get("prompt_tokens_details") or u.get("input_tokens_details"))["cached_tokens"]


# ---- the cases built for the implemented fields --------------------------------------------------------
# (endpoint, field) -> (base fields, variant fields, observe): the field is wired when observe(variant) differs
# from observe(base); observe(url, endpoint, body). A variant may be a function of the base's response.

def said(url, endpoint, body):
    return answer(post(url, endpoint, body))


def text_of(url, endpoint, body):
    return post(url, endpoint, body).json()["choices"][0]["text"]


def reuse(url, endpoint, body):          # whether it reuses stored KV (the base prompt was sent before)
    return cached(post(url, endpoint, body)) > 0


def session_kept(url, endpoint, body):
    post(url, endpoint, body)
    return httpx.get(f"{url}/v1/sessions/{body.get('session_id', 'none')}", timeout=30).status_code


def stored(url, endpoint, body):
    rid = post(url, endpoint, body).json()["id"]
    return httpx.get(f"{url}/v1/responses/{rid}", timeout=30).status_code


def status_of(url, endpoint, body):
    return post(url, endpoint, body).json()["status"]


def choices_of(url, endpoint, body):
    return len(post(url, endpoint, body).json()["choices"])


def logprobs_of(url, endpoint, body):
    return [c.get("logprobs") for o in post(url, endpoint, body).json()["output"] for c in o.get("content") or ()]


def request_of(model_cls, endpoint: Endpoint):
    """Where no tiny-model answer can show a field: what the parsed request asks the engine for."""
    def observe(url, _, body):
        parsed = model_cls.model_validate({k: v for k, v in body.items() if v is not None})
        if endpoint is Endpoint.RESPONSES:
            return parsed.sampling(8, None, ()), parsed.truncation, parsed.parallel_tool_calls
        return parsed.sampling(8)
    return observe


def prompt_of(url, _, body):
    tok = tiny_tokenizer()
    if not body.get("tools"):              # a template that shows a variable (the tiny one renders no x)
        tok.chat_template = "{{ x | default('') }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    text, _, stops = chat_prompt(tok, ChatCompletionRequest.model_validate(
        {k: v for k, v in body.items() if v is not None}))
    return text, stops


def _sampling_cases(endpoint: Endpoint, model_cls, budget: str) -> dict:
    return {
        "model": ({}, {"model": "another-model"}, said),
        "temperature": ({}, HOT, said),
        "top_p": (HOT, {**HOT, "top_p": 0.02}, said),
        "top_k": (HOT, {**HOT, "top_k": 1}, said),
        "seed": (HOT, {**HOT, "seed": 2}, said),
        "stream": ({}, {"stream": True}, said),
        **({} if endpoint is Endpoint.RESPONSES else {"n": ({}, {"n": 2}, choices_of)}),
        "cache_salt": ({}, {"cache_salt": "walk-salt"}, reuse),    # a new salt: nothing to reuse
        "session_id": ({}, {"session_id": f"walk-{endpoint.name.lower()}"}, session_kept),
        budget: ({}, {budget: 3}, said),
        **({} if endpoint is Endpoint.RESPONSES else {
            "stream_options": ({"stream": True}, {"stream": True, "stream_options": {"include_usage": True}}, said),
            "stop_token_ids": ({}, lambda base: {"stop_token_ids": [base["choices"][0]["token_ids"][2]]}, said),
            "ignore_eos": ({}, {"ignore_eos": True}, request_of(model_cls, endpoint)),
            "return_token_ids": ({}, {"return_token_ids": False}, said),
            # the sampler's fields: each changes the greedy (or seeded) tokens of its case
            "repetition_penalty": (LONG, {**LONG, "repetition_penalty": 2.0}, said),
            "presence_penalty": (LONG, {**LONG, "presence_penalty": 2.0}, said),
            "frequency_penalty": (LONG, {**LONG, "frequency_penalty": 2.0}, said),
            "min_p": (HOT, {**HOT, "min_p": 0.9}, said),
            "min_tokens": (lambda base: {"stop_token_ids": [base["choices"][0]["token_ids"][1]]}, {"min_tokens": 4},
                           said),
            "logit_bias": ({}, lambda base: {"logit_bias": {str(base["choices"][0]["token_ids"][0]): -100}}, said)}),
    }


CASES = {
    Endpoint.CHAT: {
        **_sampling_cases(Endpoint.CHAT, ChatCompletionRequest, "max_tokens"),
        "messages": ({}, {"messages": [{"role": "user", "content": "Hi"}]}, said),
        "max_completion_tokens": ({}, {"max_tokens": None, "max_completion_tokens": 3}, said),
        "logprobs": ({}, {"logprobs": True}, said),
        "top_logprobs": ({"logprobs": True}, {"logprobs": True, "top_logprobs": 2}, said),
        "tools": ({"tool_choice": None}, {"tools": [PING], "tool_choice": "required"}, said),
        "tool_choice": ({"tools": [PING]}, {"tools": [PING], "tool_choice": "required"}, said),
        "parallel_tool_calls": ({"tools": [PING]}, {"tools": [PING], "parallel_tool_calls": False}, prompt_of),
        "response_format": ({}, {"response_format": {"type": "json_object"}}, said),
        "chat_template_kwargs": ({}, {"chat_template_kwargs": {"x": "X"}}, prompt_of),
    },
    Endpoint.COMPLETIONS: {
        **_sampling_cases(Endpoint.COMPLETIONS, CompletionRequest, "max_tokens"),
        "prompt": ({}, {"prompt": "Hi"}, said),
        "echo": ({}, {"echo": True}, text_of),
        "logprobs": ({}, {"logprobs": 2}, said),
    },
    Endpoint.RESPONSES: {
        **_sampling_cases(Endpoint.RESPONSES, ResponsesRequest, "max_output_tokens"),
        "input": ({}, {"input": "Hi"}, said),
        "instructions": ({}, {"instructions": "Be brief."}, said),
        "previous_response_id": ({}, lambda base: {"previous_response_id": base["id"]}, said),
        "store": ({}, {"store": False}, stored),
        "truncation": ({}, {"truncation": "auto"}, request_of(ResponsesRequest, Endpoint.RESPONSES)),
        "tools": ({}, {"tools": [{"type": "function", **PING["function"]}], "tool_choice": "required"}, said),
        "tool_choice": ({"tools": [{"type": "function", **PING["function"]}]},
                        {"tools": [{"type": "function", **PING["function"]}], "tool_choice": "required"}, said),
        "parallel_tool_calls": ({}, {"parallel_tool_calls": False}, request_of(ResponsesRequest, Endpoint.RESPONSES)),
        "text": ({}, {"text": {"format": {"type": "json_object"}}}, said),     # refused by name: not ignored
        "background": ({}, {"background": True}, status_of),                     # queued, not incomplete
        "include": ({}, {"include": ["message.output_text.logprobs"]}, logprobs_of),
        "top_logprobs": ({"include": ["message.output_text.logprobs"]}, {"top_logprobs": 2}, logprobs_of),
    },
}
# the completions' stop case reads the base's text
CASES[Endpoint.COMPLETIONS]["stop"] = ({}, lambda base: {"stop": [base["choices"][0]["text"][2:4]]}, said)
CASES[Endpoint.CHAT]["stop"] = ({}, lambda base: {"stop": [base["choices"][0]["message"]["content"][2:4]]}, said)


def walk(url: str, specs, cases) -> list[str]:
    """The fields of `specs` whose status the server does not keep (one line each; empty: all kept)."""
    bad = []
    baseline = {e: answer(post(url, e, BASE[e])) for e in Endpoint}
    for f in specs:
        base = BASE[f.endpoint]
        if f.status is FieldStatus.REFUSED:
            r = post(url, f.endpoint, {**base, f.name: f.example})
            if r.status_code != 400 or r.json()["error"]["param"] != f.name:
                bad.append(f"{f.endpoint.value} {f.name}: refused, but {r.status_code} {r.text[:200]}")
        elif f.status is FieldStatus.HARMLESS:
            got = answer(post(url, f.endpoint, {**base, f.name: f.example}))
            if got != baseline[f.endpoint]:
                bad.append(f"{f.endpoint.value} {f.name}: harmless, but the answer changed: {got}")
        else:
            case = cases[f.endpoint].get(f.name)
            if case is None:
                bad.append(f"{f.endpoint.value} {f.name}: implemented, but the walk has no case for it")
                continue
            before, after, observe = case
            if callable(before):
                before = before(post(url, f.endpoint, base).json())
            first = {**base, **before}
            if callable(after):
                after = after(post(url, f.endpoint, first).json())
            if observe(url, f.endpoint, first) == observe(url, f.endpoint, {**first, **after}):
                bad.append(f"{f.endpoint.value} {f.name}: implemented, but setting it changed nothing")
    return bad


def test_every_field_keeps_its_status(server):
    assert walk(server.url, fields.FIELDS, CASES) == []


def test_a_field_marked_implemented_but_wired_to_nothing_fails_the_walk(server, monkeypatch):
    """Negative control: `allowed_token_ids` (not in the sampler) marked IMPLEMENTED, with a case built for it."""
    name = "allowed_token_ids"
    spec = dataclasses.replace(fields.fields_of(Endpoint.CHAT)[name], status=FieldStatus.IMPLEMENTED)
    monkeypatch.setitem(fields._BY_ENDPOINT[Endpoint.CHAT], name, spec)
    cases = {Endpoint.CHAT: {name: ({}, {name: [5, 6]}, said)}}
    assert post(server.url, Endpoint.CHAT, {**BASE[Endpoint.CHAT], name: [5, 6]}).status_code == 200   # now accepted
    failures = walk(server.url, [spec], cases)
    assert len(failures) == 1 and f"{name}: implemented, but setting it changed nothing" in failures[0]


def test_unknown_fields_are_dropped_with_a_warning_or_refused_when_strict(server, caplog, monkeypatch):
    base = BASE[Endpoint.CHAT]
    with caplog.at_level(logging.WARNING, logger="stateful_hf.serve.fields"):
        for _ in range(2):
            r = post(server.url, Endpoint.CHAT, {**base, "frobnicate": 1})
            assert r.status_code == 200 and answer(r) == answer(post(server.url, Endpoint.CHAT, base))
    assert sum("'frobnicate'" in m for m in caplog.messages) == 1          # once per field name
    monkeypatch.setattr(server.app.state.config, "strict_fields", True)
    for endpoint in Endpoint:
        r = post(server.url, endpoint, {**BASE[endpoint], "frobnicate": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate", r.text
    assert post(server.url, Endpoint.CHAT, base).status_code == 200       # known fields pass under strict


def test_inert_values_of_refused_fields_are_accepted(server):
    """A refused field set to what the server does anyway (n: 1, echo: false, ...) is accepted, and so are the
    sampler's fields at their neutral values."""
    for endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS):
        body = {**BASE[endpoint], "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "best_of": 1,
                "repetition_penalty": 1.0, "min_p": 0, "echo": False, "logit_bias": {}}
        assert answer(post(server.url, endpoint, body)) == answer(post(server.url, endpoint, BASE[endpoint]))


def test_the_docs_list_every_field_with_its_status():
    assert fields.table() in DOCS.read_text(), "docs/server-api.md: paste fields.table() between its markers"
