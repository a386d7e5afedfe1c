"""The Responses API through the `openai` client against a server subprocess (the tiny model, two
tenants): continuations with previous_response_id reuse the chain's session and answer exactly as the
whole conversation sent again without reuse (a unique cache_salt, which reuses nothing: the oracle);
forks; store=false; instructions not carried over; function calls and their outputs; streaming events;
truncation; GET / DELETE; another tenant's ids and bad input (OpenAI's error shape, naming the field).
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from agent_server import serve  # noqa: E402

MODEL = "tiny-random"
CONTEXT = 1024
PING = {"type": "function", "name": "ping", "description": "Ping the server", "parameters": {"type": "object",
                                                                                            "properties": {}}}
HELLO = "Hello! Tell me about the weather, the sea and the mountains."
SALTS = (f"oracle-{i}" for i in itertools.count())


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("responses"), "--model", MODEL, "--served-model-name", MODEL,
               "--max-model-len", str(CONTEXT), keys=True) as u:
        yield u


@pytest.fixture(scope="module")
def acme(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="key-acme", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def globex(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="key-globex", timeout=120, max_retries=0)


def _create(client, **kw):
    return client.responses.create(**{"model": MODEL, "max_output_tokens": 5, "temperature": 0, **kw})


def _items(r) -> list[dict]:
    return [o.model_dump(exclude_none=True) for o in r.output]


def _oracle(client, items: list, **kw):
    """The same conversation sent whole, in a throwaway session that reuses nothing."""
    r = _create(client, input=items, store=False, extra_body={"cache_salt": next(SALTS)}, **kw)
    assert r.usage.input_tokens_details.cached_tokens == 0
    return r


def _post(url: str, body: dict, key: str = "key-acme") -> httpx.Response:
    return httpx.post(url + "/v1/responses", json={"model": MODEL, "max_output_tokens": 3, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=120)


def test_a_continuation_reuses_the_chain_and_is_exact(acme):
    first = _create(acme, input=HELLO, instructions="Be brief.")
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"  # random model
    then = [{"role": "user", "content": "And the stars at night?"}]
    second = _create(acme, input=then, instructions="Be brief.", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens // 2
    whole = [{"role": "user", "content": HELLO}, *_items(first), *then]
    oracle = _oracle(acme, whole, instructions="Be brief.")
    assert second.output_text == oracle.output_text and second.usage.input_tokens == oracle.usage.input_tokens
    # instructions are not carried over: without them the prompt is the conversation alone
    bare = _create(acme, input=then, previous_response_id=first.id)
    assert bare.usage.input_tokens < second.usage.input_tokens
    assert bare.output_text == _oracle(acme, whole).output_text


def test_two_continuations_of_one_response_are_separate_sessions(acme):
    first = _create(acme, input=HELLO)
    a = _create(acme, input="Tell me about the sea.", previous_response_id=first.id)
    b = _create(acme, input="What would you like to talk about?", previous_response_id=first.id)   # a fork
    assert b.usage.input_tokens_details.cached_tokens >= 32             # the shared prefix's full chunks
    assert b.output_text == _oracle(acme, [{"role": "user", "content": HELLO}, *_items(first),
                                           {"role": "user", "content": "What would you like to talk about?"}]
                                    ).output_text
    # a's session still holds a's turn (the fork did not cut it): continuing a reuses all of a's prompt
    c = _create(acme, input="Thanks!", previous_response_id=a.id)
    assert c.usage.input_tokens_details.cached_tokens >= a.usage.input_tokens - 2
    whole = [{"role": "user", "content": HELLO}, *_items(first), {"role": "user", "content": "Tell me about the sea."},
             *_items(a), {"role": "user", "content": "Thanks!"}]
    assert c.output_text == _oracle(acme, whole).output_text


def test_forks_with_and_without_instructions_keep_the_response_reusable(acme):
    """Continuations of one response with and without `instructions`, interleaved: a continuation whose
    prompt does not extend the response's (no instructions) forks instead of cutting the response's session,
    so the response stays continuable with its KV reused (before: the bare continuation took the session and
    cut it, and the next continuation with instructions reused 0 tokens). Each answer is exact."""
    first = _create(acme, input=HELLO * 3, instructions="Be brief.")
    history = [{"role": "user", "content": HELLO * 3}, *_items(first)]

    def then(r, text: str, **kw):
        after = _create(acme, input=text, previous_response_id=first.id, **kw)
        assert after.output_text == _oracle(acme, [*history, {"role": "user", "content": text}], **kw).output_text
        return after

    bare = then(first, "And the stars?")                                   # other prompt: a fork
    briefed = then(first, "And the moon?", instructions="Be brief.")        # extends first's: its session
    assert briefed.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    again = then(first, "And the sun?", instructions="Be brief.")          # a fork of the same prefix
    assert again.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 32 * 32 >= 64
    bare2 = then(first, "And the rain?")                                   # shares bare's rendering
    assert bare2.usage.input_tokens_details.cached_tokens >= 64
    assert bare.usage.input_tokens_details.cached_tokens < 32 <= bare2.usage.input_tokens_details.cached_tokens


def test_store_false_cannot_be_fetched_or_continued(url, acme):
    r = _create(acme, input=HELLO, store=False)
    assert r.store is False
    assert httpx.get(f"{url}/v1/responses/{r.id}", headers={"Authorization": "Bearer key-acme"}).status_code == 404
    err = _post(url, {"input": "more", "previous_response_id": r.id}).json()["error"]
    assert err["param"] == "previous_response_id" and err["code"] == "previous_response_not_found"


def test_get_delete_and_another_tenants_ids(url, acme, globex):
    r = _create(acme, input=HELLO)
    assert acme.responses.retrieve(r.id).output_text == r.output_text
    with pytest.raises(openai.NotFoundError):
        globex.responses.retrieve(r.id)
    resp = _post(url, {"input": "more", "previous_response_id": r.id}, key="key-globex")
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        globex.responses.delete(r.id)
    acme.responses.retrieve(r.id)                                 # still there for its tenant
    acme.responses.delete(r.id)
    for call in (lambda: acme.responses.retrieve(r.id), lambda: acme.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["param"] == "response_id"


def test_function_calls_and_their_outputs(acme):
    call = _create(acme, input=HELLO, tools=[PING], tool_choice={"type": "function", "name": "ping"})
    fc = [o for o in call.output if o.type == "function_call"]
    assert [(o.name, o.arguments, o.status) for o in fc] == [("ping", "{}", "completed")]
    result = [{"type": "function_call_output", "call_id": fc[0].call_id, "output": "pong"}]
    after = _create(acme, input=result, tools=[PING], previous_response_id=call.id)
    assert after.usage.input_tokens_details.cached_tokens > 0
    oracle = _oracle(acme, [{"role": "user", "content": HELLO}, *_items(call), *result], tools=[PING])
    assert after.output_text == oracle.output_text
    # negative control: without forcing, the random model calls nothing
    assert all(o.type == "message" for o in _create(acme, input=HELLO, tools=[PING]).output)


def test_streamed_events_build_the_same_response(acme):
    kw = dict(input=HELLO, tools=[PING], tool_choice="required", store=False, max_output_tokens=6)
    whole = _create(acme, **kw)
    events = list(_create(acme, stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    for kind in ("response.output_item.added", "response.function_call_arguments.delta",
                 "response.function_call_arguments.done", "response.output_text.delta", "response.output_text.done",
                 "response.output_item.done"):
        assert kind in kinds, kind
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    final = events[-1].response
    assert text == whole.output_text == final.output_text and args == "{}"
    assert [(o.type, getattr(o, "name", None)) for o in final.output] == \
        [(o.type, getattr(o, "name", None)) for o in whole.output]


def test_truncation_auto_drops_the_oldest_items(url, acme):
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: " + HELLO * 6} for i in range(15)]
    r = _post(url, {"input": long})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "input"
    ok = _create(acme, input=long, truncation="auto", max_output_tokens=3)
    assert ok.usage.input_tokens + 3 <= CONTEXT and ok.truncation == "auto"


BAD = [  # (body fields, status, param)
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input.0.type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400, "input.0.call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input.0.content.0.type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input.0.role"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name"}]}, 400, "tools.0.name"),
    ({"input": "hi", "tools": [PING], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice.name"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}}, 400, "text.format"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({}, 400, "input"),
]


def test_bad_input_names_the_field(url):
    for body, status, param in BAD:
        r = _post(url, body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], (body, err)


def test_responses_cap_and_ttl_flags(tmp_path):
    """--responses-cap 1: storing a second response forgets the first (its id is then a 404, to GET and
    as previous_response_id); --responses-ttl is taken (a day here: nothing expires)."""
    with serve(tmp_path, "--model", MODEL, "--served-model-name", MODEL, "--max-model-len", str(CONTEXT),
               "--responses-cap", "1", "--responses-ttl", "86400", keys=True) as u:
        client = openai.OpenAI(base_url=u + "/v1", api_key="key-acme", timeout=120, max_retries=0)
        first = _create(client, input=HELLO)
        assert client.responses.retrieve(first.id).id == first.id
        second = _create(client, input="And the sky?")
        assert client.responses.retrieve(second.id).id == second.id
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError, match="Previous response"):
            _create(client, input="more", previous_response_id=first.id)
        assert _create(client, input="more", previous_response_id=second.id).id.startswith("resp_")
