"""A reply with tool calls, read by transformers' response parser (`ResponseParser` of
`transformers.utils.chat_parsing`, driven by a response template: `tools.ToolFormat`).

`ReplyParser` feeds the generated text as it streams and turns the parser's events into pieces: text
of the reply (`("text", str)`), of its reasoning (`("reasoning", str)`: a `<think>` block, reasoning.py)
and calls: `("call", ToolCall)` when one starts (its id and name; arguments ""), `("args", str)` its
arguments' next text, `("call_done", ToolCall)` the whole call at its region's close. A `<tool_call>`
region's arguments stream token by token (`call_stream.CallStream`); a region of another shape is one
call at its close, from the parser's value. A region whose JSON does not parse, or that names no
function, is given back as text (the model wrote it; nothing is dropped). The non-streaming reply is the
same pieces from one feed of the whole text, so streamed deltas reassemble to it. `ChatReply` shapes the
pieces as chat completion deltas and messages (OpenAI's `tool_calls`, finish_reason "tool_calls";
vLLM's `reasoning_content`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from transformers.utils.chat_parsing import ResponseParser

from .call_stream import CallStream
from .protocol import APIError
from .reasoning import REASONING, reasons, reply_template, template_kwargs, with_reasoning_tokens
from .result_tags import FIELD
from .tools import (
    CALL_CLOSE,
    CALL_OPEN,
    ToolPlan,
    check_history,
    check_tool_choice,
    check_tools,
    needs_tools,
    plan,
    render,
)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str                    # a JSON text, as OpenAI's API carries it


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ReplyParser:
    """Pieces of a reply as its text arrives (see the module's docstring). `prompt`: the rendered
    prompt, prefill included (the parser starts in the state the prefill left it in). `template`: the
    response template (None: the plan's tool format's); `plan` None: a reply without tools."""

    def __init__(self, plan: ToolPlan | None, prompt: str, template: dict | None = None):
        template = template if template is not None else plan.format.response_template
        tools = plan.tools if plan is not None else None
        self.parser = ResponseParser(template, prefix=prompt, tools=tools)
        self.tools = {t["function"]["name"]: t for t in tools or ()}
        self.reasoning = ""              # the reasoning read so far
        self.calls = 0                   # calls started
        self.region: CallStream | None = None     # the open <tool_call> region's reader
        self.call: ToolCall | None = None        # the call it started
        self.done = False
        self.early = self._pieces(self.parser.initial_events)    # a call the prefill wrote whole

    def feed(self, text: str) -> list[tuple[str, object]]:
        early, self.early = self.early, []
        return early + (self._pieces(self.parser.feed(text)) if text else [])

    def close(self) -> list[tuple[str, object]]:
        if self.done:
            return []
        self.done = True
        early, self.early = self.early, []
        _, events = self.parser.finalize()
        return early + self._pieces(events)

    def _pieces(self, events: list[dict]) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        for ev in events:
            if ev["type"] == "region_chunk" and ev["field"] == "content" and ev["text"]:
                out.append(("text", ev["text"]))
            elif ev["type"] == "region_chunk" and ev["field"] == REASONING and ev["text"]:
                self.reasoning += ev["text"]
                out.append(("reasoning", ev["text"]))
            elif ev["type"] == "region_chunk" and ev["field"] == "tool_calls":
                out += self._stream(ev["text"])
            elif ev["type"] == "region_close" and ev["field"] == "tool_calls":
                out += self._close_call(ev["value"])
        return out

    def _stream(self, text: str) -> list[tuple[str, object]]:
        """Pieces of a call region's next text: the call's start once its head is read, its arguments."""
        self.region = self.region or CallStream(self.tools)
        self.region.feed(text)
        out: list[tuple[str, object]] = []
        if self.call is None and self.region.name is not None:
            self.calls += 1
            self.call = ToolCall(new_call_id(), self.region.name, "")
            out.append(("call", self.call))
        delta = self.region.take()
        return out + [("args", delta)] if delta else out

    def _close_call(self, value) -> list[tuple[str, object]]:
        region, call, self.region, self.call = self.region, self.call, None, None
        rest = region.finish() if region is not None else None
        if call is not None:
            out = [("args", rest)] if rest else []
            return out + [("call_done", ToolCall(call.id, call.name, region.sent))]
        call = _call(value)
        if call is None:
            fn = value.get("function") if isinstance(value, dict) else value
            raw = fn if isinstance(fn, str) else json.dumps(fn, ensure_ascii=False)
            return [("text", f"{CALL_OPEN}{raw}\n{CALL_CLOSE}")]
        self.calls += 1
        return [("call", ToolCall(call.id, call.name, "")), ("args", call.arguments), ("call_done", call)]

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole reply at once: (text, calls)."""
        pieces = self.feed(text) + self.close()
        return "".join(p for k, p in pieces if k == "text"), [p for k, p in pieces if k == "call_done"]


def _call(value) -> ToolCall | None:
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        return None
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), fn["name"], json.dumps(args, ensure_ascii=False))


def finish_reason(reason: str | None, calls: int) -> str | None:
    """A turn that ended with calls (not cut by max_tokens) finishes with "tool_calls"."""
    return "tool_calls" if calls and reason == "stop" else reason


class ChatReply:
    """A chat completion's reply with tools or reasoning: deltas while streaming, the message at the
    end. `plan`: the turn's `ToolPlan` (None: no tools; its `json_schema`: what constrained decoding
    would hold a forced call to); `template`: the response template (`reasoning.reply_template`);
    `reasoning`: the message carries `reasoning_content` (None when the reply had no think block)."""

    def __init__(self, plan: ToolPlan | None, prompt: str, template: dict | None = None, reasoning: bool = False):
        self.plan, self.reasons = plan, reasoning
        self.parser = ReplyParser(plan, prompt, template)

    def deltas(self, text: str) -> list[dict]:
        return self._deltas(self.parser.feed(text))

    def counted(self, tok, out: dict) -> dict:
        """`out` (the turn's last event, the reply read) with its `reasoning_tokens` when it can reason."""
        return with_reasoning_tokens(tok, out, bool(self.parser.reasoning) if self.reasons else None)

    def close(self, reason: str | None) -> tuple[list[dict], str | None]:
        out = self._deltas(self.parser.close())
        return out, finish_reason(reason, self.parser.calls)

    def _deltas(self, pieces) -> list[dict]:
        out, index = [], self.parser.calls - 1 - sum(k == "call" for k, _ in pieces)
        for kind, p in pieces:
            if kind in ("text", "reasoning"):
                out.append({"content" if kind == "text" else REASONING: p})
            elif kind == "call":
                index += 1
                out.append({"tool_calls": [{"index": index, "id": p.id, "type": "function",
                                            "function": {"name": p.name, "arguments": ""}}]})
            elif kind == "args":
                out.append({"tool_calls": [{"index": index, "function": {"arguments": p}}]})
        return out

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        content, calls = self.parser.parse(text)
        msg = {"role": "assistant", "content": content if content or not calls else None}
        if self.reasons:
            msg[REASONING] = self.parser.reasoning or None
        if calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return msg, finish_reason(reason, len(calls))


def chat_prompt(tok, body) -> tuple[str, ChatReply | None, tuple[str, ...]]:
    """(prompt text, reply reader or None, extra stop strings) of a chat request. Without tools or tool
    turns: the tokenizer's template on the messages, as before tools existed (a reader only when the
    template reasons)."""
    tools = check_tools(body.tools)
    choice = check_tool_choice(body.tool_choice, tools)
    kwargs = template_kwargs((body.model_extra or {}).get("chat_template_kwargs"))
    chat = [{**(m.model_extra or {}), "role": "system" if m.role == "developer" else m.role,
             "content": None if m.content is None else m.text()} for m in body.messages]
    messages = check_history(chat)
    text, p = prompt_for(tok, messages, tools, choice, body.parallel_tool_calls is not False, kwargs)
    return text, reply_reader(tok, p, text), () if p is None else p.stop


def reply_reader(tok, p: ToolPlan | None, prompt: str) -> ChatReply | None:
    """The reader of a chat turn's reply: calls (when the plan parses them) and reasoning (when the
    template reasons); None: the reply is plain text."""
    template = reply_template_of(tok, p)
    return None if template is None else ChatReply(p, prompt, template, reasons(tok))


def reply_template_of(tok, p: ToolPlan | None) -> dict | None:
    """The response template a turn's reply is read with (None: plain text): calls where the plan parses
    them, reasoning where the template reasons, and, in a turn with tools or tool turns, the tool-result
    tags stripped (`result_tags.py`) even when no calls are read (tool_choice "none")."""
    tool_template = None if p is None else p.format.response_template
    template = reply_template(tok, tool_template, p is not None and p.parses)
    if template is None and tool_template is not None and FIELD in tool_template["fields"]:
        template = {**tool_template, "fields": {k: v for k, v in tool_template["fields"].items() if k != "tool_calls"}}
    return template


def prompt_for(tok, messages: list[dict], tools: list[dict], choice: str, parallel: bool,
               kwargs: dict | None = None) -> tuple[str, ToolPlan | None]:
    """(prompt text, tool plan) of checked template messages; `kwargs`: template variables
    (`chat_template_kwargs`). Without tools or tool turns: the tokenizer's template, as before tools
    existed (no plan)."""
    if not needs_tools(messages, tools):
        try:
            plain = [{"role": m["role"], "content": m["content"] or "",
                      **({REASONING: m[REASONING]} if isinstance(m.get(REASONING), str) else {})} for m in messages]
            return tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=False, **(kwargs or {})), None
        except Exception as e:  # noqa: BLE001 - Jinja's errors have no common base beyond Exception
            raise APIError(400, f"the chat template failed on these messages: {e}", param="messages",
                           code="invalid_messages") from None
    p = plan(tok, tools, choice, parallel)
    return render(tok, messages, p, kwargs), p
