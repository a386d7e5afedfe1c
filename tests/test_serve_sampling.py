"""The sampler's request fields through the server (an in-process app, the tiny float32 model, greedy):
each one's tokens equal transformers' `generate` with the matching processor on the same prompt ids
(tests/test_sampling.py: the processors), and a bad value is a 400 naming its field.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import test_sampling  # noqa: E402
from conftest import Conversation  # noqa: E402
from test_engine import expected  # noqa: E402

from stateful_hf import SamplingParams  # noqa: E402
from stateful_hf.serve import ServerThread, build_local  # noqa: E402
from stateful_hf.testing import tiny_llama, tiny_tokenizer  # noqa: E402

MODEL = "tiny-sampler"
N = 12


@pytest.fixture(scope="module")
def server():
    app, router = build_local(tiny_llama(), tiny_tokenizer(), MODEL)
    with ServerThread(app) as srv:
        yield srv
    for c in router.clients:
        c.replica.shutdown()


def complete(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL, "max_tokens": N, "temperature": 0,
                                                     "return_token_ids": True, **body}, timeout=60)


def test_each_sampler_field_through_the_server_equals_generate(server):
    oracle = tiny_llama()
    ids = Conversation(seed=70).ids[0].tolist()
    plain = expected(oracle, ids, N, eos_token_id=None)
    cases = [{"repetition_penalty": 1.5}, {"presence_penalty": 2.0, "frequency_penalty": 1.0},
             {"logit_bias": {str(plain[0]): -100, str(plain[5]): 4}},
             {"min_tokens": 6, "stop_token_ids": [plain[1]]}]
    for fields in cases:
        got = complete(server.url, {"prompt": ids, "ignore_eos": True, **fields})
        assert got.status_code == 200, got.text
        p = SamplingParams(max_new_tokens=N, ignore_eos=True, **{k: tuple(v) if isinstance(v, list) else v
                                                                  for k, v in fields.items()})
        stops = list(p.stop_token_ids) or None
        want = expected(oracle, ids, N, eos_token_id=stops,
                        logits_processor=test_sampling.oracle_processors(p, len(ids), []))
        assert got.json()["choices"][0]["token_ids"] == want, fields
        assert want != expected(oracle, ids, N, eos_token_id=stops), f"{fields}: the case does not show the field"


@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),          # past the vocabulary
    ({"logit_bias": [1, 2]}, "logit_bias"),
])
def test_bad_sampler_values_are_400s_naming_the_field(server, fields, param):
    for endpoint, body in (("/v1/completions", {"prompt": "Hello"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})):
        r = httpx.post(server.url + endpoint, json={"model": MODEL, "max_tokens": 4, **body, **fields}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].split(".")[0] == param, r.text


def test_completion_logprobs_in_the_legacy_shape_and_echo(server):
    """`logprobs: k` (OpenAI's legacy shape) holds the model's log_softmax of each generated token with k
    alternatives (and the chosen one); `echo` puts the prompt's text first (streamed too); with logprobs it
    is a 400 naming `echo` (no prompt log-probabilities). Streamed logprobs: tests/test_serve_stream_logprobs.py."""
    import torch

    oracle, tok = tiny_llama(), tiny_tokenizer()
    ids = Conversation(seed=72).ids[0].tolist()
    r = complete(server.url, {"prompt": ids, "ignore_eos": True, "logprobs": 3, "max_tokens": 5})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    gen = oracle.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True,
                          eos_token_id=None, pad_token_id=0)
    want = gen.sequences[0, len(ids):].tolist()
    assert choice["token_ids"] == want and lp["tokens"] == [tok.decode([t]) for t in want]
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:k]) for k in range(5)]
    for k, t in enumerate(want):
        dist = torch.log_softmax(gen.logits[k][0].float(), -1)
        assert lp["token_logprobs"][k] == pytest.approx(dist[t].item(), abs=1e-4)
        top = torch.topk(dist, 3)            # by text: two ids with one text (a partial UTF-8 piece) are one key
        wanted = {tok.decode([a]): v for v, a in zip(top.values.tolist(), top.indices.tolist(), strict=True)}
        got = lp["top_logprobs"][k]
        assert got.keys() == wanted.keys() and [got[x] for x in wanted] == pytest.approx(list(wanted.values()),
                                                                                         abs=1e-4)
    assert complete(server.url, {"prompt": ids, "max_tokens": 2}).json()["choices"][0]["logprobs"] is None

    text = "Tell me about the sea"
    plain = complete(server.url, {"prompt": text, "max_tokens": 4}).json()["choices"][0]["text"]
    echoed = complete(server.url, {"prompt": text, "max_tokens": 4, "echo": True}).json()["choices"][0]["text"]
    assert echoed == text + plain
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 4,
                                                                     "temperature": 0, "echo": True, "stream": True},
                      timeout=60) as s:
        chunks = [line[6:] for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    import json
    assert "".join(json.loads(c)["choices"][0]["text"] for c in chunks) == echoed
    for fields, param in (({"echo": True, "logprobs": 1}, "echo"), ({"logprobs": 21}, "logprobs")):
        r = complete(server.url, {"prompt": text, **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def _events(url: str, body: dict) -> list[dict]:
    import json
    with httpx.stream("POST", url + "/v1/completions", json={"model": MODEL, "temperature": 0, **body},
                      timeout=60) as s:
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_list_of_prompts_is_one_choice_each_in_order(server):
    """Each choice equals the prompt sent alone (`index` in prompt order, usage summed), answered and streamed
    (chunks of the choices interleaved, one finish each, then the summed usage); a list with a session, or of
    more than 128 prompts, or with a prompt too long, is a 400 naming `prompt`."""
    prompts = ["Tell me about the sea", "Chunks of thirty-two tokens move", "Hello! How are you today?"]
    alone = [complete(server.url, {"prompt": p, "max_tokens": 5}).json() for p in prompts]
    both = complete(server.url, {"prompt": prompts, "max_tokens": 5, "echo": True})
    assert both.status_code == 200, both.text
    body = both.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for i, (c, one) in enumerate(zip(body["choices"], alone, strict=True)):
        want = one["choices"][0]
        assert c["token_ids"] == want["token_ids"] and c["finish_reason"] == want["finish_reason"]
        assert c["text"] == prompts[i] + want["text"]
    for k in ("prompt_tokens", "completion_tokens"):
        assert body["usage"][k] == sum(one["usage"][k] for one in alone)
    ids = [Conversation(seed=73 + i).ids[0].tolist() for i in range(2)]          # token prompts alike
    assert [c["token_ids"] for c in complete(server.url, {"prompt": ids, "max_tokens": 4}).json()["choices"]] == \
        [complete(server.url, {"prompt": p, "max_tokens": 4}).json()["choices"][0]["token_ids"] for p in ids]
    events = _events(server.url, {"prompt": prompts, "max_tokens": 5, "stream": True,
                                  "stream_options": {"include_usage": True}})
    texts, reasons = ["", "", ""], [None, None, None]
    for ev in events[:-1]:
        (c,) = ev["choices"]
        texts[c["index"]] += c["text"]
        if c["finish_reason"] is not None:
            assert reasons[c["index"]] is None
            reasons[c["index"]] = c["finish_reason"]
    assert texts == [one["choices"][0]["text"] for one in alone]
    assert reasons == [one["choices"][0]["finish_reason"] for one in alone]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == body["usage"]
    for fields in ({"session_id": "many"}, {"prompt": ["a"] * 129}, {"prompt": [[5] * 3, [5] * 5000]}):
        r = complete(server.url, {"prompt": prompts, "max_tokens": 2, **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 2},
                   headers={"X-Session-Id": "many"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
