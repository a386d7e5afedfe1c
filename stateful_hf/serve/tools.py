"""Function tools in a chat turn: the request's `tools`, `tool_choice`, `parallel_tool_calls` and the
tool turns of its history, checked (a 400 naming the field) and rendered through a chat template that
renders tools. docs/agents.md describes them.

The template: the tokenizer's own when it renders tools (probed once per template: a probe tool's name
must appear in the prompt); else, for a ChatML template (SmolLM2-135M-Instruct's renders no tools), the
shipped `stateful_hf/serve/templates/chatml_tools.jinja` (Hermes / Qwen2.5 `<tool_call>` JSON lines),
given the model's own default system prompt so a chat without tools renders as before; else a 400
naming `tools` (`--chat-template PATH` gives the server one that renders them). Replies are parsed by
transformers' response parser (`tool_parse.py`) with the tokenizer's `response_template`, else the
shipped `chatml_tools.response.json`.

`tool_choice` "required" or a named function is forced by prefilling the call's opening in the prompt
(`ToolPlan.prefill`); `ToolPlan.json_schema` is the JSON schema the call object must match: the seam
for constrained decoding (docs/agents.md, "Forcing a call").
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .call_schema import call_schema
from .protocol import APIError
from .result_tags import result_tags, with_strip_field

TEMPLATES = Path(__file__).parent / "templates"
CHATML_TOOLS = TEMPLATES / "chatml_tools.jinja"
CHATML_RESPONSE = TEMPLATES / "chatml_tools.response.json"
CALL_OPEN = "<tool_call>\n"                      # the shipped format's opening of one call
CALL_CLOSE = "</tool_call>"
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_PROBE = {"type": "function", "function": {"name": "stateful_hf_probe_tool", "description": "probe",
                                           "parameters": {"type": "object", "properties": {}}}}
CHATML_OPEN = "<|im_start|>assistant\n"


@dataclass(frozen=True)
class ToolFormat:
    """How a tokenizer's turns with tools are rendered and parsed. `template`: the Jinja text to render
    with (None: the tokenizer's own); `kwargs`: extra template variables; `error`: why tools cannot be
    rendered (None: they can)."""

    template: str | None
    kwargs: dict
    response_template: dict | None     # with the field that strips the tool-result tags (result_tags.py)
    error: str | None = None


_formats: dict[str, ToolFormat] = {}
_formats_lock = threading.Lock()


def tool_format(tok) -> ToolFormat:
    """The tool format of `tok`'s current chat template (probed once per template text)."""
    key = str(tok.chat_template)
    with _formats_lock:
        if key not in _formats:
            _formats[key] = _probe(tok)
        return _formats[key]


def _probe(tok) -> ToolFormat:
    shipped = json.loads(CHATML_RESPONSE.read_text())
    own = getattr(tok, "response_template", None) or shipped
    hi = [{"role": "user", "content": "Hi"}]
    try:
        if _PROBE["function"]["name"] in tok.apply_chat_template(hi, tools=[_PROBE], add_generation_prompt=True,
                                                                   tokenize=False):
            tags = result_tags(lambda chat: tok.apply_chat_template(chat, tools=[_PROBE], tokenize=False))
            return ToolFormat(None, {}, with_strip_field(own, tags))
        plain = tok.apply_chat_template(hi, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - Jinja's errors have no common base beyond Exception
        return ToolFormat(None, {}, None, f"the chat template fails with tools: {type(e).__name__}: {e}")
    if not plain.endswith(CHATML_OPEN):
        return ToolFormat(None, {}, None, "the model's chat template does not render tools; start the server with "
                          "--chat-template PATH naming one that does")
    system = re.match(r"<\|im_start\|>system\n(.*?)<\|im_end\|>\n", plain, re.S)
    kwargs = {"default_system": system.group(1) if system else None}
    text = CHATML_TOOLS.read_text()
    tags = result_tags(lambda chat: tok.apply_chat_template(chat, tools=[_PROBE], tokenize=False, chat_template=text,
                                                            **kwargs))
    return ToolFormat(text, kwargs, with_strip_field(shipped, tags))


@dataclass
class ToolPlan:
    """A turn with tools: what to render and how to read the reply. `choice`: "auto", "none",
    "required" or a function's name. `prefill`: text appended to the prompt (forcing a call).
    `json_schema`: the JSON schema the forced call object (`{"name", "arguments"}`) must match; `forced`:
    what the generated rest of a forced call is held to (structured.py: its grammar). `stop`: extra stop strings
    (the end of the first call when parallel_tool_calls is false or a named function is forced)."""

    tools: list[dict]
    choice: str
    parallel: bool
    format: ToolFormat
    prefill: str = ""
    json_schema: dict | None = None
    forced: tuple[dict, str] | None = None       # (schema, text after it) the generated rest of a forced call obeys
    stop: tuple[str, ...] = ()
    names: list[str] = field(default_factory=list)

    @property
    def parses(self) -> bool:
        """Whether the reply is parsed for calls ("none": the reply is text)."""
        return self.choice != "none" and bool(self.tools)


def check_tools(tools, param: str = "tools", flat: bool = False) -> list[dict]:
    """The request's tools as chat templates take them (`{"type": "function", "function": {...}}`);
    a 400 naming the field at fault. `flat`: the Responses API's shape (`{"type": "function", "name",
    ...}`)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad(f"{param} must be a list of tools", param)
    out, seen = [], set()
    for i, t in enumerate(tools):
        at = f"{param}.{i}"
        if not isinstance(t, dict):
            raise _bad(f"{at} must be an object", at)
        if t.get("type") != "function":
            raise APIError(400, f"{at}.type: only function tools are supported, got {t.get('type')!r}",
                           param=f"{at}.type", code="unsupported_parameter")
        fn = t if flat else t.get("function")
        fat = at if flat else f"{at}.function"
        if not isinstance(fn, dict):
            raise _bad(f"{fat} must be an object with a name", fat)
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise _bad(f"{fat}.name must be 1-64 letters, digits, '_' or '-'; got {name!r}", f"{fat}.name")
        if name in seen:
            raise _bad(f"{fat}.name: the tool {name!r} is defined twice", f"{fat}.name")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise _bad(f"{fat}.parameters must be a JSON schema object ({{\"type\": \"object\", ...}})",
                       f"{fat}.parameters")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _bad(f"{fat}.description must be a string", f"{fat}.description")
        clean = {"name": name, **({"description": desc} if desc else {}),
                 "parameters": params if params is not None else {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": clean})
    return out


def check_tool_choice(choice, tools: list[dict], param: str = "tool_choice", flat: bool = False) -> str:
    """"auto", "none", "required" or the name of a function in `tools` (a 400 otherwise)."""
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _bad(f"{param} must be 'auto', 'none', 'required' or a function; got {choice!r}", param)
        if choice == "required" and not tools:
            raise _bad(f"{param} 'required' needs tools", param)
        return choice
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise _bad(f"{param} must be 'auto', 'none', 'required' or {{\"type\": \"function\", ...}}", param)
    fn = choice if flat else choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if name not in names:
        at = f"{param}.name" if flat else f"{param}.function.name"
        raise _bad(f"{at}: {name!r} is not one of the request's tools ({', '.join(names) or 'none'})", at)
    return name


def check_history(messages: list[dict], param: str = "messages") -> list[dict]:
    """Template messages (role, content, reasoning_content, tool_calls, tool_call_id) from the request's: an assistant's
    `tool_calls` checked, and every tool message answering a call made earlier (a 400 naming the field)."""
    out, calls = [], set()
    for i, m in enumerate(messages):
        role = m["role"]
        msg = {"role": role, "content": m.get("content")}
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):   # a reasoning model's
            msg["reasoning_content"] = m["reasoning_content"]
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = []
            for j, c in enumerate(m["tool_calls"] or []):
                at = f"{param}.{i}.tool_calls.{j}"
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise _bad(f"{at}.function must be an object with a name", f"{at}.function")
                args = fn.get("arguments", "{}")
                if not isinstance(args, str):
                    args = json.dumps(args, ensure_ascii=False)
                cid = c.get("id") or c.get("call_id")
                if not isinstance(cid, str) or not cid:
                    raise _bad(f"{at}.id must be a non-empty string", f"{at}.id")
                calls.add(cid)
                msg["tool_calls"].append({"id": cid, "type": "function",
                                          "function": {"name": fn["name"], "arguments": args}})
        elif role == "tool":
            cid = m.get("tool_call_id")
            if cid not in calls:
                raise _bad(f"{param}.{i}.tool_call_id: a tool message must answer a call of an earlier assistant "
                           f"message; no call has the id {cid!r}", f"{param}.{i}.tool_call_id")
            msg["tool_call_id"] = cid
        out.append(msg)
    return out


def needs_tools(messages: list[dict], tools: list[dict]) -> bool:
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def plan(tok, tools: list[dict], choice: str, parallel: bool) -> ToolPlan:
    """The tool plan of a turn (a 400 naming `tools` when the chat template cannot render them)."""
    fmt = tool_format(tok)
    if fmt.error is not None:
        raise APIError(400, fmt.error, param="tools", code="unsupported_parameter")
    p = ToolPlan(tools, choice, parallel, fmt, names=[t["function"]["name"] for t in tools])
    if p.parses and (not parallel or choice not in ("auto", "required")):    # one call, or one named call
        p.stop = (CALL_CLOSE,)
    if choice in ("auto", "none"):
        return p
    chosen = [t for t in tools if choice == "required" or t["function"]["name"] == choice]
    p.json_schema = call_schema([t["function"] for t in chosen])        # $refs rebased (call_schema.py)
    if fmt.response_template is not None and fmt.response_template.get("fields", {}).get("tool_calls", {}).get(
            "open_pattern") != json.loads(CHATML_RESPONSE.read_text())["fields"]["tool_calls"]["open_pattern"]:
        raise APIError(400, "tool_choice: this chat template's tool-call format cannot be forced (only the "
                       "<tool_call> JSON format can)", param="tool_choice", code="unsupported_parameter")
    p.prefill = CALL_OPEN
    p.forced = (p.json_schema, "\n" + CALL_CLOSE)
    if len(chosen) == 1:      # one function to choose from: name it, so the model writes its arguments
        fn = chosen[0]["function"]
        p.prefill += f'{{"name": {json.dumps(fn["name"])}, "arguments": '
        p.forced = (fn["parameters"], "}\n" + CALL_CLOSE)
        if not fn["parameters"].get("properties"):     # and no arguments to write: the call is whole
            p.prefill += "{}}\n" + CALL_CLOSE
            p.forced = None
    return p


def render(tok, messages: list[dict], p: ToolPlan, variables: dict | None = None) -> str:
    """The prompt text of a turn with tools: the template's, plus the plan's prefill. `variables`:
    the request's template variables (`chat_template_kwargs`)."""
    kwargs = {**(variables or {}), **p.format.kwargs}
    if p.format.template is not None:
        kwargs["chat_template"] = p.format.template
    try:
        text = tok.apply_chat_template(messages, tools=p.tools or None, add_generation_prompt=True, tokenize=False,
                                       **kwargs)
    except Exception as e:  # noqa: BLE001 - Jinja's errors have no common base beyond Exception
        raise APIError(400, f"the chat template failed on these messages and tools: {e}", param="messages",
                       code="invalid_messages") from None
    return text + p.prefill


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")
