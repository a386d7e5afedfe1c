"""Reasoning: a model whose chat template carries `<think>` (Qwen3, QwQ, DeepSeek-R1 distills) writes
its reasoning in a `<think>...</think>` block before the answer. The server returns it apart from the
answer: `message.reasoning_content` in chat (streamed as `delta.reasoning_content`, vLLM's field) and a
`reasoning` output item in the Responses API (docs/agents.md, "Reasoning").

On by template detection: the chat template's text contains `</think>` (the server needs no
`--reasoning-parser` flag). The reply is read by transformers' `ResponseParser` (as tool calls are,
`tool_parse.py`) with a response template that has a `reasoning_content` field, the one transformers'
own server uses for Qwen3 (`<think>` ... `</think>`), whose delimiters here also take the newlines the
template writes around the block: the reasoning is the block's text without its edge newlines, and the
answer starts after the blank line, exactly as Qwen3's template renders the turn back. So an answer
sent back as the next turn's history renders as the prompt that extends this turn's (what the session
store reuses: everything but the think block, which the template strips from earlier turns).

Also `chat_template_kwargs` (vLLM's request field): variables for the chat template, e.g.
`{"enable_thinking": false}` (Qwen3's template then prefills an empty think block).
"""

from __future__ import annotations

import threading

from .protocol import APIError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING = "reasoning_content"
REASONING_FIELD = {"open_pattern": r"<think>\n*", "close_pattern": r"\n*</think>\n*", "content": "text",
                   "content_args": {"strip": False}}
# apply_chat_template's own arguments: not template variables
_RESERVED = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
             "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
             "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"}

_anchors: dict[str, str | None] = {}
_anchors_lock = threading.Lock()


def with_reasoning_tokens(tok, final: dict, reasoned: bool | None) -> dict:
    """A turn's last event `final` with its `reasoning_tokens` (usage's details) where the reply could
    reason (`reasoned`: whether its parser read a think block; None: it could not reason, `final` as is)."""
    if reasoned is None:
        return final
    return {**final, "reasoning_tokens": reasoning_tokens(tok, final["token_ids"], reasoned)}


def reasoning_tokens(tok, ids: list[int], reasoned: bool) -> int:
    """The reasoning tokens of a reply `ids` (usage's `reasoning_tokens`): those through the one that
    completes `</think>`, delimiters included; all of them when the reply `reasoned` but its block was
    never closed (cut by max_tokens); 0 without reasoning. O(log n) decodes: the prefix that first
    decodes with `</think>` is found by bisection."""
    if not ids or THINK_CLOSE not in tok.decode(ids, skip_special_tokens=False):
        return len(ids) if reasoned else 0
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if THINK_CLOSE in tok.decode(ids[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return lo


def reasons(tok) -> bool:
    """Whether replies under `tok`'s chat template are read for a `<think>` block."""
    return THINK_CLOSE in str(tok.chat_template or "")


def generation_anchor(tok) -> str | None:
    """The text the template's generation prompt adds (`<|im_start|>assistant\\n` for Qwen3): where a
    reply starts (the response template's start anchor). None when it adds nothing."""
    key = str(tok.chat_template)
    with _anchors_lock:
        if key not in _anchors:
            hi = [{"role": "user", "content": "Hi"}]
            try:
                bare = tok.apply_chat_template(hi, tokenize=False)
                full = tok.apply_chat_template(hi, add_generation_prompt=True, tokenize=False)
            except Exception:  # noqa: BLE001 - Jinja's errors have no common base beyond Exception
                bare = full = ""
            _anchors[key] = full[len(bare):] if full.startswith(bare) and len(full) > len(bare) else None
        return _anchors[key]


def reply_template(tok, tool_template: dict | None, calls: bool) -> dict | None:
    """The response template a reply is read with; None: the reply is plain text. `tool_template`: the
    turn's tool format's response template (None: no tools); `calls`: whether calls are parsed
    (tool_choice "none": tools are rendered, the reply is not read for calls)."""
    if not reasons(tok):
        return tool_template if calls else None
    if tool_template is not None:
        base = tool_template
    else:
        anchor = generation_anchor(tok)
        if anchor is None:
            return None
        base = {"version": 1, "defaults": {"role": "assistant"}, "start_anchor": anchor,
                "fields": {"content": {"content": "text", "content_args": {"strip": False}, "repeats": True,
                                       "join": ""}}}
    fields = {k: v for k, v in base["fields"].items() if calls or k != "tool_calls"}
    return {**base, "fields": {REASONING: REASONING_FIELD, **fields}}


def template_kwargs(value, param: str = "chat_template_kwargs") -> dict:
    """The request's `chat_template_kwargs`: an object of JSON values whose keys are not
    apply_chat_template's own arguments (a 400 naming the field otherwise)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise APIError(400, f"{param} must be an object of template variables", param=param, code="invalid_value")
    for k in value:
        if not isinstance(k, str) or not k.isidentifier() or k in _RESERVED:
            raise APIError(400, f"{param}.{k}: not a template variable this server passes (reserved: "
                           f"{', '.join(sorted(_RESERVED))})", param=f"{param}.{k}", code="invalid_value")
    return dict(value)
