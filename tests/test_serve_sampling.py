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
