"""`n` choices as forks of one prompt (serve/choices.py), through an in-process server on the tiny float32
model: greedy choices equal stateless `generate`; seeded choice i equals the same request alone with seed + i;
the prompt is computed once (the engine's computed prompt rows; the control: choices submitted together
compute it each); a session's next turn continues the choice it sends back from that fork's KV (only the new
rows computed), and frees the others; a list of prompts x n is prompt-major; streamed chunks carry their choice's index.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from conftest import Conversation  # noqa: E402
from test_engine import expected  # noqa: E402

from stateful_hf import Engine, SamplingParams  # noqa: E402
from stateful_hf.serve import EngineOptions, ServerThread, build_local  # noqa: E402
from stateful_hf.serve.choices import FORK_MARK, choice_seed  # noqa: E402
from stateful_hf.testing import tiny_llama, tiny_tokenizer  # noqa: E402

MODEL = "tiny-n"
HOT = {"temperature": 1.0, "ignore_eos": True}
CHUNK = 32                        # the store's default chunk


@pytest.fixture(scope="module")
def served():
    # batch-invariant: a choice's rows give the same floats whichever steps they share (the logprobs test
    # compares two runs of n choices, whose forks start at times that vary)
    app, router = build_local(tiny_llama(), tiny_tokenizer(), MODEL, EngineOptions(batch_invariant=True))
    with ServerThread(app) as srv:
        yield srv, router.clients[0].replica
    router.clients[0].replica.shutdown()


@pytest.fixture(scope="module")
def oracle():
    return tiny_llama()


def complete(srv, body: dict, sid: str | None = None) -> dict:
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "return_token_ids": True, **body},
                   headers={"X-Session-Id": sid} if sid else {}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def chat(srv, body: dict) -> dict:
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "return_token_ids": True, **body},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def forks_in(replica) -> list[str]:
    return [k for k in replica.store.session_ids() if FORK_MARK in k]


def test_greedy_choices_equal_generate(served, oracle):
    srv, replica = served
    ids = Conversation(seed=301, first=45).ids[0].tolist()
    out = complete(srv, {"prompt": ids, "n": 3, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    want = expected(oracle, ids, 8, eos_token_id=None)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["token_ids"] == want for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 3 * 8   # prompt once
    one = chat(srv, {"messages": [{"role": "user", "content": "Tell me about the sea"}], "max_tokens": 6,
                     "temperature": 0})
    many = chat(srv, {"messages": [{"role": "user", "content": "Tell me about the sea"}], "max_tokens": 6,
                      "temperature": 0, "n": 2})
    assert [c["message"] for c in many["choices"]] == [one["choices"][0]["message"]] * 2
    assert many["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    replica.store.check_integrity()


def test_seeded_choice_i_equals_the_request_alone_with_seed_plus_i(served):
    srv, replica = served
    ids = Conversation(seed=302, first=50).ids[0].tolist()
    many = complete(srv, {"prompt": ids, "n": 3, "max_tokens": 8, "seed": 7, **HOT})["choices"]
    alone = [complete(srv, {"prompt": ids, "max_tokens": 8, "seed": 7 + i, **HOT})["choices"][0] for i in range(3)]
    assert [c["token_ids"] for c in many] == [c["token_ids"] for c in alone]
    assert len({tuple(c["token_ids"]) for c in many}) == 3          # not vacuous: the seeds give three answers
    top = 2**63 - 1                                                  # seed + i wraps within int64
    assert choice_seed(top, 1) == -2**63 and choice_seed(None, 2) is None
    wrapped = complete(srv, {"prompt": ids, "n": 2, "max_tokens": 6, "seed": top, **HOT})["choices"][1]
    assert wrapped["token_ids"] == complete(srv, {"prompt": ids, "max_tokens": 6, "seed": -2**63, **HOT}
                                            )["choices"][0]["token_ids"]
    messages = [{"role": "user", "content": "Name a colour"}]
    hot_chat = chat(srv, {"messages": messages, "n": 2, "max_tokens": 6, "seed": 11, **HOT})["choices"]
    assert hot_chat[1]["token_ids"] == chat(srv, {"messages": messages, "max_tokens": 6, "seed": 12, **HOT}
                                            )["choices"][0]["token_ids"]
    replica.store.check_integrity()


def test_the_prompt_is_computed_once(served, monkeypatch):
    """n = 3 on a fresh 70-token prompt computes its rows once (70) plus, per fork, the prompt's last row (its
    first token's logits; the fork shares the 2 full chunks and copies the partial one): 72, not 210. Controls:
    with the store's fork refused each choice adopts the full chunks and computes the partial one (70 - 64 = 6
    rows): 82; through an engine, three turns of that prompt submitted together compute it three times."""
    srv, replica = served
    for seed, fork, rows in ((303, True, 1), (306, False, 6)):
        ids = Conversation(seed=seed, first=70).ids[0].tolist()
        if not fork:
            monkeypatch.setattr(replica.store, "fork", refuse_fork)
        before = replica.engine.stats().prompt_tokens
        out = complete(srv, {"prompt": ids, "n": 3, "max_tokens": 4, "seed": 1, **HOT})
        assert replica.engine.stats().prompt_tokens - before == len(ids) + 2 * rows == (72 if fork else 82)
        assert out["usage"]["prompt_tokens"] == len(ids)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        alone = [complete(srv, {"prompt": ids, "max_tokens": 4, "seed": 1 + i, **HOT})["choices"][0]["token_ids"]
                 for i in range(3)]
        assert [c["token_ids"] for c in out["choices"]] == alone
        replica.store.check_integrity()

    engine = Engine(tiny_llama(), device_capacity=4096)
    start = engine.stats().prompt_tokens
    engine.generate(["a", "b", "c"], [ids] * 3, SamplingParams(max_new_tokens=4))
    assert engine.stats().prompt_tokens - start == 3 * len(ids)
    engine.store.check_integrity()


def refuse_fork(*args, **kwargs):
    from stateful_hf.cache import StoreError
    raise StoreError("fork refused (the control)")


def test_a_session_continues_the_choice_it_sends_back(served, oracle, monkeypatch):
    """With a session id the choices are held; the next turn, whose prompt carries choice i's answer, continues
    from that fork itself: the session takes its whole KV (40 + 59 = 99 tokens: the full chunks shared, the
    partial one copied), so the turn computes only its new rows (the answer's last token, never fed, and the 9
    new ones: 10), and the other forks are freed. Continuing choice 0 keeps the session's own KV (10 rows too).
    The control: with the store refusing to replace the session by the fork, the turn recomputes from where
    its prompt leaves choice 0's history (more rows, fewer cached), still exact."""
    srv, replica = served
    store_fork = replica.store.fork
    for pick, sid, continued in ((1, "forks-a", True), (2, "forks-b", True), (0, "forks-c", True),
                                 (1, "forks-d", False)):
        if not continued:
            monkeypatch.setattr(replica.store, "fork", lambda *a, replace=False, **kw: refuse_fork() if replace
                                else store_fork(*a, **kw))
        conv = Conversation(seed=304 + pick + 10 * continued, first=40)
        ids = conv.ids[0].tolist()
        first = complete(srv, {"prompt": ids, "n": 3, "max_tokens": 60, "seed": 5, **HOT}, sid)["choices"]
        assert len(forks_in(replica)) == 2                           # held until the next turn
        assert first[pick]["token_ids"] != first[1 - min(pick, 1)]["token_ids"]   # not vacuous: they differ
        nxt = ids + first[pick]["token_ids"] + conv._user(9)[0].tolist()
        before = replica.engine.stats().prompt_tokens
        out = complete(srv, {"prompt": nxt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}, sid)
        computed = replica.engine.stats().prompt_tokens - before
        assert out["choices"][0]["token_ids"] == expected(oracle, nxt, 6, eos_token_id=None)
        cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        if continued:
            assert (computed, cached) == (1 + 9, len(ids) + 60 - 1), (pick, computed, cached)
        else:
            assert computed > 1 + 9 and cached < len(ids) + 60 - 1, (computed, cached)
        assert forks_in(replica) == []                               # the others freed, the chosen one too
        assert replica.store.token_ids(sid)[:len(nxt)] == nxt
        replica.store.check_integrity()


def test_a_list_of_prompts_times_n_is_prompt_major(served, oracle):
    srv, replica = served
    a, b = Conversation(seed=310, first=36).ids[0].tolist(), Conversation(seed=311, first=20).ids[0].tolist()
    out = complete(srv, {"prompt": [a, b], "n": 2, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    want_a, want_b = expected(oracle, a, 5, eos_token_id=None), expected(oracle, b, 5, eos_token_id=None)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in out["choices"]] == [want_a, want_a, want_b, want_b]
    assert out["usage"]["prompt_tokens"] == len(a) + len(b) and out["usage"]["completion_tokens"] == 20
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [a, b], "n": 2,
                                                      "session_id": "s"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    for n in (0, 129):
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": a, "n": n}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    replica.store.check_integrity()


def sse(srv, endpoint: str, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.url + endpoint, json={"model": MODEL, "stream": True, **body}, timeout=60) as s:
        assert s.status_code == 200
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_streamed_chunks_carry_their_choice_index(served):
    srv, replica = served
    ids = Conversation(seed=312, first=30).ids[0].tolist()
    body = {"prompt": ids, "n": 3, "max_tokens": 6, "seed": 3, **HOT}
    whole = complete(srv, body)
    chunks = sse(srv, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    texts, reasons = ["", "", ""], [None] * 3
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["text"]
        reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    assert texts == [c["text"] for c in whole["choices"]] and reasons == ["length"] * 3
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    messages = [{"role": "user", "content": "Say something"}]
    whole = chat(srv, {"messages": messages, "n": 2, "max_tokens": 5, "seed": 4, **HOT})
    content = ["", ""]
    for c in sse(srv, "/v1/chat/completions", {"messages": messages, "n": 2, "max_tokens": 5, "seed": 4, **HOT}):
        (choice,) = c["choices"]
        content[choice["index"]] += choice["delta"].get("content") or ""
    assert content == [c["message"]["content"] for c in whole["choices"]]
    replica.store.check_integrity()


def test_streamed_choices_carry_their_own_logprobs(served):
    """Each choice's streamed logprobs concatenate to its non-streamed ones (chat and completions); the
    choices differ (seed + i), so entries put on the wrong choice would fail."""
    srv, replica = served
    messages = [{"role": "user", "content": "Name a colour"}]
    body = {"messages": messages, "n": 2, "max_tokens": 6, "seed": 9, "logprobs": True, "top_logprobs": 2, **HOT}
    whole = chat(srv, body)
    got: list[list] = [[], []]
    for c in sse(srv, "/v1/chat/completions", body):
        (choice,) = c["choices"]
        got[choice["index"]] += (choice.get("logprobs") or {}).get("content") or []
    want = [c["logprobs"]["content"] for c in whole["choices"]]
    assert want[0] != want[1] and got == want
    ids = Conversation(seed=314, first=30).ids[0].tolist()
    body = {"prompt": ids, "n": 2, "max_tokens": 6, "seed": 5, "logprobs": 2, **HOT}
    whole = complete(srv, body)
    tokens: list[list] = [[], []]
    values: list[list] = [[], []]
    for c in sse(srv, "/v1/completions", body):
        (choice,) = c["choices"]
        lp = choice.get("logprobs") or {}
        tokens[choice["index"]] += lp.get("tokens") or []
        values[choice["index"]] += lp.get("token_logprobs") or []
    assert tokens == [c["logprobs"]["tokens"] for c in whole["choices"]]
    assert values == [c["logprobs"]["token_logprobs"] for c in whole["choices"]]
    replica.store.check_integrity()


def test_a_client_that_leaves_mid_stream_frees_the_forks(served):
    srv, replica = served
    ids = Conversation(seed=313, first=40).ids[0].tolist()
    with httpx.stream("POST", srv.url + "/v1/completions", json={"model": MODEL, "prompt": ids, "n": 3,
                                                                 "max_tokens": 400, "stream": True, **HOT},
                      headers={"X-Session-Id": "forks-left"}, timeout=60) as s:
        for line in s.iter_lines():
            if '"index":2' in line:                 # the forks are running
                break
    deadline = time.monotonic() + 20
    while forks_in(replica) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert forks_in(replica) == []
    replica.store.check_integrity()
    out = complete(srv, {"prompt": ids, "max_tokens": 3, "temperature": 0}, "forks-left")   # the session goes on
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_the_held_choice_a_prompt_continues():
    from stateful_hf.serve.choices import HeldForks
    held = HeldForks(("s", "s#t.1", "s#t.2"), (1, 2, 3), ((7, 8, 9), (7, 5, 6), (4, 4)))
    assert held.best([1, 2, 3, 7, 5, 6, 0]) == 1                  # the answer sent back
    assert held.best([1, 2, 3, 4, 4, 0]) == 2
    assert held.best([1, 2, 3, 7, 0]) == 0                        # 0 and 1 tie: the lowest index
    assert held.best([1, 2, 9, 4, 4]) == 0                        # an edited prompt: no choice is continued
