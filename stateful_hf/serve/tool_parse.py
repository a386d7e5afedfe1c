"""A reply with tool calls, read by transformers' response parser (`ResponseParser` of
`transformers.utils.chat_parsing`, driven by a response template: `tools.ToolFormat`).

`ReplyParser` feeds the generated text as it streams and turns the parser's events into pieces: text
of the reply (`("text", str)`) and finished calls (`("call", ToolCall)`); a call is emitted whole when
its region closes. A call region whose JSON does not parse, or that names no function, is given back
as text (the model wrote it; nothing is dropped). The non-streaming reply is the same pieces from one
feed of the whole text, so streamed deltas reassemble to it. `ChatReply` shapes the pieces as chat
completion deltas and messages (OpenAI's `tool_calls`, finish_reason "tool_calls").
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from transformers.utils.chat_parsing import ResponseParser

from .protocol import APIError
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
    prompt, prefill included (the parser starts in the state the prefill left it in)."""

    def __init__(self, plan: ToolPlan, prompt: str):
        self.parser = ResponseParser(plan.format.response_template, prefix=prompt, tools=plan.tools)
        self.calls = 0
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
            elif ev["type"] == "region_close" and ev["field"] == "tool_calls":
                call = _call(ev["value"])
                if call is None:
                    fn = ev["value"].get("function") if isinstance(ev["value"], dict) else ev["value"]
                    raw = fn if isinstance(fn, str) else json.dumps(fn, ensure_ascii=False)
                    out.append(("text", f"{CALL_OPEN}{raw}\n{CALL_CLOSE}"))
                else:
                    self.calls += 1
                    out.append(("call", call))
        return out

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole reply at once: (text, calls)."""
        pieces = self.feed(text) + self.close()
        return "".join(p for k, p in pieces if k == "text"), [p for k, p in pieces if k == "call"]


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
    """A chat completion's reply with tools: deltas while streaming, the message at the end. `plan`:
    the turn's `ToolPlan` (its `json_schema`: what constrained decoding would hold a forced call to)."""

    def __init__(self, plan: ToolPlan, prompt: str):
        self.plan = plan
        self.parser = ReplyParser(plan, prompt)

    def deltas(self, text: str) -> list[dict]:
        return self._deltas(self.parser.feed(text))

    def close(self, reason: str | None) -> tuple[list[dict], str | None]:
        out = self._deltas(self.parser.close())
        return out, finish_reason(reason, self.parser.calls)

    def _deltas(self, pieces) -> list[dict]:
        out, index = [], self.parser.calls - sum(k == "call" for k, _ in pieces)
        for kind, p in pieces:
            if kind == "text":
                out.append({"content": p})
                continue
            out.append({"tool_calls": [{"index": index, "id": p.id, "type": "function",
                                        "function": {"name": p.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": index, "function": {"arguments": p.arguments}}]})
            index += 1
        return out

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        content, calls = self.parser.parse(text)
        msg = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return msg, finish_reason(reason, len(calls))


def chat_prompt(tok, body) -> tuple[str, ChatReply | None, tuple[str, ...]]:
    """(prompt text, reply reader or None, extra stop strings) of a chat request. Without tools or tool
    turns: the tokenizer's template on the messages, as before tools existed (no reader)."""
    tools = check_tools(body.tools)
    choice = check_tool_choice(body.tool_choice, tools)
    chat = [{**(m.model_extra or {}), "role": "system" if m.role == "developer" else m.role,
             "content": None if m.content is None else m.text()} for m in body.messages]
    messages = check_history(chat)
    text, p = prompt_for(tok, messages, tools, choice, body.parallel_tool_calls is not False)
    return text, None if p is None or not p.parses else ChatReply(p, text), () if p is None else p.stop


def prompt_for(tok, messages: list[dict], tools: list[dict], choice: str, parallel: bool
               ) -> tuple[str, ToolPlan | None]:
    """(prompt text, tool plan) of checked template messages. Without tools or tool turns: the
    tokenizer's template, as before tools existed (no plan)."""
    if not needs_tools(messages, tools):
        try:
            plain = [{"role": m["role"], "content": m["content"] or ""} for m in messages]
            return tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=False), None
        except Exception as e:  # noqa: BLE001 - Jinja's errors have no common base beyond Exception
            raise APIError(400, f"the chat template failed on these messages: {e}", param="messages",
                           code="invalid_messages") from None
    p = plan(tok, tools, choice, parallel)
    return render(tok, messages, p), p
