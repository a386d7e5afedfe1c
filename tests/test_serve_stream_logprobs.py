"""Log-probabilities with `"stream": true` (an in-process app, the tiny float32 model, greedy): chat chunks,
legacy completions chunks (one prompt and a list) and the Responses API's `output_text.delta` events
each carry the entries of the tokens whose text they complete, and the entries concatenated equal the
non-streaming answer's exactly (tokens, floats, alternatives, offsets), every token once: through the
hold of a stop string (the token that completes it, cut from the text, comes with the finish chunk),
partial UTF-8 pieces, an EOS and a forced tool call's held text. The control: the first entry equals
log_softmax of the stateless forward's last logits.
"""

from __future__ import annotations

import itertools
import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from conftest import Conversation  # noqa: E402

from stateful_hf.serve import ServerThread, build_local  # noqa: E402
from stateful_hf.serve.replica import covered  # noqa: E402
from stateful_hf.testing import tiny_llama, tiny_tokenizer  # noqa: E402

MODEL = "tiny-stream-lp"
ASK = [{"role": "user", "content": "Tell me about the sea and the mountains."}]
PING = {"type": "function", "function": {"name": "ping", "description": "Ping the server",
                                         "parameters": {"type": "object", "properties": {}}}}
_salts = itertools.count()


@pytest.fixture(scope="module")
def url():
    app, router = build_local(tiny_llama(), tiny_tokenizer(), MODEL)
    with ServerThread(app) as srv:
        yield srv.url
    for c in router.clients:
        c.replica.shutdown()


def _body(fields: dict) -> dict:
    # a salt of its own: no prefix shared with an earlier request, so both runs compute the same rows
    return {"model": MODEL, "temperature": 0, "cache_salt": f"s{next(_salts)}", **fields}


def _post(url: str, path: str, fields: dict) -> dict:
    r = httpx.post(url + path, json=_body(fields), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, path: str, fields: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=_body({**fields, "stream": True}), timeout=60) as s:
        assert s.status_code == 200, s.read()
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]


def _chat_pair(url: str, fields: dict) -> tuple[dict, list[dict]]:
    """(the non-streaming choice, the streamed choices) of one chat request."""
    fields = {"messages": ASK, "logprobs": True, "top_logprobs": 3, **fields}
    one = _post(url, "/v1/chat/completions", {**fields, "return_token_ids": True})["choices"][0]
    return one, [c["choices"][0] for c in _stream(url, "/v1/chat/completions", fields) if c["choices"]]


def _entries(choices: list[dict]) -> list[dict]:
    return [e for c in choices if c["logprobs"] is not None for e in c["logprobs"]["content"]]


def _prefix_consistent(choices: list[dict], ids: list[int]) -> None:
    """After each chunk but the last with entries (it also takes the tokens cut or without text), the text of
    the tokens sent so far (`ids`: the reply's) is a prefix of the content sent so far: an entry never comes
    before its text. (Decoded together: two pieces of one UTF-8 character are one char, not two U+FFFD.)"""
    tok, content, sent = tiny_tokenizer(), "", 0
    last = max(i for i, c in enumerate(choices) if c["logprobs"] and c["logprobs"]["content"])
    for c in choices[:last]:
        content += c["delta"].get("content") or ""
        sent += len((c["logprobs"] or {"content": []})["content"])
        assert content.startswith(tok.decode(ids[:sent], skip_special_tokens=True)), (content, sent)


def test_streamed_chat_logprobs_are_the_non_streaming_ones(url):
    one, streamed = _chat_pair(url, {"max_tokens": 16})
    entries = _entries(streamed)
    assert entries == one["logprobs"]["content"] and len(entries) == 16        # floats equal, every token once
    assert "".join(c["delta"].get("content") or "" for c in streamed) == one["message"]["content"]
    assert streamed[0]["logprobs"] is None                                      # the role chunk
    texts = [c for c in streamed[1:] if c["delta"].get("content")]
    assert sum(bool(c["logprobs"]["content"]) for c in texts) > len(texts) // 2   # spread over the chunks
    for c in texts:           # without a stop string nothing is held but partial UTF-8: each chunk its tokens' text
        assert "".join(e["token"] for e in c["logprobs"]["content"]) == c["delta"]["content"], c
    _prefix_consistent(streamed, one["token_ids"])
    plain = [c["choices"][0] for c in _stream(url, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4})]
    assert all(c["logprobs"] is None for c in plain)                             # not asked: none


def test_a_stop_string_holds_entries_back_with_their_text(url):
    one, _ = _chat_pair(url, {"max_tokens": 16})
    tokens = [e["token"] for e in one["logprobs"]["content"]]
    k = next(i for i, t in enumerate(tokens) if i > 3 and len(t) >= 3 and "\ufffd" not in t)
    stop = tokens[k][1:3]                   # cuts inside token k: its first char is sent, the token is not
    cut, streamed = _chat_pair(url, {"max_tokens": 16, "stop": [stop]})
    assert cut["finish_reason"] == "stop" and len(cut["logprobs"]["content"]) == k + 1
    assert _entries(streamed) == cut["logprobs"]["content"]                      # the stop's token included, once
    assert "".join(c["delta"].get("content") or "" for c in streamed) == cut["message"]["content"]
    assert streamed[-1]["finish_reason"] == "stop"
    last = max(i for i, c in enumerate(streamed) if c["logprobs"] and c["logprobs"]["content"])
    assert streamed[last]["logprobs"]["content"][-1]["token"] == tokens[k]     # at the end: with the last text
    assert not any(c["delta"].get("content") for c in streamed[last + 1:])
    _prefix_consistent(streamed, cut["token_ids"])


def test_an_eos_comes_with_the_finish_chunk(url):
    eos = tiny_tokenizer().eos_token_id
    one, streamed = _chat_pair(url, {"max_tokens": 12, "min_tokens": 3, "logit_bias": {str(eos): 100}})
    assert one["finish_reason"] == "stop" and len(one["logprobs"]["content"]) == 4
    assert _entries(streamed) == one["logprobs"]["content"]
    assert streamed[-1]["finish_reason"] == "stop"
    assert [e["token"] for e in streamed[-1]["logprobs"]["content"]] == [tiny_tokenizer().eos_token]


def test_a_forced_tool_call_streams_its_logprobs_once(url):
    one, streamed = _chat_pair(url, {"max_tokens": 24, "tools": [PING], "tool_choice": "required"})
    assert one["message"]["tool_calls"] and any(c["delta"].get("tool_calls") for c in streamed)
    assert _entries(streamed) == one["logprobs"]["content"] and len(one["logprobs"]["content"]) == 24
    for c in streamed:        # the call the prefill wrote carries no entry; the reply's text its own
        if c["delta"].get("tool_calls"):
            assert c["logprobs"]["content"] == []
    _prefix_consistent(streamed, one["token_ids"])


def test_streamed_completion_logprobs_and_the_first_against_the_model(url):
    import torch

    ids = Conversation(seed=72).ids[0].tolist()
    fields = {"prompt": ids, "max_tokens": 10, "logprobs": 3, "ignore_eos": True}
    one = _post(url, "/v1/completions", fields)["choices"][0]["logprobs"]
    chunks = [c["choices"][0] for c in _stream(url, "/v1/completions", fields) if c["choices"]]
    got = {k: [x for c in chunks if c["logprobs"] for x in c["logprobs"][k]] for k in one}
    assert got == one and len(got["tokens"]) == 10                               # text_offset runs on
    for c in chunks[:-1]:
        assert "".join(c["logprobs"]["tokens"]) == c["text"]
    # the control: what the stream carries is the model's distribution, not numbers that merely agree
    with torch.no_grad():
        logits = tiny_llama()(torch.tensor([ids])).logits[0, -1].float()
    dist = torch.log_softmax(logits, -1)
    first = int(dist.argmax())
    assert got["tokens"][0] == tiny_tokenizer().decode([first])
    assert abs(got["token_logprobs"][0] - dist[first].item()) < 1e-5
    top = torch.topk(dist, 3)
    assert sorted(got["top_logprobs"][0].values(), reverse=True) == pytest.approx(top.values.tolist(), abs=1e-5)
    chat = _entries(_chat_pair(url, {"max_tokens": 2})[1])
    tok = tiny_tokenizer()
    chat_ids = list(tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True)["input_ids"])
    with torch.no_grad():
        dist = torch.log_softmax(tiny_llama()(torch.tensor([chat_ids])).logits[0, -1].float(), -1)
    assert abs(chat[0]["logprob"] - dist.max().item()) < 1e-5

    # a list: per choice (its turns share steps, whose float32 sums may round otherwise than alone: approx)
    prompts = [ids, Conversation(seed=73).ids[0].tolist()]
    alone = [_post(url, "/v1/completions", {**fields, "prompt": p})["choices"][0]["logprobs"] for p in prompts]
    events = [c["choices"][0] for c in _stream(url, "/v1/completions", {**fields, "prompt": prompts}) if c["choices"]]
    for i, want in enumerate(alone):
        mine = {k: [x for c in events if c["index"] == i for x in c["logprobs"][k]] for k in want}
        assert mine["tokens"] == want["tokens"] and mine["text_offset"] == want["text_offset"], i
        assert mine["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-5), i
        assert [m.keys() for m in mine["top_logprobs"]] == [w.keys() for w in want["top_logprobs"]], i


def test_streamed_responses_logprobs_are_the_non_streaming_ones(url):
    fields = {"input": ASK[0]["content"], "max_output_tokens": 12, "store": False,
              "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    one = _post(url, "/v1/responses", fields)
    want = one["output"][0]["content"][0]["logprobs"]
    with httpx.stream("POST", url + "/v1/responses", json=_body({**fields, "stream": True}), timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [x for e in deltas for x in e["logprobs"]] == want and len(want) == 12
    assert "".join(e["delta"] for e in deltas) == one["output"][0]["content"][0]["text"]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == want
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == want


def test_covered_takes_tokens_in_order_whose_text_was_sent():
    ends = (2, 3, 3, 7, 9)                  # token 2 has no text of its own; token 3 ends past 6 chars
    assert covered(ends, 0, 3, 5) == 3 and covered(ends, 3, 6, 5) == 3 and covered(ends, 3, 9, 5) == 5
    assert covered(ends, 0, 9, 4) == 4      # never past the entries published
    assert covered((), 0, 9, 3) == 0        # no text ends (no tokenizer): the entries wait for the end


def test_the_responses_builder_keeps_each_deltas_entries_in_the_part():
    from stateful_hf.serve.response_items import OutputBuilder

    b, one, two = OutputBuilder(), {"token": "ab", "logprob": -1.0}, {"token": "<eos>", "logprob": -2.0}
    deltas = [e for e in b.add([("text", "ab")], [one]) + b.add([("text", "")], [two])
              if e["type"] == "response.output_text.delta"]
    assert [e["logprobs"] for e in deltas] == [[one], [two]]         # the EOS's in a last, empty delta
    done = next(e for e in b.close() if e["type"] == "response.output_text.done")
    assert done["logprobs"] == [one, two] == b.items[0]["content"][0]["logprobs"]
    assert OutputBuilder().add([("text", "x")])[-1]["logprobs"] == []     # none asked: empty lists, as before
