"""The server's sampling defaults follow one precedence (docs/errors.md): the request's fields, then
the model's generation config, then the library's defaults."""

import pytest
from transformers import GenerationConfig

pytest.importorskip("fastapi")                     # the server (stateful_hf.serve) imports the web stack
from stateful_hf.serve.protocol import ChatCompletionRequest  # noqa: E402


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def test_unset_fields_come_from_the_generation_config():
    sampled = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, top_k=20)
    p = _chat().sampling(8, sampled)
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens) == (0.7, 0.9, 20, 8)
    p = _chat(temperature=0.0, top_k=5).sampling(8, sampled)           # the request's own fields win
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 0.9, 5)


def test_greedy_unless_the_generation_config_samples():
    assert _chat().sampling(4, GenerationConfig()).greedy
    assert _chat().sampling(4, None).greedy                           # no config: the library's default
    p = _chat(temperature=1.2, stop="x", stop_token_ids=[3]).sampling(4, GenerationConfig())
    assert (p.temperature, p.stop, p.stop_token_ids) == (1.2, ("x",), (3,))
