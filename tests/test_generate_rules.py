"""generate's own rules on the stateful paths: pad ids that generate would mask are refused (exactly
where transformers would infer the mask), EOS comes from the generation config only, and sampling
defaults follow one precedence (explicit, then the model's generation config, then the library)."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from stateful_hf import Engine, SamplingParams
from stateful_hf.integration.checks import check_pad_ids
from stateful_hf.testing import tiny_llama, tiny_opt


def transformers_infers_mask(model, x: torch.Tensor, kwargs: dict) -> bool:
    """The oracle: would transformers' generate build an attention mask with zeros for `x`?"""
    config, _ = model._prepare_generation_config(None, **kwargs)
    model._prepare_special_tokens(config, False, device=x.device)
    return not bool(model._prepare_attention_mask_for_generation(x, config, {}).all())


def refuses(model, x: torch.Tensor, kwargs: dict) -> bool:
    try:
        check_pad_ids(model, x, x[0].tolist(), kwargs)
    except ValueError as e:
        assert "attention_mask" in str(e) and "all-ones" in str(e)
        return True
    return False


def test_pad_refusal_matches_transformers_rule_exactly():
    """Every combination of pad id (unset / in the ids / not in them / equal to an EOS id), EOS (unset,
    one id, a list) and ids dtype: refused exactly where generate would infer a mask."""
    model = tiny_opt()
    ids = [5, 7, 1, 9, 4]                       # holds 1 (OPT's pad id) and 4
    pads = [None, 1, 4, 8, 2]
    eoss = [None, 2, [2, 4], [4]]
    seen = set()
    for pad, eos, dtype in itertools.product(pads, eoss, [torch.long, torch.int32, torch.int16]):
        kwargs = {"pad_token_id": pad, "eos_token_id": eos}
        x = torch.tensor([ids], dtype=dtype)
        want = transformers_infers_mask(model, x, kwargs)
        assert refuses(model, x, kwargs) == want, (pad, eos, dtype)
        seen.add(want)
    assert seen == {True, False}
    # the model's own generation config (pad 1, eos 2) when no kwargs are given
    assert refuses(model, torch.tensor([ids]), {}) and transformers_infers_mask(model, torch.tensor([ids]), {})


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_generate_with_pad_ids_refused_or_exact(family, make_store):
    """OPT's pad id is 1 (Llama's is unset: pass pad_token_id=0). No mask: refused before anything is
    stored. An explicit all-ones mask: exactly stateless generate with it. Pad equal to EOS: generate
    infers nothing, and neither refuses."""
    model, oracle = (tiny_opt(), tiny_opt()) if family == "opt" else (tiny_llama(), tiny_llama())
    pad = 1 if family == "opt" else 0
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": pad}
    x = torch.tensor([[5, 17, pad, 33, 8, 41, pad, 12]])
    store = make_store(model, 1024)
    with pytest.raises(ValueError, match="all-ones attention_mask"):
        model.generate(x, past_key_values=store.cache("a"), **kw)
    assert store.session("a").num_tokens == 0 and not store.session("a").busy
    ones = torch.ones_like(x)
    out = model.generate(x, attention_mask=ones, past_key_values=store.cache("a"), **kw)
    assert torch.equal(out, oracle.generate(x, attention_mask=ones, **kw))
    same = dict(kw, pad_token_id=2, eos_token_id=2)               # pad == EOS: no mask inferred anywhere
    y = torch.tensor([[5, 17, 2, 33, 8]])
    out = model.generate(y, past_key_values=store.cache("b"), **same)
    assert torch.equal(out, oracle.generate(y, **same))


def test_engine_stops_where_generate_stops():
    """generation_config.eos_token_id None, model.config.eos_token_id set to a token greedy decoding
    produces: generate does not stop there, and neither does the engine (it used to)."""
    model, oracle = tiny_llama(), tiny_llama()
    x = torch.tensor([[11, 42, 97, 150, 3, 77, 201, 19]])
    free = oracle.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 8:].tolist()
    stop = free[3]
    for m in (model, oracle):
        m.generation_config.eos_token_id = None
        m.config.eos_token_id = stop
    want = oracle.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 8:].tolist()
    assert want == free and len(want) == 12
    out = Engine(model, device_capacity=1024).generate(["a"], [x[0].tolist()], SamplingParams(max_new_tokens=12))[0]
    assert list(out.token_ids) == want and out.finish_reason == "length"
    model.generation_config.eos_token_id = stop                  # set where generate reads it: both stop
    want = oracle.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=stop)[0, 8:].tolist()
    out = Engine(model, device_capacity=1024).generate(["a"], [x[0].tolist()], SamplingParams(max_new_tokens=12))[0]
    assert list(out.token_ids) == want == free[:4] and out.finish_reason == "stop"


def test_sampling_defaults_precedence():
    model = tiny_llama()
    g = model.generation_config
    assert SamplingParams.from_generation_config(g) == SamplingParams()        # greedy, library defaults
    g.max_new_tokens = 7
    engine = Engine(model, device_capacity=512)
    assert engine.default_sampling == SamplingParams(max_new_tokens=7)
    assert engine.sampling_params(max_new_tokens=3).max_new_tokens == 3          # explicit wins
    x = [11, 42, 97, 150]
    out = engine.generate(["a"], [x])[0]                                        # None: the model's config
    ref = model.generate(torch.tensor([x]), attention_mask=torch.ones(1, 4, dtype=torch.long), pad_token_id=0)
    assert list(out.token_ids) == ref[0, 4:].tolist() and len(out.token_ids) == 7
    assert Engine(model, device_capacity=512, generation_config="library").default_sampling == SamplingParams()
    g.do_sample, g.temperature, g.top_k = True, 0.7, 5
    p = SamplingParams.from_generation_config(g)
    assert (p.temperature, p.top_k, p.top_p, p.max_new_tokens) == (0.7, 5, 1.0, 7)
    g.top_k = None                                                              # generate's global default
    assert SamplingParams.from_generation_config(g).top_k == 50
    assert SamplingParams.from_generation_config(g, temperature=0.0).greedy     # explicit greedy wins
    g.repetition_penalty, g.min_p, g.min_new_tokens = 1.3, 0.1, 9                # implemented: taken, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = SamplingParams.from_generation_config(g)
    assert (p.repetition_penalty, p.min_p, p.min_tokens) == (1.3, 0.1, 7)      # min_tokens within max_new_tokens
    assert SamplingParams.from_generation_config(g, max_new_tokens=20).min_tokens == 9
    g.no_repeat_ngram_size = 3
    with pytest.warns(UserWarning, match="no_repeat_ngram_size"):
        SamplingParams.from_generation_config(g)
    with pytest.raises(TypeError, match="no field"):
        SamplingParams.from_generation_config(g, max_tokens=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SamplingParams.from_generation_config(None, max_new_tokens=2)
    with pytest.raises(ValueError, match="generation_config"):
        Engine(model, device_capacity=512, generation_config="vllm")
