"""Reasoning (`<think>` blocks) through a server subprocess of the tiny Qwen3 (`--model tiny-qwen3`:
Qwen3's chat template, `stateful_hf.testing.tiny_qwen3_thinker`), with the `openai` client and httpx.

What each test proves:
- without a server: the reply reader splits a think block from the answer (whole or streamed in any
  chunks), with tools and with Qwen3's empty block (`enable_thinking: false`); Qwen3's template strips
  earlier turns' think blocks; Responses input `reasoning` items become `reasoning_content`.
- chat: `message.reasoning_content` is the model's think block (the fixture really generates it: the
  returned token ids start with `<think>`), and streamed `delta.reasoning_content` / `delta.content`
  reassemble to the non-streaming message.
- the reuse target, over 10 turns of one session: the session stores the think block the model
  generated; Qwen3's template strips it when the history is re-rendered, so the prompt diverges from the
  stored tokens exactly where the block started. Each turn from the second on reuses the whole previous
  prompt (`cached_tokens == len(previous prompt)`) and so recomputes only the previous answer's visible
  tokens plus the new input (`len(prompt) - len(previous prompt)`); every answer (reasoning and text)
  equals the same request without reuse (a fresh `cache_salt`, nothing shared).
- the same with thinking off (`chat_template_kwargs`): the stored prompt's empty think block is cut.
- Responses: a `reasoning` output item (OpenAI's shape, parsed by the openai client) before the
  message, streamed as `response.reasoning_text.delta` events; a continuation with
  `previous_response_id` reuses the chain and answers as the chain sent whole.
"""

from __future__ import annotations

import json
import uuid

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from agent_server import serve  # noqa: E402

from stateful_hf.serve.response_items import input_messages, reply_message  # noqa: E402
from stateful_hf.serve.tool_parse import prompt_for, reply_reader  # noqa: E402
from stateful_hf.testing import qwen3_tokenizer  # noqa: E402

MODEL = "tiny-qwen3"
THOUGHT = "Hmm, let me think."                      # the fixture's scripted reasoning
QUESTIONS = ["Tell me about the sea.", "And the mountains?", "What about the stars at night?",
             "How are you today?", "Tell me about the weather.", "What would you like to talk about?",
             "Please summarize the previous answer.", "The quick brown fox jumps over the lazy dog.",
             "Servers re-read the whole conversation.", "A conversation keeps its state across turns."]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": CITY}}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("reasoning"), "--model", MODEL, "--served-model-name", MODEL) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def tok():
    return qwen3_tokenizer()


def _chat(url: str, messages: list[dict], sid: str | None = None, **extra) -> dict:
    r = httpx.post(url + "/v1/chat/completions", headers={"X-Session-Id": sid} if sid else {}, timeout=120,
                   json={"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _prompt_ids(tok, messages: list[dict], **kwargs) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs),
                      add_special_tokens=False)


# ---- without a server ------------------------------------------------------------------------------

def test_reader_splits_the_think_block_whole_or_streamed(tok):
    ask = [{"role": "user", "content": "Hi"}]
    text, p = prompt_for(tok, ask, [], "auto", True)
    reply = "<think>\nFirst this.\nThen that.\n\n</think>\n\nThe answer."
    msg, reason = reply_reader(tok, p, text).message(reply, "stop")
    assert (msg["reasoning_content"], msg["content"], reason) == ("First this.\nThen that.", "The answer.", "stop")
    for step in (1, 2, 3, 7):
        r = reply_reader(tok, p, text)
        deltas = [d for i in range(0, len(reply), step) for d in r.deltas(reply[i:i + step])] + r.close("stop")[0]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"], step
        assert "".join(d.get("content", "") for d in deltas) == msg["content"], step
    # no think block: all answer; Qwen3's thinking off: the prompt's empty block reads as no reasoning
    assert reply_reader(tok, p, text).message("Just this.", "stop")[0]["reasoning_content"] is None
    off, p_off = prompt_for(tok, ask, [], "auto", True, {"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert reply_reader(tok, p_off, off).message("Yes.", "stop")[0] == {
        "role": "assistant", "content": "Yes.", "reasoning_content": None}
    # with tools: reasoning, then a call
    text, p = prompt_for(tok, ask, [WEATHER], "auto", True)
    msg, reason = reply_reader(tok, p, text).message(
        '<think>\nI should call.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
        '\n</tool_call>', "stop")
    assert (msg["reasoning_content"], msg["content"], reason) == ("I should call.", None, "tool_calls")
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}


def test_reasoning_tokens_counts_the_block_through_its_close(tok):
    from stateful_hf.serve.reasoning import reasoning_tokens
    ids = tok.encode("<think>Hmm, let me think.</think>\n\nThe sea is wide.", add_special_tokens=False)
    close = tok.convert_tokens_to_ids("</think>")
    assert reasoning_tokens(tok, ids, True) == ids.index(close) + 1
    cut = ids[:ids.index(close)]                          # max_tokens ended inside the block: all of it
    assert reasoning_tokens(tok, cut, True) == len(cut)
    plain = tok.encode("The sea is wide.", add_special_tokens=False)
    assert reasoning_tokens(tok, plain, False) == 0 and reasoning_tokens(tok, [], True) == 0
    head = tok.encode("<think>x</thin", add_special_tokens=False)      # "</think>" spelled across tokens
    tail = tok.encode("k> done", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(tail[:2]) == ["k", ">"]          # the close completes at ">"
    assert reasoning_tokens(tok, head + tail, True) == len(head) + 2


def test_qwen3_template_strips_earlier_think_blocks(tok):
    """The divergence the store handles: an earlier turn renders without its reasoning, however the
    client sends it back (as `reasoning_content` or inline in `content`)."""
    plain = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
             {"role": "user", "content": "Q2"}]
    sent = [dict(plain[0]), {"role": "assistant", "content": "A1", "reasoning_content": "R1"}, dict(plain[2])]
    inline = [dict(plain[0]), {"role": "assistant", "content": "<think>\nR1\n</think>\n\nA1"}, dict(plain[2])]
    want = tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    assert "<think>" not in want
    for msgs in (sent, inline):
        assert prompt_for(tok, msgs, [], "auto", True)[0] == want


def test_reasoning_items_carry_over_as_reasoning_content():
    items = [{"type": "message", "role": "user", "content": "Q"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "R"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A"}]}]
    assert input_messages(items, [])[1] == {"role": "assistant", "content": "A", "reasoning_content": "R"}
    out = [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "R"}]},
           {"type": "message", "content": [{"type": "output_text", "text": "A"}]}]
    assert reply_message(out) == {"role": "assistant", "content": "A", "reasoning_content": "R"}


# ---- through the server ----------------------------------------------------------------------------

def test_chat_returns_reasoning_content_and_streams_it(url, client, tok):
    ask = [{"role": "user", "content": QUESTIONS[0]}]
    body = _chat(url, ask, return_token_ids=True)
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] == THOUGHT and msg["content"] and "<think>" not in msg["content"]
    generated = body["choices"][0]["token_ids"]
    assert tok.convert_ids_to_tokens(generated[:4]) == ["<think>", "Hmm,", " let me think.", "</think>"]
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}     # the block, delimiters too
    stream = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    reasoning, content, counted = "", "", []
    for chunk in stream:
        if chunk.usage is not None:
            counted.append(chunk.usage.completion_tokens_details.reasoning_tokens)
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning, content, counted) == (THOUGHT, msg["content"], [4])


def _reuse_over_turns(url: str, tok, turns: int, sid: str, system: str | None = None, start: int = 0,
                      **kwargs) -> list[dict]:
    """`turns` turns of session `sid` (each answer sent back with its reasoning, as a vLLM client does);
    per turn: prompt tokens, cached tokens, the bound (the previous answer's visible tokens + the new
    input), and the answer equals a fresh-salt request's. `system`: a system turn first; `start`: the
    first question's index."""
    messages, rows, previous = [{"role": "system", "content": system}] if system else [], [], None
    extra = {"chat_template_kwargs": kwargs} if kwargs else {}
    for t in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[(start + t) % len(QUESTIONS)]})
        prompt = _prompt_ids(tok, messages, **kwargs)
        body = _chat(url, messages, sid, **extra)
        fresh = _chat(url, messages, None, cache_salt=uuid.uuid4().hex, **extra)     # no reuse: the oracle
        msg, use = body["choices"][0]["message"], body["usage"]
        assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert msg == fresh["choices"][0]["message"], t           # every reused turn is exact
        assert use["prompt_tokens"] == len(prompt)
        cached = use["prompt_tokens_details"]["cached_tokens"]
        row = {"turn": t + 1, "prompt": len(prompt), "cached": cached, "recomputed": len(prompt) - cached}
        if previous is not None:
            # the previous answer's visible tokens + the new input: what follows the previous prompt,
            # cut where that prompt stops being a prefix (thinking off: its prefilled empty block)
            keep = _common(previous, prompt)
            row["bound"] = len(prompt) - keep
            row["visible"] = len(tok.encode(messages[-2]["content"], add_special_tokens=False))
        rows.append(row)
        previous = prompt
        messages.append({"role": "assistant", "content": msg["content"], "reasoning_content": msg["reasoning_content"]})
    return rows


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_ten_turns_recompute_only_the_last_answer_and_the_new_input(url, tok, capsys):
    """A conversation whose chunks no other session shares (its own system turn; see the next test)."""
    rows = _reuse_over_turns(url, tok, 10, "think-10", system="You talk about nature.")
    with capsys.disabled():
        print("\nturn prompt cached recomputed bound(visible+new input) visible")
        for r in rows:
            print(r["turn"], r["prompt"], r["cached"], r["recomputed"], r.get("bound"), r.get("visible"))
    assert rows[0]["cached"] == 0
    for r in rows[1:]:
        assert r["prompt"] - r["bound"] == rows[r["turn"] - 2]["prompt"]   # the previous prompt is a prefix
        assert r["recomputed"] <= r["bound"], r
        # and no more is reused: the stored think block is where the re-rendered prompt diverges
        assert r["cached"] == rows[r["turn"] - 2]["prompt"], r


def test_a_cut_inside_a_shared_chunk_keeps_its_kept_part(url, tok):
    """A request without a session asked the same first question before (its prefix is retained for
    sharing, `prefix-sharing.md`); turn 1 of the session fills chunk 0 with the same tokens (prompt + the
    same deterministic answer's start), so the session holds the shared chunk; turn 2's divergence (the
    think block, inside chunk 0) copies the chunk's kept part on write instead of recomputing it."""
    _chat(url, [{"role": "user", "content": QUESTIONS[3]}])    # a throwaway session: retained, shared
    rows = _reuse_over_turns(url, tok, 2, "think-shared", start=3)
    assert rows[0]["prompt"] < 32 <= rows[0]["prompt"] + 16     # turn 1 fills chunk 0, the cut falls in it
    assert rows[1]["recomputed"] <= rows[1]["bound"], rows


def test_thinking_off_cuts_only_the_prefilled_empty_block(url, tok):
    rows = _reuse_over_turns(url, tok, 4, "think-off", system="Be brief.", enable_thinking=False)
    for r in rows[1:]:
        assert r["recomputed"] <= r["bound"], r
        assert r["cached"] == r["prompt"] - r["bound"], r   # all but the previous turn's empty block


def test_responses_reasoning_item_streamed_and_continued_exactly(url, client):
    """Its own instructions: no other test's session shares its chunks."""
    kw = {"model": MODEL, "instructions": "Answer in one line.", "temperature": 0, "max_output_tokens": 16}
    first = client.responses.create(input=QUESTIONS[0], **kw)
    kinds = [type(it).__name__ for it in first.output]
    assert kinds == ["ResponseReasoningItem", "ResponseOutputMessage"], kinds
    assert first.output[0].content[0].text == THOUGHT and first.output[0].summary == []
    assert first.usage.output_tokens_details.reasoning_tokens == 4
    events = list(client.responses.create(input=QUESTIONS[0], stream=True, store=False, **kw))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == THOUGHT
    done = [e for e in events if e.type in ("response.completed", "response.incomplete")][0].response
    assert [it.type for it in done.output] == ["reasoning", "message"] and done.output_text == first.output_text

    second = client.responses.create(input=QUESTIONS[1], previous_response_id=first.id, **kw)
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens   # the whole first prompt
    whole = [{"role": "user", "content": QUESTIONS[0]}, *[it.model_dump(exclude_none=True) for it in first.output],
             {"role": "user", "content": QUESTIONS[1]}]
    again = client.responses.create(input=whole, store=False, extra_body={"cache_salt": uuid.uuid4().hex}, **kw)
    assert again.usage.input_tokens == second.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens == 0
    assert [(it.type, it.content[0].text) for it in again.output] == [(it.type, it.content[0].text)
                                                                      for it in second.output]
