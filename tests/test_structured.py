"""Structured output in the engine (SamplingParams.constraint; stateful_hf/engine/grammar.py): constrained
turns give JSON that validates, free turns in the same steps keep their exact tokens, EOS only once the
JSON is complete, the session stays exact for a free turn after a constrained one, grammars are compiled
once, bad schemas and slow compiles fail the request with a reason, and the free path never imports the
grammar machinery. The tiny random model's free output is gibberish (negative controls below): a
constrained output that parses is the grammar's doing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from conftest import slow_schema  # noqa: E402

from stateful_hf import Engine, SamplingParams  # noqa: E402
from stateful_hf.engine.constraint import JsonConstraint, json_constraint  # noqa: E402
from stateful_hf.engine.grammar import COMPILERS, GrammarError, apply_bitmask  # noqa: E402
from stateful_hf.testing import tiny_llama, tiny_tokenizer  # noqa: E402

# bounded values only: the random model's strings would run to max_new_tokens
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "color"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "color": {"enum": ["red", "green", "blue"]}}}
ASK = [{"role": "user", "content": "Tell me about the weather."}]
OBJECT_ASK = [{"role": "user", "content": "Chunks move"}]     # the tiny model closes an object here soon
EOS = 2


def parses(text: str | None) -> bool:
    try:
        json.loads(text or "")
        return True
    except ValueError:
        return False


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def engine(tok):
    e = Engine(tiny_llama(), tok)
    yield e
    e.stop()


def test_a_schema_constrained_turn_gives_json_that_validates(engine):
    out = engine.submit("schema", ASK, SamplingParams(max_new_tokens=200, constraint=SCHEMA)).result()
    assert out.finish_reason == "stop" and out.token_ids[-1] == EOS, out
    assert EOS not in out.token_ids[:-1]
    jsonschema.validate(json.loads(out.text), SCHEMA)
    free = engine.submit("schema-free", ASK, SamplingParams(max_new_tokens=200)).result()
    assert not parses(free.text), free.text                 # negative control: the model alone does not


def test_json_object_gives_an_object(engine):
    out = engine.submit(None, OBJECT_ASK, SamplingParams(max_new_tokens=120, constraint="json_object")).result()
    assert out.finish_reason == "stop", out
    assert isinstance(json.loads(out.text), dict)
    free = engine.submit(None, OBJECT_ASK, SamplingParams(max_new_tokens=120)).result()
    assert not parses(free.text), free.text


def test_sampled_constrained_turns_validate(engine):
    for seed in range(3):
        p = SamplingParams(max_new_tokens=200, temperature=0.8, top_p=0.95, top_k=50, seed=seed, constraint=SCHEMA)
        out = engine.submit(None, ASK, p).result()
        assert out.finish_reason == "stop", (seed, out)
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_mixed_batch_free_requests_are_exact(tok):
    """Constrained and free requests share steps; each free request's tokens are stateless generate's
    (and so its tokens alone), each constrained one validates."""
    model, oracle = tiny_llama(), tiny_llama()
    engine = Engine(model, tok)
    prompts = [[{"role": "user", "content": u}] for u in
               ("Tell me about the weather.", "Hello! How are you today?", "What would you like to talk about?",
                "Please summarize the previous answer.")]
    constrained = [False, True, False, True]
    sampling = [SamplingParams(max_new_tokens=200, constraint=SCHEMA) if c else SamplingParams(max_new_tokens=24)
                for c in constrained]
    sids = [f"mixed-{i}" for i in range(4)]
    outs = engine.generate(sids, prompts, sampling)
    shared = [s for s in engine.steps if {e[0] for e in s.entries} >= set(sids)]
    assert any(s.num_decode == 4 for s in shared), "constrained and free requests never decoded in one step"
    for p, c, out in zip(prompts, constrained, outs):
        assert out.error is None, out.error
        if c:
            jsonschema.validate(json.loads(out.text), SCHEMA)
            continue
        ids = torch.tensor([tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)["input_ids"]])
        want = oracle.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        assert list(out.token_ids) == want[0, ids.shape[1]:].tolist()
    engine.stop()


def test_a_free_turn_after_a_constrained_one_is_exact(tok):
    """The session's KV is that of the tokens the constrained turn emitted: a free turn on it equals
    stateless generate on the whole conversation, and reuses the history."""
    model, oracle = tiny_llama(), tiny_llama()
    engine = Engine(model, tok)
    first = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True)["input_ids"]
    out = engine.submit("s", first, SamplingParams(max_new_tokens=200, constraint=SCHEMA)).result()
    jsonschema.validate(json.loads(out.text), SCHEMA)
    more = tok("<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    convo = first + list(out.token_ids) + more
    second = engine.submit("s", convo, SamplingParams(max_new_tokens=16)).result()
    ids = torch.tensor([convo])
    want = oracle.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    assert list(second.token_ids) == want[0, len(convo):].tolist()
    assert second.metrics.reused_tokens >= len(first) + len(out.token_ids) - 1
    engine.store.check_integrity()
    engine.stop()


def test_eos_only_once_the_json_is_complete(tok):
    """A model that wants to stop at once (EOS logit raised at every row): free, it says EOS first;
    constrained, it writes the whole JSON and stops right after (ignore_eos or not)."""
    model = tiny_llama()
    model.lm_head.register_forward_hook(lambda m, i, out: out.index_add(
        -1, torch.tensor([EOS]), torch.full((*out.shape[:-1], 1), 30.0)))
    engine = Engine(model, tok)
    free = engine.submit(None, ASK, SamplingParams(max_new_tokens=20)).result()
    assert free.token_ids == (EOS,)
    for ignore_eos in (False, True):
        out = engine.submit(None, ASK, SamplingParams(max_new_tokens=200, constraint=SCHEMA,
                                                      ignore_eos=ignore_eos)).result()
        assert out.finish_reason == "stop" and out.token_ids[-1] == EOS and EOS not in out.token_ids[:-1], out
        jsonschema.validate(json.loads(out.text), SCHEMA)
    engine.stop()


def test_a_grammar_is_compiled_once_per_schema(engine, tok):
    schema = {"type": "object", "properties": {"once": {"type": "boolean"}}, "required": ["once"],
              "additionalProperties": False}
    before = COMPILERS.cached(tok)
    outs = engine.generate(["once-a", "once-b"], [ASK, ASK], SamplingParams(max_new_tokens=100, constraint=schema))
    assert COMPILERS.cached(tok) == before + 1
    for out in outs:
        assert json.loads(out.text) == {"once": json.loads(out.text)["once"]}


def test_bad_schemas_fail_the_request_with_a_reason(engine):
    for schema, says in (({"type": "strin"}, "Unsupported type"), ({"$ref": "#/$defs/nope"}, "nope"),
                         ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}, "Regex")):
        h = engine.submit(None, ASK, SamplingParams(max_new_tokens=8, constraint=schema))
        out = h.output()
        assert out is not None and out.finish_reason == "error" and isinstance(out.error, GrammarError), out
        assert says in str(out.error) and "cannot be compiled" in str(out.error)
        assert out.error.param == "response_format" and out.error.code == "invalid_schema"
    with pytest.raises(ValueError, match="constraint must be"):
        SamplingParams(constraint=42)
    with pytest.raises(ValueError, match="not valid JSON"):
        SamplingParams(constraint="{nope")
    # the engine goes on
    assert engine.submit(None, ASK, SamplingParams(max_new_tokens=4)).result().finish_reason == "length"


def test_without_a_tokenizer_a_constrained_request_fails_and_says_why():
    engine = Engine(tiny_llama())
    out = engine.submit(None, list(range(5, 20)), SamplingParams(max_new_tokens=4, constraint="json_object")).output()
    assert isinstance(out.error, GrammarError) and "needs a tokenizer" in str(out.error)
    assert out.error.code == "structured_output_unavailable"
    engine.stop()


def test_a_compile_over_the_time_limit_fails_the_request(tok):
    engine = Engine(tiny_llama(), tok, grammar_compile_timeout=0.001)
    out = engine.submit(None, ASK, SamplingParams(max_new_tokens=8, constraint=slow_schema())).output()
    assert isinstance(out.error, GrammarError) and "took longer than the limit of 0.001 s" in str(out.error)
    assert out.error.code == "schema_too_complex"
    with pytest.raises(ValueError, match="grammar_compile_timeout"):
        Engine(tiny_llama(), tok, grammar_compile_timeout=-1)
    engine.stop()


def test_literal_text_around_the_json(engine):
    """prefix / suffix (a tool call's tags): the output is the prefix, JSON that validates, the suffix."""
    c = json_constraint(SCHEMA, prefix='<tool_call>\n{"name": "weather", "arguments": ', suffix="}\n</tool_call>")
    out = engine.submit(None, ASK, SamplingParams(max_new_tokens=200, constraint=c)).result()
    assert out.finish_reason == "stop", out
    assert out.text.startswith(c.prefix) and out.text.endswith(c.suffix), out.text
    call = json.loads(out.text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == "weather"
    jsonschema.validate(call["arguments"], SCHEMA)
    suffix_only = json_constraint("json_object", suffix="\nDONE")
    assert suffix_only.key != json_constraint("json_object").key


def test_constraint_values():
    assert json_constraint("json_object") == JsonConstraint(None, strict=False)
    a = json_constraint({"type": "object", "properties": {"b": {}, "a": {}}})
    assert a.schema == '{"type":"object","properties":{"b":{},"a":{}}}'       # property order is kept
    assert json_constraint(a.schema) == a and SamplingParams(constraint=a).constraint is a
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: int
    c = json_constraint(Point)
    assert c.name == "Point" and json.loads(c.schema)["required"] == ["x", "y"]


def test_apply_bitmask_matches_a_reference():
    g = torch.Generator().manual_seed(0)
    for rows_total, rows, width, words in ((5, [0, 1, 2, 3, 4], 64, 2), (6, [1, 4], 90, 2), (3, [2], 60, 2)):
        logits = torch.randn(rows_total, width, generator=g)
        mask = torch.randint(-2**31, 2**31 - 1, (rows_total, words), dtype=torch.int32, generator=g)
        want = logits.clone()
        for r in rows:
            for t in range(width):
                if t >= 32 * words or not (int(mask[r, t // 32]) >> (t % 32)) & 1:
                    want[r, t] = float("-inf")
        got = logits.clone()
        apply_bitmask(got, mask, rows)
        assert torch.equal(got, want)


def test_the_free_path_never_imports_the_grammar_machinery():
    code = ("import sys\nfrom stateful_hf import Engine, SamplingParams\nfrom stateful_hf.testing import tiny_llama\n"
            "Engine(tiny_llama()).submit('s', list(range(5, 40)), SamplingParams(max_new_tokens=4)).result()\n"
            "print(sorted(m for m in sys.modules if m in ('xgrammar', 'stateful_hf.engine.grammar', "
            "'stateful_hf.engine.constraint', 'stateful_hf.serve.structured')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.real_model
def test_smollm2_gives_json_that_validates():
    from stateful_hf.models import DEFAULT_MODEL, ModelUnavailableError, load
    try:
        model, tokenizer = load(DEFAULT_MODEL, dtype=torch.float32, fetch_missing=False)
    except ModelUnavailableError as e:
        pytest.skip(str(e))
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "born", "fields"],
              "properties": {"name": {"type": "string", "maxLength": 40}, "born": {"type": "integer"},
                             "fields": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                        "maxItems": 3}}}
    engine = Engine(model, tokenizer)
    ask = [{"role": "user", "content": "Describe Marie Curie as JSON: her name, the year she was born and her "
            "fields of work."}]
    out = engine.submit(None, ask, SamplingParams(max_new_tokens=120, constraint=schema)).result()
    engine.stop()
    assert out.finish_reason == "stop", out.text
    doc = json.loads(out.text)
    jsonschema.validate(doc, schema)
    assert "Curie" in doc["name"]
