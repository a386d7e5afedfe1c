"""What a chat template wraps tool results in, and the response-template field that keeps it out of replies.

Hermes / Qwen-style templates (the shipped `chatml_tools.jinja`, Qwen2.5's, Qwen3's) render a tool result
as `<tool_response>\\n...\\n</tool_response>` inside a user turn. A model that does not know the format
(SmolLM2-135M-Instruct) imitates the last turn it read and starts its answer after a tool result with
`<tool_response>\\n`: template control text, not an answer. The tags are found by rendering a probe
result through the template (`result_tags`: the XML-like tag right before the result and its closing tag
right after; none for a template that wraps results in nothing of the kind) and a field of the response
template swallows them wherever the reply writes them (`strip_field`): it opens on either tag and closes at
once, so the text between stays the answer's and streams as before.
"""

from __future__ import annotations

import re

FIELD = "tool_result_tags"            # the response template's field (its regions are empty: never reported)
PROBE_RESULT = "stateful_hf_probe_result"
_OPEN_BEFORE = re.compile(r"<([A-Za-z_][\w.-]*)>\s*$")           # `<tool_response>\n` ending right before it


def result_tags(render) -> tuple[str, str] | None:
    """(open, close) tags the template wraps a tool result in, e.g. ("<tool_response>",
    "</tool_response>"); None when it wraps it in no tag pair or cannot render one. `render(messages)`:
    the template's text of a chat (a user turn, a call, its result)."""
    call = {"id": "call_probe", "type": "function", "function": {"name": "stateful_hf_probe_tool", "arguments": "{}"}}
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_probe", "content": PROBE_RESULT}]
    try:
        text = render(chat)
    except Exception:  # noqa: BLE001 - Jinja's errors have no common base beyond Exception
        return None
    at = text.rfind(PROBE_RESULT)
    opened = _OPEN_BEFORE.search(text, 0, at) if at >= 0 else None
    if opened is None:
        return None
    close = f"</{opened.group(1)}>"
    if not re.match(r"\s*" + re.escape(close), text[at + len(PROBE_RESULT):]):
        return None
    return f"<{opened.group(1)}>", close


def strip_field(tags: tuple[str, str]) -> dict:
    """A response-template field that consumes either tag (and the blanks before it, one newline after)
    wherever a reply writes it: opened by the tag, closed by the empty match right after (no content)."""
    names = "|".join(re.escape(t) for t in tags)
    return {"open_pattern": rf"\s*(?:{names})\n?", "close_pattern": "", "content": "text", "optional": True}


def with_strip_field(template: dict | None, tags: tuple[str, str] | None) -> dict | None:
    """`template` (a response template) with the field that strips `tags` (as it is when either is None)."""
    if template is None or tags is None:
        return template
    return {**template, "fields": {**template["fields"], FIELD: strip_field(tags)}}
