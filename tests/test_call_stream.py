"""A tool call's arguments streamed token by token (`stateful_hf/serve/call_stream.py`): whatever the
chunks, the deltas reassemble to the same arguments, equal to transformers' parser's value (coerced to
the tool's schema types) when the JSON is whole, and ending with the model's raw text when it is cut or
broken. The reply parser's pieces follow. Needs no server (pydantic only: the serve package's protocol)."""

from __future__ import annotations

import json
import random

import pytest
from transformers.utils.chat_parsing import ResponseParser

pytest.importorskip("pydantic")

from stateful_hf.serve import tools as tool_mod  # noqa: E402
from stateful_hf.serve.call_stream import CallStream  # noqa: E402
from stateful_hf.serve.tool_parse import ReplyParser  # noqa: E402
from stateful_hf.testing import tiny_tokenizer  # noqa: E402

FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}, "s": {"type": "string"},
    "m": {"type": ["integer", "string"]}}}}}
TOOLS = {"f": FN}
WHOLE = [
    '\n{"name": "f", "arguments": {"s": "caf\\u00e9 \\"q\\" \\/ \\n é", "n": "12", "x": [1, 2.50, {"y": null, '
    '"z": true}], "m": "7", "tags": ["a", "b"], "e": 1E3, "w": -0.0, "u": "\\ud83d\\ude00x"}}\n',
    '{"name":"f","arguments":{}}',
    '{"name": "g", "arguments": {"n": "12", "deep": {"k": [[], {}, "v"]}}}',
]
CUT = {   # region text -> the call's arguments: read tokens canonical, then the raw rest
    '{"name": "f", "arguments": {"s": "hel': '{"s": "hel',
    '{"name": "f", "arguments": {"s": "h\\u00e9l\\x", "t": 1}}': '{"s": "h\\u00e9l\\x", "t": 1}}',
    '{"name": "f", "arguments": {"n": "1': '{"n": "1',
    '{"name": "f", "arguments": {"a": 12': '{"a": 12',
    '{"name": "f", "arguments": {"a": [1, 2,': '{"a": [1, 2, ',
}
OTHER = ['{"arguments": {"a": 1}, "name": "f"}', '{"name": "f", "arguments": "{\\"a\\": 1}"}',
         '{"name": "", "arguments": {}}', '[{"name": "f", "arguments": {}}]']


def _stream(body: str, rng: random.Random | None) -> tuple[str | None, str | None, int]:
    """(name, arguments, deltas) of `body` fed in random chunks (None: whole)."""
    cs, i, args, deltas = CallStream(TOOLS), 0, "", 0
    while i < len(body):
        k = rng.randint(1, 7) if rng else len(body)
        cs.feed(body[i:i + k])
        d = cs.take()
        args, deltas, i = args + d, deltas + bool(d), i + k
    rest = cs.finish()
    return cs.name, None if rest is None else args + rest, deltas


@pytest.mark.parametrize("body", WHOLE + list(CUT) + OTHER)
def test_arguments_reassemble_alike_in_any_chunks(body):
    name, whole, _ = _stream(body, None)
    for seed in range(60):
        assert _stream(body, random.Random(seed))[:2] == (name, whole), seed
    if body in OTHER:         # another shape: not streamed; the parser's value makes the call
        assert name is None and whole is None
    elif body in CUT:
        assert whole == CUT[body]
    else:                     # whole JSON: the parser's value, coerced by the tool's schema, as json.dumps
        parser = ResponseParser(json.loads(tool_mod.CHATML_RESPONSE.read_text()), prefix="", tools=[FN])
        parser.feed("<tool_call>" + body + "</tool_call>")
        fn = parser.finalize()[0]["tool_calls"][0]["function"]
        assert whole == json.dumps(fn["arguments"], ensure_ascii=False) and name == fn["name"]


def test_arguments_stream_a_token_at_a_time():
    body = '{"name": "f", "arguments": {"s": "a long value", "n": "3", "x": [1, 2]}}'
    cs, seen = CallStream(TOOLS), []
    for c in body:
        cs.feed(c)
        seen.append(cs.take())
    assert cs.name == "f" and cs.finish() == ""
    # the string streams by characters; the coerced integer comes whole, as 3
    assert [d for d in seen if d][:5] == ['{', '"s"', ': ', '"', 'a'] and "3" in seen
    assert "".join(seen) == '{"s": "a long value", "n": 3, "x": [1, 2]}'
    # negative control: an escape whose canonical text differs is held until its string ends
    cs = CallStream(TOOLS)
    cs.feed('{"name": "f", "arguments": {"s": "ab\\u00e9')
    assert cs.take() == '{"s": "ab'
    cs.feed('cd"}}')
    assert cs.take() == 'écd"}'


def test_reply_pieces_start_stream_and_finish_each_call():
    p = tool_mod.plan(tiny_tokenizer(), [FN], "auto", True)
    prompt = tool_mod.render(tiny_tokenizer(), [{"role": "user", "content": "hi"}], p)
    text = ('ok <tool_call>\n{"name": "f", "arguments": {"n": "4", "s": "x y"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "f", "arguments": {"s": "cut')
    r = ReplyParser(p, prompt)
    pieces = [x for c in text for x in r.feed(c)] + r.close()
    kinds = [k for k, _ in pieces if k != "text"]
    assert kinds[0] == "call" and kinds.count("call") == kinds.count("call_done") == 2
    assert kinds.count("args") > 8                     # a delta per token, not one per call
    calls = [c for k, c in pieces if k == "call_done"]
    assert [c.arguments for c in calls] == ['{"n": 4, "s": "x y"}', '{"s": "cut']
    assert ReplyParser(p, prompt).parse(text)[1][1].arguments == calls[1].arguments
    starts = [c for k, c in pieces if k == "call"]
    assert [c.id for c in starts] == [c.id for c in calls]
