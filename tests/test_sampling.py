"""The engine's sampler (stateful_hf/engine/sampling.py) against transformers' logits processors, the oracle:
processing a batch of rows equals each row through transformers' processors alone; greedy float32 turns with
each field equal `generate` with the matching processor (on a case where the field changes the answer: the
negative control); seeded sampled turns equal seeded `generate`, alone and in a batch.
"""

from __future__ import annotations

from collections import Counter

import pytest
import test_engine
import torch
from conftest import FAMILIES, Conversation
from test_engine import expected
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from stateful_hf import SamplingParams
from stateful_hf.engine.sampling import process, sample, warp

make_engine = test_engine.make_engine     # the fixture: engines are integrity-checked at teardown
N = 16


class OpenAIPenalties(LogitsProcessor):
    """presence / frequency penalties as OpenAI documents them, over the generated tokens only (transformers
    has no such processor): logit[t] -= frequency * count(t) + presence * (count(t) > 0). A plain loop."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for b in range(input_ids.shape[0]):
            for t, c in Counter(input_ids[b, self.prompt_len:].tolist()).items():
                scores[b, t] = scores[b, t] - self.frequency * c - self.presence
        return scores


def oracle_processors(p: SamplingParams, prompt_len: int, eos: list[int]) -> LogitsProcessorList:
    """transformers' processors for `p`, in `generate`'s order (custom ones after its own, then the warpers)."""
    out = LogitsProcessorList()
    if p.logit_bias:
        out.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias]))
    if p.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    stops = list(p.stop_token_ids) + ([] if p.ignore_eos else eos)
    if p.min_tokens and stops:
        out.append(MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, stops))
    if p.presence_penalty or p.frequency_penalty:
        out.append(OpenAIPenalties(prompt_len, p.presence_penalty, p.frequency_penalty))
    if not p.greedy:
        out.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k:
            out.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            out.append(TopPLogitsWarper(p.top_p))
        if p.min_p:
            out.append(MinPLogitsWarper(p.min_p))
    return out


def test_new_fields_validate_and_name_themselves():
    bad = [dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0), dict(repetition_penalty=float("inf")),
           dict(presence_penalty=2.5), dict(frequency_penalty=-3.0), dict(frequency_penalty=float("nan")),
           dict(min_p=1.5), dict(min_p=-0.1), dict(min_tokens=-1), dict(min_tokens=2.0),
           dict(min_tokens=65, max_new_tokens=64), dict(logit_bias={5: 101}), dict(logit_bias={-1: 1.0}),
           dict(logit_bias={"x": 1.0}), dict(logit_bias={1.5: 1.0}), dict(logit_bias=[(1, "a")])]
    for kwargs in bad:
        with pytest.raises(ValueError) as e:
            SamplingParams(**kwargs)
        name = next(k for k in kwargs if k != "max_new_tokens")
        assert str(e.value).startswith(name), (kwargs, str(e.value))
    p = SamplingParams(logit_bias={"7": 1, 3: -2.5})
    assert p.logit_bias == ((3, -2.5), (7, 1.0)) and p.processed and not SamplingParams().processed
    assert SamplingParams(min_p=0.5).processed is False       # a warper: sampled rows only


def test_a_batch_of_rows_is_processed_as_each_row_alone_by_transformers():
    """Mixed rows (greedy and sampled, every field) in one batch: process + warp equal transformers' processors
    on each row alone; rows without a field are untouched by it."""
    V, eos = 384, [2]
    g = torch.Generator().manual_seed(3)
    rows = [SamplingParams(repetition_penalty=1.7, logit_bias={5: 4.0, 9: -100}),
            SamplingParams(temperature=0.7, top_k=12, top_p=0.8, min_p=0.05, presence_penalty=1.5,
                           frequency_penalty=0.5, seed=1),
            SamplingParams(temperature=1.3, min_p=0.2, min_tokens=10, stop_token_ids=(11,), seed=2),
            SamplingParams(),
            SamplingParams(temperature=1.0, repetition_penalty=0.8, frequency_penalty=-1.0, min_tokens=3,
                           ignore_eos=True, stop_token_ids=(2, 4), seed=3),
            SamplingParams(temperature=0.9, top_p=0.6, seed=4),
            SamplingParams(min_tokens=5),                     # 4 tokens so far: EOS still masked
            SamplingParams(min_tokens=5, logit_bias={1: 0.5})]  # 5 so far: EOS allowed
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (40, 7, 20, 3, 30, 5, 5, 5)]
    outputs = [torch.randint(3, 20, (n,), generator=g).tolist() for n in (6, 12, 4, 0, 1, 2, 4, 5)]
    logits = torch.randn(len(rows), V, generator=g) * 4
    x = process(logits, rows, prompts, outputs, frozenset(eos))
    hot = [i for i, p in enumerate(rows) if not p.greedy]
    warped = dict(zip(hot, warp(x[hot], [rows[i] for i in hot]), strict=True))
    for i, p in enumerate(rows):
        ids = torch.tensor([prompts[i] + outputs[i]])
        want = oracle_processors(p, len(prompts[i]), eos)(ids, logits[i:i + 1].clone())[0]
        got = warped.get(i, x[i])
        assert torch.equal(torch.isinf(got), torch.isinf(want)), i
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert not torch.equal(got, logits[i]) or p == SamplingParams(), i      # each row's fields did something
    assert x[6, 2] == -torch.inf and x[7, 2] == logits[7, 2]


def test_min_tokens_never_leaves_a_row_without_a_token_and_a_tiny_temperature_is_greedy():
    """A grammar that allows only EOS beside min_tokens: EOS is still chosen (no nan, no failed step); a
    temperature whose logits / temperature overflow samples the argmax."""
    logits = torch.full((2, 16), float("-inf"))
    logits[0, 2] = 1.0
    logits[1] = torch.arange(16.0)
    rows = [SamplingParams(temperature=1.0, min_tokens=5, seed=0), SamplingParams(temperature=1e-38, seed=0)]
    gens = [torch.Generator().manual_seed(0) for _ in rows]
    assert sample(logits, rows, gens, [[1], [1]], [[], []], frozenset({2})) == [2, 15]


def _run(engine, ids, rows):
    return [list(o.token_ids) for o in engine.generate([f"s{i}" for i in range(len(rows))], [ids] * len(rows), rows)]


def test_each_field_in_one_greedy_batch_equals_generate_with_its_processor(make_engine):
    """One batch, one row per field (and all together): each row's float32 greedy tokens equal `generate`
    with the matching processor; each differs from plain greedy (the case is built so the field matters)."""
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    ids = Conversation(seed=70).ids[0].tolist()
    plain = expected(oracle, ids, N, eos_token_id=None)
    eos = plain[3]                            # a token greedy decoding reaches: min_tokens must hold it back
    model.generation_config.eos_token_id = oracle.generation_config.eos_token_id = eos
    base = dict(max_new_tokens=N, ignore_eos=True)
    rows = {
        "repetition_penalty": SamplingParams(**base, repetition_penalty=1.5),
        "presence_penalty": SamplingParams(**base, presence_penalty=2.0),
        "frequency_penalty": SamplingParams(**base, frequency_penalty=2.0),
        "min_tokens (EOS)": SamplingParams(max_new_tokens=N, min_tokens=8),
        "min_tokens (stop ids)": SamplingParams(**base, min_tokens=6, stop_token_ids=(plain[2],)),
        "logit_bias": SamplingParams(**base, logit_bias={plain[1]: -100, plain[9]: 3.0}),
        "all": SamplingParams(max_new_tokens=N, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.7,
                              min_tokens=5, logit_bias={plain[1]: -5.0}),
    }
    engine = make_engine(model, device_capacity=1024, chunk_size=16)
    got = dict(zip(rows, _run(engine, ids, list(rows.values())), strict=True))
    for name, p in rows.items():
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else [eos])
        want = expected(oracle, ids, N, eos_token_id=stops or None,
                        logits_processor=oracle_processors(p, len(ids), [eos]))
        assert got[name] == want, name
        unfielded = expected(oracle, ids, N, eos_token_id=stops or None)
        assert want != unfielded, f"{name}: the case does not show the field"


def test_seeded_sampling_with_min_p_equals_seeded_generate_alone_and_in_a_batch(make_engine):
    """Seeded sampled rows (plain, min_p, top-k + top-p + penalties) equal transformers' seeded `generate`
    (the same draws: one multinomial per token from a generator seeded alike), in a batch and alone."""
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    ids = Conversation(seed=71).ids[0].tolist()
    hot = dict(max_new_tokens=N, ignore_eos=True, temperature=1.8, seed=11)
    rows = [SamplingParams(**hot), SamplingParams(**hot, min_p=0.3),
            SamplingParams(**hot, top_k=20, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.4)]
    engine = make_engine(model, device_capacity=1024, chunk_size=16)
    batched = _run(engine, ids, rows + [SamplingParams(max_new_tokens=N, temperature=1.0, seed=5)])[:3]
    for p, got in zip(rows, batched, strict=True):
        torch.manual_seed(p.seed)
        x = torch.tensor([ids])
        want = oracle.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N, do_sample=True, top_k=0,
                               top_p=1.0, temperature=1.0, eos_token_id=None, pad_token_id=0,
                               logits_processor=oracle_processors(p, len(ids), []))[0, len(ids):].tolist()
        assert got == want, p
        assert _run(engine, ids, [p]) == [got]                     # alone
    assert batched[1] != batched[0], "min_p changes nothing on this case"
