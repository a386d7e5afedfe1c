"""The Responses API's items and objects (`responses.py` serves them): input items read into
chat-template messages, a reply's pieces (`tool_parse.ReplyParser`) built into output items, the
streamed events those items make, and the response object with its usage.

Input: a string (one user message) or a list of items — messages (`role` user, system, developer or
assistant; content a string or text parts), `function_call`, `function_call_output` (a tool message; it
must answer a call made earlier in the chain or the input), `reasoning` (its text is the next
assistant turn's `reasoning_content`; a reasoning template renders it only where it keeps reasoning).
Consecutive assistant messages and function calls are one assistant turn (its reasoning, text, then its
calls), as `reply_message` stores a response's output: a chain sent back as items renders as the
stored one. Output: a `reasoning` item (`content`: one `reasoning_text` part; `summary` empty), then
the message and function calls.
Anything else is a 400 naming the item.
"""

from __future__ import annotations

import json
import uuid

from .protocol import APIError
from .tool_parse import ToolCall

TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def input_messages(value, earlier: list[dict], param: str = "input") -> list[dict]:
    """Template messages of the request's `input`, after the chain's `earlier` messages (the calls
    made there may be answered here)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise _bad(f"{param} must be a string or a list of items", param)
    calls = {c["id"] for m in earlier for c in m.get("tool_calls") or []}
    out: list[dict] = []
    thought: str | None = None                   # a reasoning item's text, for the next assistant turn
    for i, item in enumerate(value):
        at = f"{param}.{i}"
        if not isinstance(item, dict):
            raise _bad(f"{at} must be an object", at)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise _bad(f"{at}.role must be user, system, developer or assistant; got {item.get('role')!r}",
                           f"{at}.role")
            text = _text(item.get("content"), f"{at}.content")
            if role == "assistant" and out and out[-1]["role"] == "assistant":     # one turn of the model
                out[-1]["content"] = (out[-1]["content"] or "") + text
            else:
                out.append({"role": role, "content": text})
            if role == "assistant" and thought is not None:
                out[-1]["reasoning_content"], thought = thought, None
        elif kind == "function_call":
            name, args, cid = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not isinstance(name, str) or not name:
                raise _bad(f"{at}.name must be a function's name", f"{at}.name")
            if not isinstance(cid, str) or not cid:
                raise _bad(f"{at}.call_id must be a non-empty string", f"{at}.call_id")
            if not isinstance(args, str):
                raise _bad(f"{at}.arguments must be a JSON string", f"{at}.arguments")
            call = {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if thought is not None:
                out[-1]["reasoning_content"], thought = thought, None
            calls.add(cid)
        elif kind == "function_call_output":
            cid = item.get("call_id")
            if not isinstance(cid, str) or not cid:
                raise _bad(f"{at}.call_id must be a non-empty string", f"{at}.call_id")
            if cid not in calls:
                raise _bad(f"{at}.call_id: no function call with the id {cid!r} was made earlier in the "
                           "conversation", f"{at}.call_id")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": cid,
                        "content": output if isinstance(output, str) else _text(output, f"{at}.output")})
        elif kind == "reasoning":
            thought = _reasoning(item, at)
        else:
            raise APIError(400, f"{at}.type: input items of type {kind!r} are not supported (messages, "
                           "function_call, function_call_output)", param=f"{at}.type", code="unsupported_parameter")
    return out


def _reasoning(item: dict, at: str) -> str:
    """The text of a reasoning input item: its `content` parts' (`reasoning_text`), else its summary's."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise _bad(f"{at}.content must be a list of reasoning_text parts", f"{at}.content")
    return "".join(p["text"] for p in parts)


def _text(content, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _bad(f"{param} must be a string or a list of text parts", param)
    parts = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in TEXT_PARTS:
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise APIError(400, f"{param}.{j}: only text parts are supported, got {kind!r}", param=f"{param}.{j}.type",
                           code="unsupported_content")
        key = "refusal" if p["type"] == "refusal" else "text"
        if not isinstance(p.get(key), str):
            raise _bad(f"{param}.{j}.{key} must be a string", f"{param}.{j}.{key}")
        parts.append(p[key])
    return "".join(parts)


def reply_message(items: list[dict]) -> dict:
    """The assistant message of a response's output items (what the next turn renders)."""
    text = "".join(c["text"] for it in items if it["type"] == "message" for c in it["content"])
    thought = "".join(c["text"] for it in items if it["type"] == "reasoning" for c in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    msg = {"role": "assistant", "content": text if text or not calls else None}
    if thought:
        msg["reasoning_content"] = thought
    if calls:
        msg["tool_calls"] = calls
    return msg


class OutputBuilder:
    """Output items from a reply's pieces, and the stream's events that build them (each event a
    dict without its sequence_number). The non-streaming response uses the same builder."""

    def __init__(self):
        self.items: list[dict] = []
        self.message: dict | None = None           # the message or reasoning item being written
        self.call: dict | None = None              # the function_call item being written

    def add(self, pieces, logprobs: list | None = None) -> list[dict]:
        """The events of `pieces`; `logprobs`: entries (chat's shape) of the tokens whose text the first
        text piece completes: its delta event carries them and the message's part keeps them."""
        events: list[dict] = []
        for kind, p in pieces:
            if kind in ("text", "reasoning"):
                events += self._text(p, kind, logprobs if kind == "text" else None)
                logprobs = None if kind == "text" else logprobs
            elif kind == "call":
                events += self._close_message() + self._call(p)
            elif kind == "args":
                self.call["arguments"] += p
                events.append({**self._call_at(), "type": "response.function_call_arguments.delta", "delta": p})
            else:
                events += self._call_done(p)
        return events

    def close(self) -> list[dict]:
        return self._close_message()

    def _text(self, delta: str, kind: str = "text", logprobs: list | None = None) -> list[dict]:
        events = []
        if self.message is not None and (self.message["type"] == "reasoning") != (kind == "reasoning"):
            events += self._close_message()
        if self.message is None:
            if kind == "reasoning":
                self.message = {"id": item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                                "content": []}
                part = {"type": "reasoning_text", "text": ""}
            else:
                self.message = {"id": item_id("msg"), "type": "message", "status": "in_progress",
                                "role": "assistant", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.items.append(self.message)
            events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                           "item": {**self.message, "content": []}})
            self.message["content"].append(part)
            events.append({**self._at(), "type": "response.content_part.added", "content_index": 0,
                           "part": dict(part)})
        self.message["content"][0]["text"] += delta
        if logprobs:
            self.message["content"][0]["logprobs"] += logprobs
        events.append({**self._at(), "type": f"response.{self._kind()}.delta", "content_index": 0, "delta": delta,
                       **({} if kind == "reasoning" else {"logprobs": list(logprobs or ())})})
        return events

    def _kind(self) -> str:
        return "reasoning_text" if self.message["type"] == "reasoning" else "output_text"

    def _close_message(self) -> list[dict]:
        if self.message is None:
            return []
        part = self.message["content"][0]
        extra = {} if self.message["type"] == "reasoning" else {"logprobs": list(part["logprobs"])}
        events = [{**self._at(), "type": f"response.{self._kind()}.done", "content_index": 0, "text": part["text"],
                   **extra},
                  {**self._at(), "type": "response.content_part.done", "content_index": 0, "part": dict(part)}]
        self.message["status"] = "completed"
        events.append({"type": "response.output_item.done", "output_index": self.items.index(self.message),
                       "item": json.loads(json.dumps(self.message))})
        self.message = None
        return events

    def _call(self, call: ToolCall) -> list[dict]:
        self.call = {"id": item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call.id,
                     "name": call.name, "arguments": ""}
        self.items.append(self.call)
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": dict(self.call)}]

    def _call_done(self, call: ToolCall) -> list[dict]:
        item, at = self.call, self._call_at()
        assert item["arguments"] == call.arguments, "a call's streamed arguments are its arguments"
        item["status"], self.call = "completed", None
        return [{**at, "type": "response.function_call_arguments.done", "arguments": call.arguments,
                 "name": call.name},
                {"type": "response.output_item.done", "output_index": at["output_index"], "item": dict(item)}]

    def _call_at(self) -> dict:
        return {"item_id": self.call["id"], "output_index": len(self.items) - 1}

    def _at(self) -> dict:
        return {"item_id": self.message["id"], "output_index": self.items.index(self.message)}


def response_usage(out: dict) -> dict:
    """The Responses API's usage; reuse is `input_tokens_details.cached_tokens`, the think block
    `output_tokens_details.reasoning_tokens` (`reasoning.reasoning_tokens`)."""
    return {"input_tokens": out["prompt_tokens"], "input_tokens_details": {"cached_tokens": out["reused_tokens"]},
            "output_tokens": out["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": out.get("reasoning_tokens", 0)},
            "total_tokens": out["prompt_tokens"] + out["completion_tokens"]}


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")
