"""The Responses API's background responses, cancel and log-probabilities, through the `openai` client
against a server subprocess (the tiny model, float32, greedy): a background response is created
`queued`, polled with GET to its end, and answers exactly as the same request in the foreground; a long
one cancelled mid-run is `cancelled` and its session takes the next turn at once; cancel's refusals
(a synchronous response, a completed one) follow OpenAI's; `include` + `top_logprobs` return the
reply's log-probabilities, whose top entry is the chosen token under greedy.
"""

from __future__ import annotations

import math
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from agent_server import serve  # noqa: E402

MODEL = "tiny-random"
CONTEXT = 2048
HELLO = "Hello! Tell me about the weather, the sea and the mountains."
LOGPROBS = "message.output_text.logprobs"


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("background"), "--model", MODEL, "--served-model-name", MODEL,
               "--max-model-len", str(CONTEXT), keys=True) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="key-acme", timeout=120, max_retries=0)


def _create(client, **kw):
    return client.responses.create(**{"model": MODEL, "max_output_tokens": 8, "temperature": 0, **kw})


def _poll(client, rid: str, until=("completed", "incomplete", "failed", "cancelled"), timeout: float = 120):
    """The response once its status is in `until` (polled with GET), and every status seen on the way."""
    seen, deadline = [], time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(rid)
        if not seen or seen[-1] != r.status:
            seen.append(r.status)
        if r.status in until:
            return r, seen
        assert time.monotonic() < deadline, f"{rid} still {r.status} after {timeout} s"
        time.sleep(0.02)


def _items(r) -> list[dict]:
    return [o.model_dump(exclude_none=True, exclude={"id"}) for o in r.output]


def test_a_background_response_polls_to_the_foreground_answer(client):
    fg = _create(client, input=HELLO, max_output_tokens=24)
    bg = _create(client, input=HELLO, max_output_tokens=24, background=True)
    assert bg.status == "queued" and bg.background is True and bg.output == [] and bg.usage is None
    done, seen = _poll(client, bg.id)
    assert seen[0] in ("queued", "in_progress", "incomplete") and seen[-1] == fg.status == "incomplete"
    assert done.output_text == fg.output_text and _items(done) == _items(fg) and done.output_text
    assert done.usage.output_tokens == fg.usage.output_tokens == 24
    assert done.usage.input_tokens == fg.usage.input_tokens
    # a finished background response is stored like any: continuing it reuses its session's KV, exactly
    after = _create(client, input="And the stars?", previous_response_id=bg.id)
    same = _create(client, input="And the stars?", previous_response_id=fg.id)
    assert after.output_text == same.output_text
    assert after.usage.input_tokens_details.cached_tokens >= done.usage.input_tokens


def test_cancel_mid_run_frees_the_session_for_the_next_turn(url, client):
    sid = "bg-cancel-1"
    long = _create(client, input=HELLO, max_output_tokens=CONTEXT - 100, background=True,
                   extra_body={"session_id": sid})
    running, _ = _poll(client, long.id, until=("in_progress", "completed", "incomplete", "failed"))
    assert running.status == "in_progress", running.status        # else the test would prove nothing
    t0 = time.monotonic()
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.output == [] and cancelled.usage is None
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"   # cancelling twice is idempotent
    # the engine stopped the turn: the session is free well before the ~1,950 tokens (~17 s here), and holds
    # only what was generated until the cancel
    deadline, info = time.monotonic() + 10, None
    while info is None or info["busy"]:
        assert time.monotonic() < deadline, f"the session is still busy 10 s after the cancel: {info}"
        info = httpx.get(f"{url}/v1/sessions/{sid}", headers={"Authorization": "Bearer key-acme"}, timeout=30).json()
    assert info["tokens"] < CONTEXT // 2, info
    # the session takes the next turn now (not after the ~4,000 tokens), and it answers exactly
    nxt = _create(client, input="And the stars?", extra_body={"session_id": sid})
    assert time.monotonic() - t0 < 30
    oracle = _create(client, input="And the stars?", store=False, extra_body={"cache_salt": "bg-oracle"})
    assert nxt.output_text == oracle.output_text and nxt.status == "incomplete"
    # a cancelled response cannot be continued (it has no reply)
    r = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "more", "previous_response_id": long.id},
                   headers={"Authorization": "Bearer key-acme"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


def test_cancel_refusals_follow_openai(client):
    fg = _create(client, input=HELLO)
    with pytest.raises(openai.BadRequestError, match="synchronous") as e:
        client.responses.cancel(fg.id)
    assert e.value.body["param"] == "response_id"
    bg = _create(client, input=HELLO, background=True)
    done, _ = _poll(client, bg.id)
    with pytest.raises(openai.BadRequestError, match=f"Cannot cancel a {done.status} response"):
        client.responses.cancel(bg.id)
    assert client.responses.retrieve(bg.id).status == done.status          # unchanged
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


def test_deleting_a_running_background_response_cancels_it(client):
    long = _create(client, input=HELLO, max_output_tokens=CONTEXT - 100, background=True)
    client.responses.delete(long.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(long.id)


def test_background_refusals_name_the_field(url):
    for body, param in [({"background": True, "stream": True}, "background"),
                        ({"background": True, "store": False}, "background"),
                        ({"include": ["reasoning.encrypted_content"]}, "include.0"),
                        ({"include": [LOGPROBS, "nope"]}, "include.1"),
                        ({"top_logprobs": 21, "include": [LOGPROBS]}, "top_logprobs")]:
        r = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2, **body},
                       headers={"Authorization": "Bearer key-acme"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_logprobs_top_entry_is_the_chosen_token_under_greedy(client):
    r = _create(client, input=HELLO, include=[LOGPROBS], top_logprobs=3, store=False)
    part = r.output[0].content[0]
    assert len(part.logprobs) == r.usage.output_tokens == 8
    assert "".join(lp.token for lp in part.logprobs) == part.text         # the reply, token by token
    for lp in part.logprobs:
        assert len(lp.top_logprobs) == 3 and lp.logprob <= 0
        top = lp.top_logprobs[0]
        assert top.token == lp.token and math.isclose(top.logprob, lp.logprob, abs_tol=1e-5)
        assert [t.logprob for t in lp.top_logprobs] == sorted((t.logprob for t in lp.top_logprobs), reverse=True)
    # negative control: under sampling at a high temperature some chosen token is not the top one
    hot = _create(client, input=HELLO, include=[LOGPROBS], top_logprobs=1, store=False, temperature=2.0,
                  max_output_tokens=32, extra_body={"seed": 3})
    assert any(lp.top_logprobs[0].token != lp.token for lp in hot.output[0].content[0].logprobs)
    # without the include, no log-probabilities (top_logprobs alone asks for nothing)
    plain = _create(client, input=HELLO, top_logprobs=3, store=False)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == r.output_text
