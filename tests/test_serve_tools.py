"""Tools in /v1/chat/completions through the `openai` client against a server subprocess (the tiny
model): forced calls (tool_choice required / named), streamed tool-call deltas that reassemble to the
non-streaming reply, tool turns in the history reused and exact, bad tool input refused naming the field
with the session intact. Also the reply parser and the shipped template without a server.

A random model never chooses a tool, so calls are forced; a tool without parameters makes the forced
call whole (`tools.plan`), so the tiny model's calls parse. SmolLM2's own calls: tests/test_serve_agents.py.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from agent_server import serve  # noqa: E402

from stateful_hf.serve import tools as tool_mod  # noqa: E402
from stateful_hf.serve.protocol import APIError  # noqa: E402
from stateful_hf.serve.tool_parse import ReplyParser  # noqa: E402
from stateful_hf.testing import tiny_tokenizer  # noqa: E402

MODEL = "tiny-random"
PING = {"type": "function", "function": {"name": "ping", "description": "Ping the server",
                                         "parameters": {"type": "object", "properties": {}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASK = [{"role": "user", "content": "Tell me about the weather, the sea and the stars at night."}]
SMOLLM2_TEMPLATE = (  # SmolLM2-135M-Instruct's own chat template (it renders no tools)
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("tools"), "--model", MODEL, "--served-model-name", MODEL,
               "--max-retain", "120") as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0)


def _post(url: str, body: dict, sid: str | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 6, "temperature": 0, **body},
                      headers={"X-Session-Id": sid} if sid else {}, timeout=120)


# ---- without a server ------------------------------------------------------------------------------

def _plan(choice="auto", tools=(WEATHER,), parallel=True):
    return tool_mod.plan(tiny_tokenizer(), list(tools), choice, parallel)


def test_reply_parser_streams_to_the_same_reply_in_any_chunks():
    p = _plan()
    prompt = tool_mod.render(tiny_tokenizer(), ASK, p)
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": oops}\n</tool_call> done ')
    whole = ReplyParser(p, prompt).parse(text)
    assert whole[0] == 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": oops}\n</tool_call> done '
    assert [(c.name, json.loads(c.arguments)) for c in whole[1]] == [("get_weather", {"city": "Paris"})]
    for step in (1, 2, 5, 13):
        r = ReplyParser(p, prompt)
        pieces = [x for i in range(0, len(text), step) for x in r.feed(text[i:i + step])] + r.close()
        assert "".join(x for k, x in pieces if k == "text") == whole[0], step
        assert [(c.name, c.arguments) for k, c in pieces if k == "call_done"] == \
            [(c.name, c.arguments) for c in whole[1]]
        assert "".join(x for k, x in pieces if k == "args") == "".join(c.arguments for c in whole[1])


def test_forcing_prefills_the_call_and_names_the_schema_to_constrain():
    named = _plan("get_weather")
    assert named.prefill == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert named.json_schema["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    whole = _plan("ping", tools=(PING, WEATHER))
    assert whole.prefill.endswith('{"name": "ping", "arguments": {}}\n</tool_call>')
    assert _plan("required", tools=(PING, WEATHER)).prefill == "<tool_call>\n"     # two to choose from
    assert _plan("auto").prefill == "" and _plan("auto").json_schema is None
    assert _plan(parallel=False).stop == ("</tool_call>",)


def test_the_tool_result_tags_are_stripped_from_replies_in_any_chunks():
    """The shipped template wraps tool results in <tool_response> tags (found by a probe, result_tags.py); a
    reply that imitates them has them stripped wherever they are (calls still parsed), with tools and with
    tool_choice none; a template without such a wrapper strips nothing (negative control)."""
    from stateful_hf.serve.result_tags import result_tags
    from stateful_hf.serve.tool_parse import reply_reader

    tok = tiny_tokenizer()
    text = ('<tool_response>\nIt is <b>sunny</b>.\n</tool_response>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>')
    for choice, calls in (("auto", [("get_weather", '{"city": "Paris"}')]), ("none", [])):
        p = _plan(choice)
        prompt = tool_mod.render(tok, ASK, p)
        for step in (1, 3, 7, len(text)):
            r = reply_reader(tok, p, prompt).parser
            pieces = [x for i in range(0, len(text), step) for x in r.feed(text[i:i + step])] + r.close()
            shown = "".join(x for k, x in pieces if k == "text")
            assert shown.startswith("It is <b>sunny</b>.") and "tool_response" not in shown, (choice, step, shown)
            assert [(c.name, c.arguments) for k, c in pieces if k == "call_done"] == calls
    shipped = tool_mod.CHATML_TOOLS.read_text()
    assert result_tags(lambda chat: tok.apply_chat_template(chat, chat_template=shipped, tokenize=False)) == \
        ("<tool_response>", "</tool_response>")
    bare = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert result_tags(lambda chat: tok.apply_chat_template(chat, chat_template=bare, tokenize=False)) is None


def test_the_shipped_template_renders_smollm2s_chats_as_its_own():
    tok = tiny_tokenizer()
    chats = [ASK, [{"role": "system", "content": "S"}, *ASK, {"role": "assistant", "content": "ok"}, *ASK]]
    shipped = tool_mod.CHATML_TOOLS.read_text()
    for msgs in chats:
        assert tok.apply_chat_template(msgs, chat_template=shipped, add_generation_prompt=True, tokenize=False) == \
            tok.apply_chat_template(msgs, chat_template=SMOLLM2_TEMPLATE, add_generation_prompt=True, tokenize=False)


def test_a_template_that_cannot_render_tools_is_a_400_naming_tools():
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
    with pytest.raises(APIError) as e:
        tool_mod.plan(tok, [WEATHER], "auto", True)
    assert e.value.status == 400 and e.value.param == "tools" and "--chat-template" in e.value.message


# ---- through the server ----------------------------------------------------------------------------

def test_forced_calls_come_back_as_tool_calls(client):
    for choice in ("required", {"type": "function", "function": {"name": "ping"}}):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[PING], tool_choice=choice,
                                           max_tokens=4, temperature=0)
        calls = r.choices[0].message.tool_calls
        assert [(c.function.name, c.function.arguments, c.type) for c in calls] == [("ping", "{}", "function")]
        assert calls[0].id.startswith("call_")
    # negative control: unforced, the random model writes no call, and tool_choice none parses nothing
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[PING], tool_choice=choice,
                                           max_tokens=4, temperature=0)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_forced_calls_follow_the_functions_schema(client):
    """A forced call's generated rest is held to its function's JSON schema by the grammar (structured.py):
    the tiny random model's arguments parse and validate, for a named function and for "required" among two."""
    jsonschema = pytest.importorskip("jsonschema")
    where = {"type": "function", "function": {"name": "where", "parameters": {       # bounded: the call closes
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}}
    for tools, choice in (([where], {"type": "function", "function": {"name": "where"}}),
                          ([where, PING], "required")):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice,
                                           max_tokens=400, temperature=0)     # up to 16 blanks a gap
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].finish_reason == "tool_calls", r.choices[0].message.content
        fn = next(t["function"] for t in tools if t["function"]["name"] == calls[0].function.name)
        jsonschema.validate(json.loads(calls[0].function.arguments), fn["parameters"])
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[where], tool_choice="required", n=2,
                                       max_tokens=400, seed=3)            # every choice is held to it
    for c in r.choices:
        assert c.message.tool_calls and c.finish_reason == "tool_calls", c.message.content
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), where["function"]["parameters"])
    # negative control: a response_format beside a forced call is refused, naming the field
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                       response_format={"type": "json_object"}, max_tokens=4)
    assert e.value.body["param"] == "response_format"


def _pydantic_tools():
    """Two tools whose parameters are Pydantic's `model_json_schema` (a `$ref` into root `$defs`), each with
    its own `Place` of another shape (the same `$defs` name): bounded, so a random model's call closes."""
    from typing import Literal

    from pydantic import BaseModel, ConfigDict

    def place(field: str, values: tuple):
        return type("Place", (BaseModel,), {"__annotations__": {field: Literal[values]},
                                            "model_config": ConfigDict(extra="forbid")})

    trip = type("Trip", (BaseModel,), {"__annotations__": {"to": place("city", ("Paris", "Rome")), "by_train": bool},
                                       "model_config": ConfigDict(extra="forbid")})
    stay = type("Stay", (BaseModel,), {"__annotations__": {"at": place("country", ("FR", "IT"))},
                                       "model_config": ConfigDict(extra="forbid")})
    models = {"trip": trip, "stay": stay}
    tools = [{"type": "function", "function": {"name": n, "parameters": m.model_json_schema()}}
             for n, m in models.items()]
    assert all("$defs" in t["function"]["parameters"] for t in tools)
    return tools, models


def test_a_merged_call_schema_keeps_each_tools_refs():
    """`required` over several tools merges their schemas (call_schema.py): each tool's local `$ref`s are
    rebased onto its branch, so they resolve to its own `$defs` (two `Place`s apart), and the input is unchanged."""
    jsonschema = pytest.importorskip("jsonschema")
    tools, _ = _pydantic_tools()
    before = json.dumps(tools)
    merged = _plan("required", tools=tools).json_schema
    assert json.dumps(tools) == before
    ok = [{"name": "trip", "arguments": {"to": {"city": "Rome"}, "by_train": True}},
          {"name": "stay", "arguments": {"at": {"country": "FR"}}}]
    bad = [{"name": "trip", "arguments": {"to": {"country": "FR"}, "by_train": True}},     # stay's Place
           {"name": "stay", "arguments": {"at": {"city": "Rome"}}}]
    for call in ok:
        jsonschema.validate(call, merged)
    for call in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call, merged)
    # negative control: merged without rebasing, the refs name the root's (absent) $defs
    raw = {"anyOf": [{"properties": {"arguments": t["function"]["parameters"]}} for t in tools]}
    with pytest.raises(pytest.importorskip("referencing.exceptions").Unresolvable):
        jsonschema.validate(ok[0], raw)


def test_pydantic_schemas_work_under_every_tool_choice(client):
    """Tools whose parameters use `$ref` / `$defs` (Pydantic's): forced by "required" among two (their schemas
    merged: before, a 400 "cannot be compiled") and by name, the grammar holds the random model's arguments to
    the chosen tool's model (validated by Pydantic); "auto" is a 200 too."""
    tools, models = _pydantic_tools()
    for choice in ("required", {"type": "function", "function": {"name": "trip"}},
                   {"type": "function", "function": {"name": "stay"}}):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice,
                                           max_tokens=400, temperature=0)
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].finish_reason == "tool_calls", (choice, r.choices[0].message.content)
        if isinstance(choice, dict):
            assert calls[0].function.name == choice["function"]["name"]
        models[calls[0].function.name].model_validate_json(calls[0].function.arguments)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="auto", max_tokens=4,
                                       temperature=0)
    assert r.choices[0].finish_reason == "length"


def test_streamed_tool_calls_reassemble_to_the_reply(client):
    kw = dict(model=MODEL, messages=ASK, tools=[PING, WEATHER], tool_choice={"type": "function",
              "function": {"name": "ping"}}, max_tokens=5, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    calls, content, reason, used = {}, "", None, None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            used = chunk.usage
        for ch in chunk.choices:
            content += ch.delta.content or ""
            reason = ch.finish_reason or reason
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = d.id or c["id"]
                c["name"] += (d.function.name or "") if d.function else ""
                c["arguments"] += (d.function.arguments or "") if d.function else ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert content == (whole.message.content or "") and reason == whole.finish_reason
    assert used is not None and used.completion_tokens == 5 and used.prompt_tokens_details.cached_tokens > 0


def test_a_calls_arguments_stream_a_token_at_a_time(client):
    """A named call with a string parameter, cut by max_tokens inside its value: the arguments arrive
    in a delta per generated token past the blanks the grammar allows (not whole at the close) and
    reassemble to the non-streaming call."""
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice={"type": "function",
              "function": {"name": "get_weather"}}, max_tokens=100, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    deltas, args, reason = 0, "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            reason = ch.finish_reason or reason
            for d in ch.delta.tool_calls or []:
                piece = (d.function.arguments or "") if d.function else ""
                deltas, args = deltas + bool(piece), args + piece
    assert [c.function.name for c in whole.message.tool_calls] == ["get_weather"]
    assert args == whole.message.tool_calls[0].function.arguments and reason == whole.finish_reason
    assert deltas >= 10, (deltas, args)        # negative control: a call sent whole at its close is 1 delta


def test_tool_turns_in_the_history_are_reused_and_exact(url, client):
    sid = "tools-history"
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[PING], tool_choice="required",
                                           max_tokens=3, temperature=0, extra_headers={"X-Session-Id": sid})
    msg = first.choices[0].message
    history = [*ASK, {"role": "assistant", "content": msg.content,
                      "tool_calls": [c.model_dump() for c in msg.tool_calls]},
               {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "pong"}]
    again = client.chat.completions.create(model=MODEL, messages=history, tools=[PING], max_tokens=6, temperature=0,
                                           extra_headers={"X-Session-Id": sid})
    oracle = client.chat.completions.create(model=MODEL, messages=history, tools=[PING], max_tokens=6, temperature=0,
                                            extra_body={"cache_salt": "tools-oracle"})
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert oracle.usage.prompt_tokens_details.cached_tokens == 0          # the oracle reused nothing
    assert again.choices[0].message.content == oracle.choices[0].message.content


BAD = [  # (body fields, param the 400 names)
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools.0.function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [PING, PING]}, "tools.1.function.name"),
    ({"tools": "ping"}, "tools"),
    ({"tools": [PING], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [PING], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]}, "messages.1.tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}]},
     "messages.1.tool_calls.0.function"),
    ({"functions": [{"name": "f"}]}, "functions"),
]


def test_bad_tool_input_is_a_400_naming_the_field_and_the_session_is_kept(url):
    sid = "tools-bad"
    r = _post(url, {"messages": ASK}, sid)
    assert r.status_code == 200, r.text
    held = httpx.get(f"{url}/v1/sessions/{sid}").json()["tokens"]
    for fields, param in BAD:
        r = _post(url, {"messages": ASK, **fields}, sid)
        assert r.status_code == 400, (fields, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], (fields, err)
    assert httpx.get(f"{url}/v1/sessions/{sid}").json()["tokens"] == held
    follow = _post(url, {"messages": [*ASK, {"role": "assistant", "content": "ok"}, *ASK]}, sid)
    assert follow.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_x_session_retain_keeps_a_session_through_a_tool_pause(url):
    """`X-Session-Retain: seconds` (retain.py): once the turn ends its session is ranked as if active that
    much later (clamped to --max-retain); a bad value is a 400 naming the header and changes nothing."""
    msgs = {"messages": [{"role": "user", "content": "Weather in Paris?"}]}

    def info(sid):
        return httpx.get(f"{url}/v1/sessions/{sid}", timeout=30).json()

    assert _post(url, msgs, "plain").status_code == 200
    assert info("plain")["retained_seconds"] == 0                # negative control: no header, no retention
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, **msgs},
                   headers={"X-Session-Id": "paused", "X-Session-Retain": "30"}, timeout=120)
    assert r.status_code == 200 and 20 < info("paused")["retained_seconds"] <= 30
    tokens = info("paused")["tokens"]
    for bad in ("soon", "-1", "nan", "inf"):
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, **msgs},
                       headers={"X-Session-Id": "paused", "X-Session-Retain": bad}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Session-Retain", (bad, r.text)
    assert info("paused")["tokens"] == tokens
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120,
                      json={"model": MODEL, "max_tokens": 4, "stream": True, **msgs},
                      headers={"X-Session-Id": "streamed", "X-Session-Retain": "100000"}) as r:
        assert r.status_code == 200 and "[DONE]" in "".join(r.iter_text())
    assert 100 < info("streamed")["retained_seconds"] <= 120     # clamped to --max-retain
