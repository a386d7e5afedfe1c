"""`response_format` over HTTP with the official `openai` client against a real server subprocess (the
tiny random model, whose free answers are not JSON: the negative controls): json_schema (strict) and
json_object, streamed and not, `chat.completions.parse` with a pydantic model, a free turn after a
constrained one on the same session, and the 400s naming `response_format` (a bad schema, a bad shape,
a compile over the time limit)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")

from conftest import slow_schema, stop_server, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "color"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "color": {"enum": ["red", "green", "blue"]}}}
ASK = [{"role": "user", "content": "Tell me about the weather."}]
OBJECT_ASK = [{"role": "user", "content": "Chunks move"}]
STRICT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}


class Weather(pydantic.BaseModel):
    ok: bool
    n: int = pydantic.Field(ge=0, le=99)
    color: Literal["red", "green", "blue"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The tiny model saved as a checkpoint and served by `python -m stateful_hf.serve`; yields (url, name)."""
    from stateful_hf.testing import tiny_llama, tiny_tokenizer
    d = tmp_path_factory.mktemp("serve_structured")
    model_dir = d / "tiny-model"
    tiny_llama().save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    port, log = _free_port(), d / "server.log"
    url = f"http://127.0.0.1:{port}"
    env = {**{k: v for k, v in os.environ.items() if k != "STATEFUL_HF_API_KEY"}, "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stateful_hf.serve", "--model", str(model_dir), "--port",
                                 str(port), "--dtype", "float32", "--log-level", "WARNING"],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(proc, url, log)
        yield url, str(model_dir).rstrip("/")
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", timeout=120, max_retries=0)


def _content(client, server, messages, **kw) -> tuple[str, str]:
    r = client.chat.completions.create(model=server[1], messages=messages, max_tokens=200, **kw)
    return r.choices[0].message.content, r.choices[0].finish_reason


def test_json_schema_strict(server, client):
    text, finish = _content(client, server, ASK, response_format=STRICT)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    free, _ = _content(client, server, ASK)                  # negative control
    with pytest.raises(ValueError):
        json.loads(free)


def test_json_object(server, client):
    text, finish = _content(client, server, OBJECT_ASK, response_format={"type": "json_object"})
    assert finish == "stop" and isinstance(json.loads(text), dict), text
    free, _ = _content(client, server, OBJECT_ASK, response_format={"type": "text"})
    with pytest.raises(ValueError):
        json.loads(free)


def test_streamed_json_schema(server, client):
    stream = client.chat.completions.create(model=server[1], messages=ASK, max_tokens=200, response_format=STRICT,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_parse_with_a_pydantic_model(server, client):
    r = client.chat.completions.parse(model=server[1], messages=ASK, max_tokens=200, response_format=Weather)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Weather), r
    assert Weather.model_validate_json(r.choices[0].message.content) == parsed


def test_a_free_turn_after_a_constrained_one_reuses_and_is_exact(server, client):
    """The session keeps the constrained answer's KV; the free next turn equals the same conversation
    sent to a fresh session (no reuse: another cache_salt, so no shared prefix either)."""
    name, first = server[1], client.chat.completions.create(
        model=server[1], messages=ASK, max_tokens=200, response_format=STRICT, extra_headers={"X-Session-Id": "js"})
    convo = [*ASK, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And tomorrow?"}]
    again = client.chat.completions.create(model=name, messages=convo, max_tokens=12,
                                           extra_headers={"X-Session-Id": "js"})
    fresh = client.chat.completions.create(model=name, messages=convo, max_tokens=12,   # no shared prefix either
                                           extra_headers={"X-Session-Id": "js-fresh"},
                                           extra_body={"cache_salt": "fresh"})
    assert again.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == fresh.choices[0].message.content


@pytest.mark.parametrize(("response_format", "says"), [
    ({"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strin"}}}, "Unsupported type"),
    ({"type": "json_schema", "json_schema": {"name": "bad", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}, "Regex"),
    ({"type": "json_schema", "json_schema": {"name": "no spaces allowed", "schema": SCHEMA}}, "json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}}, "json_schema.schema"),
    ({"type": "json_schema"}, "needs `json_schema`"),
    ({"type": "xml"}, "type must be one of"),
])
def test_bad_response_formats_are_400s_naming_response_format(server, client, response_format, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server[1], messages=ASK, max_tokens=8, response_format=response_format)
    assert e.value.param == "response_format" and says in e.value.message, e.value.body
    assert e.value.body["message"].startswith("response_format: ")
    # the server goes on
    assert client.chat.completions.create(model=server[1], messages=ASK, max_tokens=2).choices


def test_completions_still_refuse_response_format(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server[1], prompt="Hello", max_tokens=4,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert e.value.param == "response_format" and e.value.code == "unsupported_parameter"


def test_a_compile_over_the_time_limit_is_a_400():
    """In-process (the limit is the engine's option): a schema that compiles slower than the limit."""
    from stateful_hf.serve import ServerThread, build_local
    from stateful_hf.serve.server import EngineOptions
    from stateful_hf.testing import tiny_llama, tiny_tokenizer
    app, router = build_local(tiny_llama(), tiny_tokenizer(), "tiny", EngineOptions(grammar_compile_timeout=0.001))
    slow = {"type": "json_schema", "json_schema": {"name": "slow", "schema": slow_schema()}}
    try:
        with ServerThread(app) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=60, max_retries=0)
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, response_format=slow)
            assert e.value.param == "response_format" and e.value.code == "schema_too_complex"
            assert "took longer than the limit of 0.001 s" in e.value.message
    finally:
        for client in router.clients:
            client.replica.shutdown()


def test_a_replica_compiles_a_grammar_it_has_not_seen_and_reports_a_bad_one():
    """In a cluster the app compiles in another process: the replica compiles (off its event loop)
    before the turn takes anything, and a schema it cannot compile is an error event naming the field."""
    import asyncio

    from stateful_hf import SamplingParams
    from stateful_hf.serve.server import EngineOptions
    from stateful_hf.testing import tiny_llama, tiny_tokenizer
    tok = tiny_tokenizer()
    replica = EngineOptions().replica(tiny_llama(), tok)
    ids = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True)["input_ids"]

    async def events(constraint) -> list[dict]:
        return [ev async for ev in replica.stream(None, ids, SamplingParams(max_new_tokens=200, constraint=constraint))]
    try:
        bad = asyncio.run(events({"type": "strin"}))
        assert [ev["type"] for ev in bad] == ["error"]
        assert bad[0]["error"]["status"] == 400 and bad[0]["error"]["param"] == "response_format"
        assert bad[0]["error"]["code"] == "invalid_schema" and "Unsupported type" in bad[0]["error"]["message"]
        good = asyncio.run(events(SCHEMA))
        assert good[-1]["type"] == "done" and good[-1]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(good[-1]["text"]), SCHEMA)
    finally:
        replica.shutdown()
